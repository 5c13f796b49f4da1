"""The product's modules (the top-level *.py files) import each other without a circle, lazy imports
(inside functions) included: a reader can take any one of them with only what it imports."""

import ast
import glob
import os
import re

from conftest import ROOT


PACKAGES = ("runtime", "tasks")  # the folders of the product's modules, beside the top-level files


def product_files() -> dict[str, str]:
    """Each product module's dotted name -> its file: the top-level files and those of PACKAGES."""
    files = {os.path.basename(f)[:-3]: f for f in glob.glob(os.path.join(ROOT, "*.py"))}
    for package in PACKAGES:
        for f in glob.glob(os.path.join(ROOT, package, "*.py")):
            name = os.path.basename(f)[:-3]
            files[package if name == "__init__" else f"{package}.{name}"] = f
    return files


def imports() -> dict[str, set[str]]:
    """Each product module -> the product modules it imports anywhere in its file."""
    files = product_files()
    graph = {}
    for name, path in files.items():
        found = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                found.add(node.module)
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = {m for m in found if m in files} - {name}
    return graph


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (a path that ends where it starts), or None (depth-first search)."""
    state = {}  # module -> "open" while on the path, "done" once all it reaches is known to be free of circles

    def visit(name, path):
        state[name] = "open"
        for dep in sorted(graph[name]):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep, path + [dep])):
                return found
        state[name] = "done"

    for name in sorted(graph):
        if name not in state and (found := visit(name, [name])):
            return found
    return None


def test_the_modules_import_each_other_without_a_circle():
    graph = imports()
    assert {"tba", "searcher", "runtime.checks", "runtime.errors", "tasks.arith"} <= graph.keys()
    assert graph["runtime.errors"] == set(), "runtime/errors.py imports nothing of the project"
    assert circle(graph) is None, f"import circle: {' -> '.join(circle(graph))}"


def test_a_circle_is_found():
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert circle({"a": {"b"}, "b": set()}) is None


# a file:line citation into a dependency, from its package's root: vllm/v1/worker/utils.py:716-772
CITED = re.compile(r"(?<![\w/.])((?:vllm|torch|transformers|peft|multiprocessing)/[\w/]+\.py):(\d+)(?:-(\d+))?")


def test_cited_lines_exist_in_the_installed_versions():
    """Comments cite vLLM, torch, transformers, peft and Python by file and line where a choice rests on them
    (docs/gpu.md: the pinned versions). Each cited file exists here and holds the cited lines, so that a
    version change that moves one fails here, naming the comment to read again."""
    import importlib.util
    files = list(product_files().values()) + glob.glob(os.path.join(ROOT, "tools", "*.py"))
    cited = [(os.path.basename(f), m) for f in files for m in CITED.finditer(open(f).read())]
    assert len(cited) >= 40, "the citations are found"
    stale = []
    for where, m in cited:
        package = m.group(1).split("/")[0]
        root = os.path.dirname(os.path.dirname(importlib.util.find_spec(package).origin))
        path, last = os.path.join(root, m.group(1)), int(m.group(3) or m.group(2))
        lines = len(open(path).read().splitlines()) if os.path.isfile(path) else 0
        if lines < last:
            stale.append(f"{where}: {m.group(0)} ({'missing' if not lines else f'{lines} lines'})")
    assert not stale, f"citations that the installed versions do not hold: {stale}"


def test_the_random_streams_have_distinct_tags():
    from runtime import seeds
    tags = {name: value for name, value in vars(seeds).items() if name.isupper()}
    assert len(tags) >= 7 and len(set(tags.values())) == len(tags), tags


def test_the_top_level_is_the_algorithm():
    """The brief's five files at the top, and nothing else of Python: the machinery is in runtime/, the tasks
    in tasks/; a reader meets the searcher's loop first in its file."""
    top = sorted(os.path.basename(f) for f in glob.glob(os.path.join(ROOT, "*.py")))
    assert top == ["buffer.py", "loss.py", "rewards.py", "searcher.py", "tba.py"], top
    lines = open(os.path.join(ROOT, "searcher.py")).read().splitlines()
    assert next(i for i, line in enumerate(lines) if line.startswith("def run(")) < 100


TASK_WORDS = re.compile(r"redteam|red.team|victim|judge|classifier|win.rate|toxicity|reward.model", re.I)


def test_the_algorithm_names_no_task():
    """No code of the trainer, the searcher or the buffer names a task, or tests a task's property by proxy:
    they ask the task's entry (tasks/task.py)."""
    for name in ("tba.py", "searcher.py", "buffer.py"):
        found = [f"{name}:{i}: {line.strip()}" for i, line in enumerate(open(os.path.join(ROOT, name)), 1)
                 if TASK_WORDS.search(line)]
        assert not found, found
