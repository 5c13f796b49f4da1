"""The README's file map matches the tree: every file it names exists, and every top-level Python
file, run script and tool is named (a newcomer finds each file's purpose there)."""

import glob
import os
import re

from conftest import ROOT


def test_file_map_matches_the_tree():
    text = open(os.path.join(ROOT, "README.md")).read()
    table = text[text.index("## Files"):text.index("\n## ", text.index("## Files") + 1)]
    named = {name for row in table.splitlines() if row.startswith("| `")
             for name in re.findall(r"`([^`]+)`", row.split(" | ")[0])}
    assert named, "no file map in the README"
    for name in named:
        assert os.path.exists(os.path.join(ROOT, name)), f"the README names {name}, which does not exist"
    files = [os.path.relpath(f, ROOT) for pattern in ("*.py", "*.sh", "tools/*.py", "requirements*.txt")
             for f in glob.glob(os.path.join(ROOT, pattern))]
    missing = sorted(f for f in files if f not in named)
    assert not missing, f"not in the README's file map: {missing}"
