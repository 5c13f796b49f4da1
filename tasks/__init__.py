"""The tasks, one file each (task.py says what a task is; the README's Tasks, and docs/tasks.md, list them). Every
module of this folder but task.py is a task, named by its file, so a new task is its file alone. `TASKS` maps each
`--task` name to its module (found by file name: nothing is imported to list them); `get(name)` imports it. A file
that does not make a task is refused in one line naming it where it is used, and leaves the other tasks alone:
`names()` lists the tasks that load, each imported with a deadline (one that waits at its top is left)."""

import importlib
import importlib.util
import os
import pkgutil
import threading
import traceback

from runtime.errors import ConfigError

TASKS = {m.name: f"tasks.{m.name}" for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name)
         if m.name != "task"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def get(name: str, deadline: float | None = None):
    """The Task of `--task name` (an entry may also be a Task itself, registered in code); refused in one line
    naming its file where the file does not make one, or does not import within `deadline` s (ConfigError)."""
    from tasks.task import Task
    entry = TASKS[name]
    if not isinstance(entry, str):
        return entry
    task = getattr(module(entry) if deadline is None else within(entry, deadline), "TASK", None)
    if not isinstance(task, Task):
        raise ConfigError(f"--task: {where(entry)} holds no `TASK = Task(...)` (tasks/task.py says what a task is)")
    return task


def module(entry: str):
    """The module `entry`, imported; refused in one line naming its file where it does not import, or where a
    folder of its name shadows it."""
    spec = importlib.util.find_spec(entry)
    # A folder with an __init__ file (any suffix Python loads) is imported before a file of its name beside it
    # (importlib's FileFinder.find_spec looks for the package first); a folder without one never shadows it.
    folder = os.path.dirname(spec.origin) if spec and spec.origin and spec.submodule_search_locations else None
    if folder and os.path.isfile(folder + ".py"):
        raise ConfigError(f"--task: {relative(folder)}/ shadows {relative(folder)}.py (Python imports a folder "
                          f"holding {os.path.basename(spec.origin)} before a file of its name): rename or remove one")
    try:
        return importlib.import_module(entry)
    except Exception as e:  # a syntax error, a missing import, an error at its top level
        file = where(entry)
        raise ConfigError(f"--task: {file} does not import ({why(e, file)})") from None


def within(entry: str, deadline: float):
    """`module(entry)`, imported by a thread given `deadline` s: one that waits longer (a download at its top)
    is refused, and left to its thread."""
    box = []

    def load():  # its refusal too, raised in the caller's thread
        try:
            box.append(module(entry))
        except ConfigError as e:
            box.append(e)
    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(deadline)
    if not box:
        raise ConfigError(f"--task: {where(entry)} does not import within {deadline:g} s (it waits at its "
                          f"top level)")
    if isinstance(box[0], ConfigError):
        raise box[0]
    return box[0]


def why(e: Exception, file: str) -> str:
    """An import's error in a phrase: its kind, its message's first line and where (the last line of ours it
    ran; its line alone where that is in `file`)."""
    if isinstance(e, SyntaxError):
        at = (e.filename or "?", e.lineno)
    else:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<frozen")]
        at = (frames[-1].filename, frames[-1].lineno) if frames else None
    where = "" if at is None else f", line {at[1]}" if relative(at[0]) == file else f", {relative(at[0])} line {at[1]}"
    text = (e.msg if isinstance(e, SyntaxError) else str(e)).splitlines() or [""]
    return f"{type(e).__name__}: {text[0][:160]}{where}"


def where(entry: str) -> str:
    """The file of module `entry` (relative to the project where it is inside it)."""
    spec = importlib.util.find_spec(entry)
    return relative(spec.origin) if spec and spec.origin else entry


def relative(path: str) -> str:
    path = os.path.abspath(path)
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path


def names(deadline: float = 10.0) -> list[str]:
    """The tasks that load, each imported within `deadline` s."""
    out = []
    for name in TASKS:
        try:
            get(name, deadline)
            out.append(name)
        except ConfigError:
            pass
    return out
