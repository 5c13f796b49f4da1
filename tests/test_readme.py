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
    """(file, name) of each function or class the reading order names."""
    stops = re.findall(r"^\d+\. (.*(?:\n   .*)*)", section("Read the code in this order"), re.M)
    return [(path, name) for stop in stops
            for path, names in re.findall(r"`([\w/]+\.py)`(?:, |'s )((?:`[\w.]+`(?:,| and| )*)*)", stop)
            for name in re.findall(r"`([\w.]+)`", names)]


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
