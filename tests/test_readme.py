"""The README keeps to the tree: its map of the house names every file that exists and no file that does
not, its reading order names functions that exist where it says, and it stays short enough to read."""

import ast
import glob
import os
import re

from conftest import ROOT

README = open(os.path.join(ROOT, "README.md")).read()


def section(title: str) -> str:
    start = README.index(f"## {title}")
    return README[start:README.index("\n## ", start + 1)]


def test_the_house_map_matches_the_tree():
    table = section("The house")
    rows = [row.split(" | ") for row in table.splitlines() if row.startswith("| `")]
    named = {name for row in rows for name in re.findall(r"`([^`]+)`", row[0])}
    assert named, "no map of the house in the README"
    for name in named:
        assert os.path.exists(os.path.join(ROOT, name)), f"the README names {name}, which does not exist"
    # a folder's files are named, by name, in the row that names the folder, unless the row says the folder holds
    # "one file per" thing (tasks/: a new task is its file, and no list to keep)
    in_row = {folder.rstrip("/"): " ".join(row) for row in rows for folder in re.findall(r"`([^`]+/)`", row[0])}
    each = {folder for folder, row in in_row.items() if "one file per" in row}
    files = [os.path.relpath(f, ROOT) for pattern in ("*.py", "*.sh", "requirements*.txt", "runtime/*.py", "tools/*.py",
                                                     "tasks/*.py", "scripts/*.sh") for f in glob.glob(os.path.join(ROOT, pattern))]
    named_in = lambda f: re.search(rf"`{re.escape(os.path.basename(f))}`|`{re.escape(os.path.basename(f)[:-3])}`",
                                   in_row.get(os.path.dirname(f), ""))
    missing = [f for f in files if f not in named and os.path.basename(f) != "__init__.py" and not named_in(f)
               and os.path.dirname(f) not in each]
    assert not missing, f"not in the README's map of the house: {missing}"


def test_the_reading_order_names_what_exists():
    """Each stop of "Read the code in this order" names a file and what to read in it: they exist."""
    stops = re.findall(r"^\d+\. (.*(?:\n   .*)*)", section("Read the code in this order"), re.M)
    assert len(stops) == 8
    for stop in stops:
        for path, names in re.findall(r"`([\w/]+\.py)`(?:, |'s )((?:`[\w.]+`(?:,| and| )*)*)", stop):
            defined = {n.name for n in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read()))
                       if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
            for name in re.findall(r"`([\w.]+)`", names):
                assert name.split(".")[-1] in defined, f"{path} has no {name}"


def reading_order() -> list[tuple[str, str]]:
    """(file, name) of each function or class the reading order names, read as written: a stop's list of names may
    run over a line break (before, the pattern stopped there, and left `ReuseCap`, `Engine.load` and others out of
    the count)."""
    stops = re.findall(r"^\d+\. (.*(?:\n   .*)*)", section("Read the code in this order"), re.M)
    return [(path, name) for stop in stops
            for path, names in re.findall(r"`([\w/]+\.py)`(?:, |'s )((?:`[\w.]+`(?:,|\s+and|\s)*)*)", stop)
            for name in re.findall(r"`([\w.]+)`", names)]


def definitions(path: str) -> dict[str, ast.AST]:
    """A file's functions and classes, and its classes' methods as Class.method."""
    found = {}
    for node in ast.parse(open(os.path.join(ROOT, path)).read()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found[node.name] = node
            if isinstance(node, ast.ClassDef):
                found.update({f"{node.name}.{m.name}": m for m in node.body if isinstance(m, ast.FunctionDef)})
    return found


def test_the_reading_order_names_what_the_path_calls():
    """Every function or class of the path's files that a function of the reading order calls by name (a function of
    its file or one imported from another of them, a method through `self`, or through `t`, tba.train's Trainer) is
    named in the reading order too, or is one of the rooms the README names below it (a mode's body, one call on the
    path): nothing the default step runs is hidden from the reader."""
    named = set(reading_order())
    files = {path for path, _ in named} | {"tba.py", "searcher.py", "buffer.py", "loss.py", "rewards.py"}
    defs = {path: definitions(path) for path in files}
    module = {path[:-3].replace("/", "."): path for path in files}
    skip = section("Read the code in this order").split("A first read may skip")[1]  # its last paragraph
    rooms = set(re.findall(r"`([\w.]+)`", skip))
    unnamed = set()
    for path, name in named:
        node, cls = defs[path][name], name.split(".")[0] if "." in name else None
        imported = {a.asname or a.name: module[n.module] for n in ast.parse(open(os.path.join(ROOT, path)).read()).body
                    if isinstance(n, ast.ImportFrom) and n.module in module for a in n.names}
        for call in (c for c in ast.walk(node) if isinstance(c, ast.Call)):
            f, target = call.func, None
            if isinstance(f, ast.Name):
                target = (path, f.id) if f.id in defs[path] else (imported[f.id], f.id) if f.id in imported else None
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in ("self", "t"):
                owner = cls if f.value.id == "self" else "Trainer"
                target = (path, f"{owner}.{f.attr}") if f"{owner}.{f.attr}" in defs[path] else None
            if target and target[1] in defs[target[0]] and target not in named and target[1] not in rooms \
                    and target[1].split(".")[-1] not in rooms and target != (path, name):
                unnamed.add(f"{target[0]}:{target[1]} (called by {name})")
    assert not unnamed, f"the path calls what the reading order does not name: {sorted(unnamed)}"


PATH_BUDGET = 700  # lines: the learner's path of one TBA step in the default run (issue 42: 808 before, at most 700)


def test_the_learners_path_stays_short():
    """The functions and classes the reading order names, each counted whole (docstring and comments too): at most
    PATH_BUDGET lines. A mode that joins the path is one call there, its body in a room of its own."""
    lines = {}
    for path, name in reading_order():
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        scope = tree.body
        for part in name.split("."):
            node = next(n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
            scope = node.body
        lines[f"{path}:{name}"] = node.end_lineno - node.lineno + 1
    assert len(lines) >= 40, lines  # the path named, not a part of it
    total = sum(lines.values())
    assert total <= PATH_BUDGET, f"the reading order's functions hold {total} lines (budget {PATH_BUDGET}): {lines}"


def test_the_readme_is_short():
    assert len(README.splitlines()) <= 300


def test_the_synchronous_baseline_is_on_policy():
    """Each command that the README or tba.py's docstring calls the synchronous baseline runs one: --lag 0, every
    batch its step's own rounds, each trajectory used once. `--searchers 0` alone still replays the buffer (m = 0.95
    of a batch's prompts from the last round, the rest from the whole buffer: staleness up to 51 steps in 60)."""
    from runtime import checks
    from runtime.config import Config
    docstring = ast.get_docstring(ast.parse(open(os.path.join(ROOT, "tba.py")).read()))
    for text in (README, docstring):
        lines = [line for line in text.splitlines() if "tba.py" in line and "synchronous" in line.split("#")[-1]]
        assert lines
        for line in lines:
            assert checks.parse(Config, line.split("#")[0].split("tba.py")[1].split()).lag == 0, line
