"""docs/tutorial.md runs as it says: each of its command blocks (the exercises' answers too) is run as
written, in a copy of the repository and with fewer steps, and what the page says each run shows is checked on
its rows (staleness exactly min(step - 1, L) with --lag L, so 0 when synchronous; older batches with
--recency 0 than streaming; log Z near mean reward / beta; the partial reward above arith's, and learning;
the emulation named in the summary), and each example summary line matches its command."""

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import ROOT, copy_repo, env

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
    repo, outs = copy_repo(tmp_path / "repo"), {}  # (exercise 3 copies its task into tasks/)
    for argv in commands():
        argv = [sys.executable, *argv[1:]] if argv[0] == "python" else argv
        if argv[1:2] == ["tba.py"]:
            argv[argv.index("--steps") + 1] = str(STEPS)
        elif argv[1:2] == ["tools/plot.py"] and importlib.util.find_spec("matplotlib") is None:
            continue  # (the page says: pip install matplotlib)
        p = subprocess.run(argv, cwd=repo, env=env(tmp_path), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=600)
        assert p.returncode == 0, f"{shlex.join(argv)}\n{p.stdout[-3000:]}"
        if argv[1:2] == ["tba.py"]:
            out = os.path.join(repo, folder(argv, "--out"))
            rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
            outs[os.path.basename(out)] = (argv, rows, p.stdout)
    train = {name: [r for r in rows if r["kind"] == "train"] for name, (_, rows, _) in outs.items()}
    assert {"sync", "lag1", "lag2", "lag4", "emulated-sync"} <= set(outs)
    for name, (argv, _, _) in outs.items():  # 1, 3 and exercise 2: exactly min(step - 1, L), 0 if synchronous
        if "--lag" in argv:
            lag = int(folder(argv, "--lag"))
            got = [(r["staleness"], r["staleness_max"]) for r in train[name]]
            assert got == [(min(i, lag), min(i, lag)) for i in range(STEPS)], (name, got)
    stale = {name: sum(r["staleness"] for r in train[name][-3:]) / 3 for name in ("stream", "recency0")}
    assert stale["recency0"] > stale["stream"], stale  # exercise 1: the whole buffer is older than the recent
    for name in ("emulated-sync", "emulated-stream"):  # 5: the emulation named in the summary
        said = outs[name][2]
        assert "generation slowed 16x (emulated) | training slowed 8x (emulated)" in said, said[-2000:]
    stream = train["stream"]  # section 6, exercise 2: log Z about mean r / beta (log_z_fixed.py)
    assert all(abs(r["log_z"] - r["reward"] / r["beta"]) < 1 for r in stream) and len(stream) == STEPS, stream
    assert train["partial"][0]["reward"] > stream[0]["reward"]  # exercise 3: the half points, same weights
    held_out = [r["accuracy"] for r in outs["partial"][1] if r["kind"] == "eval"]
    assert held_out[-1] > held_out[0], held_out  # and its run learns
    assert "grpo" in outs
    if importlib.util.find_spec("matplotlib") is not None:
        assert all(os.path.getsize(f"{repo}/runs/tutorial/{png}") > 0 for png in ("runs.png", "lags.png"))
