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


def test_the_picture_of_the_processes_names_what_exists():
    """Each Class.member, class, file's function and message kind that the README's picture of the processes names
    is in the code (the picture is text: edit it with the code)."""
    picture = re.search(r"## The processes\n\n```text\n(.*?)```", README, re.S).group(1)
    files = [f for f in glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "runtime", "*.py"))]
    members = {}
    for f in files:
        for node in ast.parse(open(f).read()).body:
            if isinstance(node, ast.ClassDef):
                members[node.name] = {m.name for m in node.body if isinstance(m, ast.FunctionDef)} | {
                    m.target.id for m in node.body if isinstance(m, ast.AnnAssign)}
    pairs = re.findall(r"\b([A-Z]\w+)\.(\w+)", picture)
    assert len(pairs) >= 6, picture
    for cls, member in pairs:
        assert member in members.get(cls, ()), f"{cls}.{member}"
    for cls in re.findall(r"\b((?:[A-Z][a-z]+){2,})\b", picture):  # ReplayBuffer, SharedWeights
        assert cls in members, cls
    for path, name in re.findall(r"(\w+\.py)'s (\w+)", picture):
        assert name in definitions(path), (path, name)
    code = "".join(open(f).read() for f in files)
    for kind in re.findall(r'"kind":\s*"(\w+)"', picture):
        assert f'kind="{kind}"' in code, kind
