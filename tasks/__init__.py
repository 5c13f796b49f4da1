"""The tasks, one file each (task.py says what a task is). Every module of this folder but task.py is a task,
named by its file, so a new task is its file alone:

- `arith`: the toy task, two-digit addition (built in, no download);
- `countdown`: a second toy task, TinyZero's countdown (three numbers and a target; built in);
- `gsm8k`: the paper's headline task, with the paper's reward;
- `tldr`: the paper's summarisation task, scored by a reward model, evaluated by win rate and KL;
- `redteam`: the paper's red-teaming task after Lee et al.: an attacker against a frozen victim;
- `math`: MATH, the paper's Sec. 6 run (Qwen 2.5 7B, TBA′ against Dr. GRPO), with the authors' grading.

`TASKS` maps each `--task` name to the module that holds its `TASK`; `get(name)` imports it (only the
task a run uses is imported).
"""

import importlib
import pkgutil

TASKS = {m.name: f"tasks.{m.name}" for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name)
         if m.name != "task"}


def get(name: str):
    """The Task of `--task name` (an entry may also be a Task itself, registered in code)."""
    entry = TASKS[name]
    return importlib.import_module(entry).TASK if isinstance(entry, str) else entry
