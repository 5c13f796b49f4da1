"""docs/experiments.md as a researcher uses it: its code blocks put where their first lines say, in a copy of the
repository; then the quick tier stays green (no list of tasks, losses or flags to edit), and each example runs as
the page says: a new task warm-starts the tiny model on its demos, a loss that pools across prompts gets its whole
batch, a flag is on --help, and a shaped training reward leaves the held-out figures as they were."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, SMALL, copy_repo, env

PAGE = os.path.join(ROOT, "docs", "experiments.md")


def blocks() -> list[tuple[str, str, str]]:
    """(file, where, code) of each code block of the page, from its first line: "# FILE (WHERE)"."""
    out = []
    for code in re.findall(r"```python\n(.*?)```", open(PAGE).read(), re.S):
        first, _, rest = code.partition("\n")
        path, where = re.fullmatch(r"# (\S+) \((.+)\)", first).groups()
        out.append((path, where, rest))
    return out


def apply(repo: str):
    for path, where, code in blocks():
        target = os.path.join(repo, path)
        if where == "a new file":
            assert not os.path.exists(target), f"{path} exists already"
            open(target, "w").write(code)
        elif where == "at its end":
            open(target, "a").write("\n\n" + code)
        else:
            anchor = re.fullmatch(r"in Config, after the line of (\w+)", where).group(1)
            lines = open(target).read().split("\n")
            at = next(i for i, line in enumerate(lines) if line.startswith(f"    {anchor}:"))
            while not lines[at].rstrip().endswith(")"):  # the field's last line
                at += 1
            lines[at + 1:at + 1] = code.rstrip("\n").split("\n")
            open(target, "w").write("\n".join(lines))


def test_the_page_has_an_example_of_each_kind():
    kinds = {where for _, where, _ in blocks()}
    assert {path for path, _, _ in blocks()} >= {"loss.py", "runtime/config.py"} and "a new file" in kinds


def applied() -> bool:
    """Whether the page's new files are here already: this is a copy with its code applied, whose quick tier
    test_the_quick_tier_stays_green_with_the_pages_code runs."""
    return any(where == "a new file" and os.path.exists(os.path.join(ROOT, path)) for path, where, _ in blocks())


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A copy of the repository (its files as git sees them, tracked and new) with the page's blocks applied (in such
    a copy: the copy itself)."""
    if applied():
        return ROOT
    copy = copy_repo(tmp_path_factory.mktemp("experiments") / "repo")
    apply(copy)
    return copy


SPY = """import dataclasses, functools, json, sys
sys.path.insert(0, sys.argv[1])
import numpy as np, torch
import loss, tba
from buffer import Trajectory
from runtime import checks
from runtime.config import Config
from runtime.errors import ConfigError
from transformers import AutoModelForCausalLM
inner, calls, where = loss.LOSSES["tb_overlong"], [], ["the start-up probe"]

@functools.wraps(inner)  # its flags, reads and pools too
def spy(**kw):
    calls.append((where[0], kw.get("overlong_weight")))
    return inner(**kw)
loss.LOSSES["tb_overlong"] = spy
cfg = Config(loss="tb_overlong", overlong_weight=0.25, samples_per_prompt=4, micro_batch=2, temperature=1.0)
pools = checks.loss_pools(cfg)
rng = np.random.default_rng(0)
prompts = [rng.integers(4, 60, 5).tolist() for _ in range(2)]
groups = [[Trajectory(p, rng.integers(4, 60, 3).astype(np.int32), float(j % 2), -3.0, -3.0, 0,
                      truncated=int(p == 0 and j == 0)) for j in range(4)] for p in range(2)]
model = AutoModelForCausalLM.from_pretrained(sys.argv[2])
where[0] = "the training step"
c = dataclasses.replace(cfg, loss_pools=False)
tba.gradient(c)(model, groups, 0, 1, prompts, 0, torch.device("cpu"), c, beta=0.05)
where[0] = "the pooled step"
c = dataclasses.replace(cfg, loss_pools=True)
tba.gradient(c)(model, groups, 0, 1, prompts, 0, torch.device("cpu"), c, beta=0.05)
where[0] = "the probe at 1"
at_one = checks.loss_pools(Config(loss="tb_overlong"))
try:
    checks.check_unused(Config(loss="tb", overlong_weight=0.25))
    refused = None
except ConfigError as e:
    refused = str(e)
print(json.dumps(dict(calls=calls, pools=pools, at_one=at_one, refused=refused)))
"""


def test_a_losss_flag_reaches_every_call_of_the_loss(repo, tiny_model):
    """The page's loss flag, wired as it says (a Config field named in the loss's `flags`): its value (not the
    default) reaches every call of the loss, in the start-up probe, the training step's passes and the pooled step's
    alike (a flag wired by hand into one of them would miss the others: before, three option dicts); the probe, run
    with it, finds the loss pooling through `truncated` below 1 and not at 1; with another loss it is refused."""
    p = subprocess.run([sys.executable, "-c", SPY, repo, tiny_model], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=600, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert p.returncode == 0, p.stdout[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    calls = [(where, value) for where, value in got["calls"] if where != "the probe at 1"]
    assert {where for where, _ in calls} == {"the start-up probe", "the training step", "the pooled step"}, calls
    assert all(value == 0.25 for _, value in calls), calls
    assert got["pools"] is True and got["at_one"] is False
    assert got["refused"] == "--overlong-weight: acts only in --loss tb_overlong; here it would change nothing"


FRESH = """import io, json, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import tasks
from buffer import Trajectory
from runtime import checks
from runtime.config import Config
from runtime.errors import ConfigError
cfg = Config(task="arith_fresh", fresh_weight=1.0, recency=0.0, buffer_capacity=8)
buf = tasks.get("arith_fresh").buffer(cfg, None)
rng = np.random.default_rng(0)
buf.add([Trajectory(p, np.array([10 + i], np.int32), 1.0, -1.0, -1.0, 0) for p in range(4) for i in range(4)])
for _ in range(50):
    buf.sample(2, 2, rng)
f = io.BytesIO()
np.savez(f, **buf.state())
f.seek(0)
back = type(buf).from_state(dict(np.load(f, allow_pickle=False)))
counts = [[buf.draws.get((p, np.array([10 + i], np.int32).tobytes()), 0) for i in range(4)] for p in range(4)]
try:
    checks.check_unused(Config(task="arith_fresh", fresh_weight=1.0, lag=1))
    refused = None
except ConfigError as e:
    refused = str(e)
print(json.dumps(dict(same=back.draws == buf.draws, fresh=back.fresh, total=sum(buf.draws.values()), counts=counts,
                      refused=refused)))
"""


def test_the_buffers_sampling_change_keeps_its_state_and_acts_where_it_says(repo):
    """The page's buffer: its flag reaches it (from_config), each response's draws survive a save and a resume, with
    the knob; the less drawn are drawn more (50 batches of 2 x 2 over 4 x 4 responses: each prompt's four drawn
    about equally, never 4 to 1 as a uniform draw can be); with --lag its flag is refused in one line."""
    p = subprocess.run([sys.executable, "-c", FRESH, repo], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=600, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert p.returncode == 0, p.stdout[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["same"] and got["fresh"] == 1.0 and got["total"] == 50 * 2 * 2
    assert all(max(c) - min(c) <= 2 for c in got["counts"] if sum(c)), got["counts"]
    assert got["refused"] == ("--fresh-weight: acts only in streaming: with --lag every batch is its step's rounds, "
                              "each trajectory used once; here it would change nothing")


def tba(repo, tmp_path, *args, timeout=600):
    p = subprocess.run([sys.executable, os.path.join(repo, "tba.py"), *args], cwd=tmp_path, env=env(tmp_path),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return p.returncode, p.stdout


@pytest.mark.engine
def test_the_quick_tier_stays_green_with_the_pages_code(repo, tmp_path):
    """A new task file, a loss, a flag and a shaped reward's task, added as the page says, and no test, list or
    README line edited: the quick tier passes in the copy."""
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not engine", "-p", "no:cacheprovider",
                        "-x", "tests"], cwd=repo, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:]


@pytest.mark.engine
def test_the_pages_examples_run_as_it_says(repo, tiny_model, tmp_path):
    """--help lists the new task, loss and flag; `double` warm-starts the tiny model on its demos and trains; the
    pooled loss is found to pool and trains in passes of one sequence; a length penalty lowers the training reward
    of the same responses and leaves the held-out accuracy at step 0 exactly as arith's; a resume that changes the
    penalty is refused."""
    code, out = tba(repo, tmp_path, "--help")
    assert code == 0 and "double" in out and "pooled_tb" in out and "--length-penalty" in out
    assert "tb_overlong" in out and "--overlong-weight" in out
    small = [*SMALL, "--searchers", "0", "--steps", "2"]
    code, out = tba(repo, tmp_path, "--task", "double", *small, "--eval-every", "0", "--out", str(tmp_path / "double"))
    assert code == 0 and "building the tiny model for double" in out, out[-3000:]
    code, out = tba(repo, tmp_path, "--model", tiny_model, "--loss", "pooled_tb", "--micro-batch", "1", *small,
                    "--eval-every", "0", "--out", str(tmp_path / "pooled"))
    assert code == 0, out[-3000:]
    assert json.load(open(tmp_path / "pooled" / "config.json"))["loss_pools"] is True
    rows = {}
    for task, extra in (("arith", []), ("arith_short", ["--length-penalty", "0.05", "--save-every", "2"])):
        out_dir = tmp_path / task
        code, out = tba(repo, tmp_path, "--model", tiny_model, "--task", task, *small, "--eval-every", "0", *extra,
                        "--out", str(out_dir))
        assert code == 0, out[-3000:]
        rows[task] = [json.loads(line) for line in open(out_dir / "metrics.jsonl")]
    evals = {t: [r["accuracy"] for r in rows[t] if r["kind"] == "eval"] for t in rows}
    assert evals["arith"][0] == evals["arith_short"][0]  # the same weights, the same held-out figure
    train = {t: [r["reward"] for r in rows[t] if r["kind"] == "train"] for t in rows}
    assert train["arith_short"][0] < train["arith"][0]  # the same first batch, penalised
    code, out = tba(repo, tmp_path, "--model", tiny_model, "--task", "arith_short", "--length-penalty", "0.1",
                    *SMALL, "--searchers", "0", "--steps", "4", "--resume", str(tmp_path / "arith_short" / "checkpoint"))
    assert code == 2 and "--length-penalty 0.1 (was 0.05) cannot change mid-run" in out, out[-2000:]
    fresh = ["--model", tiny_model, "--task", "arith_fresh", "--fresh-weight", "1", "--recency", "0.5", *small,
             "--eval-every", "0", "--out", str(tmp_path / "fresh")]
    code, out = tba(repo, tmp_path, *fresh, "--save-every", "2")
    assert code == 0, out[-3000:]
    code, out = tba(repo, tmp_path, *fresh[:-2], "--steps", "4", "--resume", str(tmp_path / "fresh" / "checkpoint"))
    assert code == 0 and "left out" not in out, out[-3000:]
    with np.load(tmp_path / "fresh" / "checkpoint" / "buffer.npz", allow_pickle=False) as f:  # the resumed run's
        more, dropped = json.loads(str(f["more"])), str(f["dropped"])  # at step 4
    assert sum(n for _, n in more["draws"]["dict"]) == 4 * 4 * 4 and dropped == "[]"  # every draw, 4 x 4 a step
