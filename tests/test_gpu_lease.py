"""tests/gpu_lease.sh on the CPU. On this machine as it is: the setup runs and each GPU stage refuses in one line.
With a stand-in for Python that fakes what torch says of CUDA (the GPU count, the card), stands in for
tools/gpu_checks.py and tools/gpu_probe.py (a part that hangs as their time-out ends it, one that never ends) and runs
a small file of tests in place of the script's selection: its stages in their order, each under `timeout` within
BUDGET, which fits one command of a lease, a hung part named and the parts after it run again, a cut that keeps what
ran, its refusals (only without torch or CUDA after the setup). And its selection: every test marked `cuda` is in its
files, and all of them skip here.
tools/gpu_checks.py's and gpu_probe.py's own tests: tests/test_gpu_probe.py."""

import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import ROOT

SCRIPT = os.path.join(ROOT, "tests", "gpu_lease.sh")

# What a CUDA build on a GPU node says, before the setup's own code runs
PRELUDE = """
import os, sys, types
import torch
n = int(os.environ["FAKE_GPUS"])
torch.cuda.device_count = lambda: n
torch.version.cuda = "12.8" if n else None
torch.cuda.get_device_name = lambda i=0: "NVIDIA H100 80GB HBM3"
torch.cuda.get_device_capability = lambda i=0: (9, 0)
torch.cuda.get_device_properties = lambda i=0: types.SimpleNamespace(total_memory=80 * 2**30)
torch.cuda.nccl.version = lambda: (2, 27, 3)
torch.__version__ = os.environ.get("FAKE_TORCH", torch.__version__)
if os.environ.get("FAKE_SETUP") == "crash":  # a setup that fails, but not for want of torch or CUDA
    torch.cuda.nccl.version = lambda: 1 / 0
"""

STUB = """#!{python}
import json, os, sys, time
real = {python!r}
args = sys.argv[1:]
if args[:1] == ["-"]:  # the setup
    code = sys.stdin.read()
    prelude = open(os.environ["FAKE_PRELUDE"]).read()
    if os.environ.get("FAKE_SETUP") == "no torch":
        prelude = "import sys\\nsys.modules['torch'] = None\\n"  # import torch: ImportError
    sys.argv = ["-"]
    sys.path.insert(0, os.getcwd())
    exec(compile(prelude + code, "<setup>", "exec"), {{"__name__": "__main__"}})
    sys.exit(0)
if args[:1] == ["-u"] and args[1].startswith("tools/"):  # a tool: its parts as FAKE_HANG and FAKE_SLOW say
    todo = args[args.index("--parts") + 1].split(",")
    say = lambda figure, **values: print(json.dumps(dict(figure=figure, **values)), flush=True)
    say("machine", tool=args[1], parts=todo, offline=os.environ.get("HF_HUB_OFFLINE"))
    for part in todo:
        if part == os.environ.get("FAKE_HANG"):  # as faulthandler.dump_traceback_later(exit=True) ends it
            print("Timeout (0:01:00)!\\nThread 0x1 (most recent call first):\\n  File \\"x.py\\", line 1 in " + part,
                  file=sys.stderr, flush=True)
            os._exit(1)
        if part == os.environ.get("FAKE_SLOW"):
            time.sleep(600)
        say(part, value=1)
        say("timing", part=part, seconds=0.0, ok=True)
    say("done", failed=[])
    sys.exit(0)
assert args[:2] == ["-m", "pytest"], args
with open(os.environ["FAKE_PYTEST_LOG"], "w") as f:
    f.write(" ".join(args))
kept, skip = [], False
for a in args[2:]:  # the script's options, with the stand-in tests in place of its selection
    if skip or a == "-m":
        skip = a == "-m"
        continue
    if not a.startswith("tests/"):
        kept.append(a)
os.execv(real, [real, "-m", "pytest", *kept, os.environ["FAKE_TESTS"]])
"""

TESTS = """
def test_passes():
    pass
"""

# `timeout` on the script's PATH: each call logged (the time, then its arguments, | after each), then made
TIMEOUT = """#!/bin/sh
printf '%s|' "$(date +%s.%N)" "$@" >> "$FAKE_TIMEOUT_LOG"
echo >> "$FAKE_TIMEOUT_LOG"
exec {timeout} "$@"
"""
NVIDIA_SMI = """#!/bin/sh
echo "0, NVIDIA H100 80GB HBM3, 570.86.15, 81559 MiB"
"""


def limits() -> dict:
    """The stages' limits as the script sets them ($BUDGET: the default budget)."""
    text = open(SCRIPT).read()
    return {k: int(setting("BUDGET") if v == "$BUDGET" else v)
            for k, v in re.findall(r"\[(\w+)\]=(\$BUDGET|\d+)", re.search(r"declare -A LIMIT=\((.*)\)", text)[1])}


def setting(name: str) -> str:
    return re.search(rf"^{name}=\$\{{{name}:-([^}}]*)\}}", open(SCRIPT).read(), re.M)[1]


@pytest.fixture
def lease(tmp_path):
    """Run the script with the stand-in Python: `gpus` GPUs faked (nvidia-smi too), `env` added. Returns (exit
    status, its stdout); `go.log` is $OUT/lease.log, `go.timeouts()` the calls to timeout (each a list of its
    arguments), `go.began` and `go.at()` the script's start and each call's, in seconds, `go.pytest` the stand-in
    pytest's arguments."""
    stub = tmp_path / "python"
    stub.write_text(STUB.format(python=sys.executable))
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "prelude.py").write_text(PRELUDE)
    (tmp_path / "test_stand_in.py").write_text(textwrap.dedent(TESTS))
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, text in (("timeout", TIMEOUT.format(timeout=shutil.which("timeout"))), ("nvidia-smi", NVIDIA_SMI)):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    calls, pytest_log = tmp_path / "timeouts.log", tmp_path / "pytest.log"

    def go(gpus=1, **env):
        calls.unlink(missing_ok=True)
        env = dict(os.environ, FAKE_GPUS=str(gpus), FAKE_PRELUDE=str(tmp_path / "prelude.py"),
                   FAKE_TESTS=str(tmp_path / "test_stand_in.py"), FAKE_TIMEOUT_LOG=str(calls),
                   FAKE_PYTEST_LOG=str(pytest_log), OUT=str(tmp_path / "out"), PYTHON=str(stub),
                   PATH=f"{bin_}{os.pathsep}{os.environ['PATH']}", **env)
        (tmp_path / "out" / "lease.log").unlink(missing_ok=True)
        go.began = time.time()
        p = subprocess.run(["bash", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        go.log = (tmp_path / "out" / "lease.log").read_text()
        go.pytest = pytest_log.read_text() if pytest_log.exists() else None
        return p.returncode, p.stdout + p.stderr
    logged = lambda: [line.split("|")[:-1] for line in calls.read_text().splitlines()] if calls.exists() else []
    go.timeouts = lambda: [c[1:] for c in logged()]
    go.at = lambda: [float(c[0]) for c in logged()]
    return go


def within_budget(lease, budget: int):
    """Each stage under `timeout -k 5` at a limit that ends it, kill included, by `budget` s from the script's start
    (bash counts whole seconds: 1 s of slack)."""
    for call, at in zip(lease.timeouts()[1:], lease.at()[1:]):
        assert call[0] == "-k" and call[1] == "5", call
        assert at - lease.began + int(call[1]) + int(call[2]) <= budget + 1, (call, at - lease.began)


def stage_of(call: list) -> str:
    """Which stage a logged call to timeout is: its command after `-k KILL LIMIT`."""
    command = call[3:]
    if command[0] == "nvidia-smi":
        return "nvidia-smi"
    if command[1:2] == ["-"]:
        return "setup"
    if command[1:3] == ["-m", "pytest"]:
        return "tests"
    return {"tools/gpu_checks.py": "checks", "tools/gpu_probe.py": "probe"}[command[2]]


@pytest.mark.engine
def test_on_this_machine_the_setup_runs_and_each_gpu_stage_refuses_in_one_line(tmp_path):
    """The script as it is, with this machine's Python (torch without CUDA): versions, `ulimit -l`, the torch APIs,
    the import check, then one line a stage; exit status 11; the log holds what was printed."""
    t0 = time.time()
    p = subprocess.run(["bash", SCRIPT], cwd=tmp_path, env=dict(os.environ, OUT=str(tmp_path / "out"),
                                                                PYTHON=sys.executable),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 11, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert (tmp_path / "out" / "lease.log").read_text() == p.stdout
    assert any(line.startswith("ulimit -l") for line in lines) and any('"figure": "torch APIs"' in x for x in lines)
    assert f"kernel: {os.uname().release}" in lines
    assert "vllm imported by tba, the tools and the tests: no" in lines
    import torch
    on = f"torch {torch.__version__}, CUDA None"
    assert f"on: {on}, no CUDA device" in lines
    assert lines[-4:-1] == [f"== {stage}: refused: {on} sees no CUDA device" for stage in ("checks", "tests", "probe")]
    assert lines[-1].startswith("== done in ") and lines[-1].endswith("of BUDGET=480, exit status 11")
    assert time.time() - t0 < 120


@pytest.mark.engine
def test_every_stage_runs_in_order_under_its_limit_within_the_budget(lease):
    code, out = lease(gpus=1)
    assert code == 0, out
    calls = lease.timeouts()
    assert [stage_of(c) for c in calls] == ["nvidia-smi", "setup", "checks", "tests", "probe"], calls
    own = limits()
    assert all(int(c[2]) <= own[stage_of(c)] for c in calls[1:]), calls
    within_budget(lease, int(setting("BUDGET")))
    # the parts in their orders: the checks' as tools/gpu_checks.py lists them, the probe's as PARTS says
    checks, probe = (c[c.index("--parts") + 1] for c in calls[2::2])
    import gpu_checks
    assert checks == ",".join(key for key, *_ in gpu_checks.checks()) and probe == setting("PARTS")
    assert "-m cuda" in lease.pytest and "-o faulthandler_timeout=60" in lease.pytest
    for stage in ("checks", "tests", "probe"):  # each says what produced its figures
        assert f"== {stage}: exit status 0 on torch " in out and ", CUDA 12.8, NVIDIA H100 80GB HBM3" in out
    assert lease.log == out and "1 passed" in out
    assert out.count('"offline": "1"') == 2  # HF_HUB_OFFLINE=1: no network to wait for on the lent machine


def test_one_command_of_a_lease_holds_every_stage():
    """BUDGET fits one command (600 s at most) under the 510 s limit the script names, leaving a lease's 15 minutes
    its start and transfers; the setup has 60 s (a cold import of a CUDA torch may take 20); the probe gets what the
    stages before it leave, at least the share the script states; the decoding parts are probe parts, and the
    probe's parts and the checks are all run (the torch APIs by the setup)."""
    own, budget, text = limits(), int(setting("BUDGET")), open(SCRIPT).read()
    assert set(own) == {"setup", "checks", "tests", "probe"} and own["setup"] == 60 and own["probe"] == budget
    call = int(re.search(r"run it under a (\d+) s limit", text)[1])
    assert budget + 5 <= call <= 600 and 15 * 60 - call >= 240, (budget, call)
    probe = budget - sum(own[stage] + 5 for stage in ("setup", "checks", "tests")) - 5
    assert probe >= int(re.search(r"the rest of BUDGET, at least (\d+) s", text)[1]) >= 120, probe
    import gpu_probe
    parts = [key for key, *_ in gpu_probe.parts()]
    assert {"decode-rho", "decode-qwen"} <= set(parts)
    assert sorted(setting("PARTS").split(",") + ["apis"]) == sorted(parts)


@pytest.mark.engine
def test_a_small_budget_starts_no_stage_it_cannot_hold(lease):
    code, out = lease(gpus=1, BUDGET="40", FAKE_SLOW="fingerprint")
    assert code == 124, out
    within_budget(lease, 40)
    assert [stage_of(c) for c in lease.timeouts()] == ["nvidia-smi", "setup", "checks"]
    assert time.time() - lease.began < 40 + 2
    # the checks stage got what was left, and was cut in its first part: what it printed before is kept
    assert '"figure": "machine", "tool": "tools/gpu_checks.py"' in lease.log
    assert "== gpu_checks.py: stopped at the stage's limit in fingerprint" in out
    assert re.search(r"== tests: not started, \d+ s left of BUDGET=40", out) and "== probe: not started" in out


@pytest.mark.engine
@pytest.mark.parametrize("setup,code,refused", [("crash", 1, False), ("no torch", 10, True)])
def test_only_a_machine_without_torch_or_cuda_refuses_the_stages(lease, setup, code, refused):
    """A setup that fails otherwise (here a traceback before it names the card) is said, and every stage runs: a
    lease is too short to lose for a setup that stopped at its limit or could not print a figure. Without torch
    (10; without CUDA, 11: test_on_this_machine_...) each stage refuses in one line."""
    code_, out = lease(gpus=1, FAKE_SETUP=setup)
    assert code_ == code, out
    for stage in ("checks", "tests", "probe"):
        if refused:
            assert f"== {stage}: refused: torch is not installed" in out.splitlines(), out
        else:
            assert f"== {stage}: exit status 0 on a torch and card the setup did not name" in out, out
    assert ("== setup: exit status 1: the stages run" in out) == (not refused)


@pytest.mark.engine
def test_a_hung_part_is_named_and_the_parts_after_it_run_again(lease):
    code, out = lease(gpus=1, STAGES="checks", FAKE_HANG="lagged")
    assert code == 1, out
    calls = [c[c.index("--parts") + 1] for c in lease.timeouts() if stage_of(c) == "checks"]
    assert calls == ["fingerprint,watchdog,lagged,slot,keep,arrival", "slot,keep,arrival"]
    assert "Timeout (0:01:00)!" in out and "== gpu_checks.py: lagged ended the process (exit status 1" in out
    assert out.count('"figure": "timing"') == 5 and "== checks: exit status 1 on torch" in out


@pytest.mark.engine
def test_a_rerun_of_the_decoding_parts_runs_those_alone(lease):
    code, out = lease(gpus=1, STAGES="probe", PARTS="decode-rho,decode-qwen")
    assert code == 0, out
    assert [stage_of(c) for c in lease.timeouts()][1:] == ["setup", "probe"]
    assert [c[-1] for c in lease.timeouts() if stage_of(c) == "probe"] == ["decode-rho,decode-qwen"]


@pytest.mark.engine
@pytest.mark.parametrize("env,said", [
    (dict(STAGES="checks,nope"), "tests/gpu_lease.sh: STAGES=checks,nope: the stages are checks, tests, probe"),
    (dict(BUDGET="4m"), "tests/gpu_lease.sh: BUDGET=4m: a whole number of seconds"),
    (dict(BUDGET="0"), "tests/gpu_lease.sh: BUDGET=0: below the 25 s a stage needs"),  # issue 67 item 15
], ids=["stage", "budget", "no budget"])
def test_a_bad_setting_is_refused_before_anything_runs(lease, env, said):
    code, out = lease(**env)
    assert code == 2 and out == said + "\n" and lease.timeouts() == []


@pytest.mark.engine
def test_another_torch_is_named_beside_every_stage(lease):
    code, out = lease(gpus=1, STAGES="tests", FAKE_TORCH="2.11.0+cu128")
    assert code == 0, out
    assert "note: torch 2.11.0+cu128: the GPU path is written against torch 2.13" in out
    assert "== tests: exit status 0 on torch 2.11.0+cu128, CUDA 12.8, NVIDIA H100 80GB HBM3" in out


@pytest.mark.engine
def test_the_selection_holds_every_cuda_test_and_each_skips_without_cuda():
    """Every test file that marks a test `cuda` is in the script's selection, and here (no CUDA) every selected
    test skips: the tests stage runs only what needs a GPU."""
    files = re.search(r'^TESTS="([^"]*)"', open(SCRIPT).read(), re.M)[1].split()
    marked = sorted(f"tests/{f}" for f in os.listdir(os.path.join(ROOT, "tests")) if f.endswith(".py") and
                    re.search(r"pytest\.mark\.cuda\b", open(os.path.join(ROOT, "tests", f)).read()))
    assert sorted(files) == marked
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "cuda", *files],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:]
    assert re.search(r"^14 skipped, \d+ deselected", p.stdout.splitlines()[-1]), p.stdout[-2000:]
