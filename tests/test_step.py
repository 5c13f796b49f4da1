"""The step a learner is shown is the step that runs: a default run is traced in every process (the trainer, the fork
server, the searcher: tests/step_trace/), once for SHORT steps and once for LONG; the lines of the repository's own
files that run at least once every two steps more in the longer run are the step's. Each must lie in a function or
method the README's reading order names (by its own name: naming its class does not count), there are at most
STEP_BUDGET of them, and the named definitions span at most NAMED_BUDGET lines (the README says both).

    python tests/test_step.py        # the step's lines by file and function, and what the reading order misses
"""

import ast
import collections
import glob
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, env
from test_readme import definitions, reading_order

STEP_BUDGET = 420  # lines a step runs: 416 in 96 functions (88928d3: 434-437 in 96; 82050b1: 501-507 in 102)
NAMED_BUDGET = 1000  # lines the reading order's definitions span: 854 (88928d3: 889; 82050b1: 1,024; d4dd869: 1,778)
SHORT, LONG = 10, 20


def traced(steps: int, tmp) -> collections.Counter:
    """{(file, line): times run} over every process of `python tba.py --steps STEPS --eval-every 0`."""
    out = tmp / f"trace{steps}"
    out.mkdir()
    e = dict(env(tmp), TBA_TRACE_OUT=str(out), TBA_TRACE_ROOT=ROOT,
             PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests", "step_trace"), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tba.py"), "--steps", str(steps), "--eval-every", "0",
                        "--out", str(tmp / f"run{steps}")], cwd=str(tmp), env=e, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:]
    counts = collections.Counter()
    for f in glob.glob(str(out / "*.json")):
        for path, line, n in json.load(open(f)):
            counts[(path, line)] += n
    assert len(glob.glob(str(out / "*.json"))) >= 3, "the trainer, the fork server and the searcher each write theirs"
    return counts


def owner(path: str, line: int, cache={}) -> str:
    """The function (or Class.method) of `path` whose lines hold `line` (a nested function's are its enclosing one's;
    "<module>": none, as a lambda of a module-level table, which no reading order can name)."""
    if path not in cache:
        spans = []
        for node in ast.parse(open(os.path.join(ROOT, path)).read()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                inner = [m for m in node.body if isinstance(m, ast.FunctionDef)] if isinstance(node, ast.ClassDef) else []
                spans += [(m.lineno, m.end_lineno, f"{node.name}.{m.name}") for m in inner]
                spans.append((node.lineno, node.end_lineno, node.name))
        cache[path] = spans
    return next((name for start, end, name in cache[path] if start <= line <= end), "<module>")


def step_lines(short: collections.Counter, long: collections.Counter) -> dict:
    """{(file, line): its function} of the lines the longer run ran at least (LONG - SHORT) / 2 times more."""
    grown = [k for k in long if long[k] - short.get(k, 0) >= (LONG - SHORT) / 2]
    return {k: owner(*k) for k in grown}


def named(path: str, function: str, order: set) -> bool:
    """Whether the reading order names `function` (or Class.method) of `path` itself."""
    return (path, function) in order


def report(lines: dict) -> str:
    by = collections.Counter(lines.values())
    files = collections.Counter(path for path, _ in lines)
    order = set(reading_order())
    rows = [f"{n:4d}  {path}:{fn}{'' if named(path, fn, order) else '   <- not in the reading order'}"
            for (path, fn), n in sorted(collections.Counter((p, f) for (p, _), f in lines.items()).items())]
    return (f"{len(lines)} lines in {len(by)} functions over {len(files)} files\n" + "\n".join(rows))


@pytest.mark.engine
def test_what_a_step_runs_is_named_and_within_its_budget(tmp_path):
    lines = step_lines(traced(SHORT, tmp_path), traced(LONG, tmp_path))
    order = set(reading_order())
    unnamed = sorted({f"{path}:{fn}" for (path, _), fn in lines.items() if not named(path, fn, order)})
    assert not unnamed, f"a step runs what the README's reading order does not name: {unnamed}\n{report(lines)}"
    assert len(lines) <= STEP_BUDGET, f"a step runs {len(lines)} lines (budget {STEP_BUDGET})\n{report(lines)}"
    assert f"more than {STEP_BUDGET} lines" in open(os.path.join(ROOT, "README.md")).read(), "the README says the budget"


def test_the_reading_order_names_functions_within_its_budget():
    """The reading order names functions and methods, never a whole class, and their definitions span at most
    NAMED_BUDGET lines in all (the README says so): a learner reads what a step runs, not what sits beside it."""
    order, spans = reading_order(), 0
    for path, name in order:
        node = definitions(path)[name]
        assert not isinstance(node, ast.ClassDef), f"the reading order names the class {name} of {path}: name its methods"
        spans += node.end_lineno - node.lineno + 1
    assert spans <= NAMED_BUDGET, f"the reading order's definitions span {spans} lines (budget {NAMED_BUDGET})"
    assert f"at most {NAMED_BUDGET:,} lines" in open(os.path.join(ROOT, "README.md")).read(), "the README says it"


if __name__ == "__main__":
    import pathlib
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        print(report(step_lines(traced(SHORT, pathlib.Path(tmp)), traced(LONG, pathlib.Path(tmp)))))
