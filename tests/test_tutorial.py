"""docs/tutorial.md runs as it says: each of its command blocks is run as written, with fewer steps and its folders
under a temporary one, and what the page says each run shows is checked on its rows (staleness 0 when synchronous,
0, 1, 2, 3 and then exactly L with --lag 4, log Z near mean reward / beta, the emulation named in the
summary), and each example summary line matches its command."""

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import ROOT, env

PAGE = os.path.join(ROOT, "docs", "tutorial.md")
STEPS = 6  # enough for --lag 4's staleness to reach 4 (step 5 on)


def commands() -> list[list[str]]:
    """Each command line of the page's bash blocks, split as the shell would."""
    blocks = re.findall(r"```bash\n(.*?)```", open(PAGE).read(), re.S)
    return [shlex.split(line) for block in blocks for line in block.strip().splitlines()]


def folder(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_each_run_is_under_two_minutes_as_written_and_its_summary_matches():
    """The page's runs as a reader types them: the tutorial's runs, at most 60 steps each with the toy's batch, and
    each example summary line names its run's steps."""
    runs = [c for c in commands() if c[:2] == ["python", "tba.py"]]
    assert len(runs) >= 5, runs
    steps = [int(folder(c, "--steps")) for c in runs]
    assert all(s <= 60 for s in steps) and all("--prompts-per-step" not in c for c in runs), runs
    said = [int(n) for n in re.findall(r"^    done: (\d+) steps in \d+ s", open(PAGE).read(), re.M)]
    assert sorted(set(said)) == sorted(set(steps)), (said, steps)


@pytest.mark.engine
def test_the_tutorials_runs_show_what_it_says(tmp_path):
    outs = {}
    for argv in commands():
        argv = [a.replace("runs/tutorial", str(tmp_path / "tutorial")) for a in argv]
        if argv[:2] == ["python", "tba.py"]:
            argv[argv.index("--steps") + 1] = str(STEPS)
        elif argv[:2] == ["python", "tools/plot.py"] and importlib.util.find_spec("matplotlib") is None:
            continue  # (the page says: pip install matplotlib)
        p = subprocess.run([sys.executable, os.path.join(ROOT, argv[1]), *argv[2:]], cwd=str(tmp_path),
                           env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
        assert p.returncode == 0, f"{shlex.join(argv)}\n{p.stdout[-3000:]}"
        if argv[1] == "tba.py":
            rows = [json.loads(line) for line in open(os.path.join(folder(argv, "--out"), "metrics.jsonl"))]
            outs[os.path.basename(folder(argv, "--out"))] = ([r for r in rows if r["kind"] == "train"], p.stdout)
    sync, _ = outs["sync"]
    assert len(sync) == STEPS and {r["staleness_max"] for r in sync} == {0}  # 1: on-policy
    lag, _ = outs["lag4"]
    assert [r["staleness"] for r in lag] == [0.0, 1.0, 2.0, 3.0] + [4.0] * (STEPS - 4)  # 3: then exactly L
    assert max(r["staleness_max"] for r in lag) == 4
    for name in ("emulated-sync", "emulated-stream"):  # 5: the emulation named in the summary
        assert "generation slowed 16x (emulated) | training slowed 8x (emulated)" in outs[name][1], outs[name][1][-2000:]
    stream, _ = outs["stream"]  # section 6, exercise 2: log Z about mean r / beta (log_z_fixed.py)
    assert all(abs(r["log_z"] - r["reward"] / r["beta"]) < 1 for r in stream) and len(stream) == STEPS, stream
    assert "grpo" in outs
    if importlib.util.find_spec("matplotlib") is not None:
        assert os.path.getsize(tmp_path / "tutorial" / "runs.png") > 0
