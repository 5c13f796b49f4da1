"""tests/gpu_check.sh on the CPU: the script runs with a stand-in for Python that fakes what torch says of
CUDA (the GPU count, the torch version, a missing package), runs a small file of tests in place of the
script's selection and stands in for tools/gpu_probe.py (passing, failing a part, or too slow), so that its
setup refusals, its exit statuses, its summary (every failed, errored and skipped test named; "checked" only
when all passed; the probe's failed parts) and its time shares (each stage under `timeout`, 540 s in all) are
checked here. Not selected by the script itself (it would run itself). tools/gpu_probe.py's own tests:
tests/test_gpu_probe.py."""

import os
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT

SCRIPT = os.path.join(ROOT, "tests", "gpu_check.sh")

# What a CUDA build on a GPU node says, before the script's own code runs (its setup check and its GPU count)
PRELUDE = """
import os, sys
for name in filter(None, os.environ.get("FAKE_MISSING", "").split(",")):
    sys.modules[name] = None  # import raises ImportError
if "torch" not in os.environ.get("FAKE_MISSING", ""):
    import torch
    n = int(os.environ["FAKE_GPUS"])
    torch.cuda.device_count = lambda: n
    torch.version.cuda = "12.8" if n else None
    torch.cuda.get_device_name = lambda i=0: "NVIDIA H200"
    torch.cuda.get_device_capability = lambda i=0: (9, 0)
    torch.__version__ = os.environ.get("FAKE_TORCH", torch.__version__)
"""

STUB = """#!{python}
import os, sys, time
real = {python!r}
if sys.argv[1:2] == ["-"]:  # the setup check
    code = sys.stdin.read()
    prelude = open(os.environ["FAKE_PRELUDE"]).read()
    sys.argv = ["-"]
    sys.path.insert(0, os.getcwd())
    exec(compile(prelude + code, "<gpu_check>", "exec"), {{"__name__": "__main__"}})
    sys.exit(0)
if sys.argv[1].endswith("gpu_probe.py"):  # the probe, as FAKE_PROBE says: ok, fail (a part) or slow
    print('{{"figure": "machine"}}', flush=True)
    if os.environ["FAKE_PROBE"] == "fail":
        print('{{"figure": "weight write into the shared copy", "part": "write", "error": "AttributeError: no"}}')
        sys.exit(1)
    if os.environ["FAKE_PROBE"] == "slow":
        time.sleep(60)
    print('{{"figure": "done", "failed": []}}')
    sys.exit(0)
assert sys.argv[1:3] == ["-m", "pytest"], sys.argv
args, skip = [], False
for a in sys.argv[3:]:  # the script's options, with the stand-in tests in place of its selection
    if skip or a == "-k":
        skip = a == "-k"
        continue
    if not a.startswith("tests/"):
        args.append(a)
os.execv(real, [real, "-m", "pytest", *args, os.environ["FAKE_TESTS"]])
"""

TESTS = {
    "mixed": """
        import pytest

        def test_passes():
            pass

        def test_fails():
            assert False, "on purpose"

        @pytest.fixture
        def broken():
            raise RuntimeError("in setup")

        def test_errors(broken):
            pass

        def test_needs_two_gpus():
            pytest.skip("needs 2 GPUs")
    """,
    "passing": """
        def test_passes():
            pass
    """,
    "a package missing": """
        import pytest

        def test_passes():
            pass

        def test_wants_a_package():
            pytest.importorskip("no_such_package_here")
    """,
}


# `timeout` and `nvidia-smi` on the script's PATH: each call to timeout is logged (its arguments, | between them),
# then made; nvidia-smi answers as on a GPU node, so that its share is counted too
TIMEOUT = """#!/bin/sh
printf '%s|' "$@" >> "$FAKE_TIMEOUT_LOG"
echo >> "$FAKE_TIMEOUT_LOG"
exec {timeout} "$@"
"""
NVIDIA_SMI = """#!/bin/sh
echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"
"""


@pytest.fixture
def run(tmp_path):
    """Run the script with the stand-in Python: fake `gpus` GPUs, the `tests` of TESTS in place of its
    selection, the probe skipped or faked (`probe`: ok, fail or slow), `env` added to the environment. Returns
    (exit status, summary.txt, pytest.log or None); `go.folder` is the output folder, `go.timeouts()` the calls to
    timeout so far, each a list of its arguments."""
    stub = tmp_path / "python"
    stub.write_text(STUB.format(python=sys.executable))
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "prelude.py").write_text(PRELUDE)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, text in (("timeout", TIMEOUT.format(timeout=shutil.which("timeout"))), ("nvidia-smi", NVIDIA_SMI)):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    calls = tmp_path / "timeouts.log"

    def go(gpus=2, tests="passing", probe=None, env=None, **fake):
        go.folder = folder = tmp_path / f"out-{gpus}-{tests.replace(' ', '-')}-{probe}-{'-'.join(fake.values())}"
        (tmp_path / "t").mkdir(exist_ok=True)
        file = tmp_path / "t" / f"test_{tests.replace(' ', '_')}.py"
        file.write_text(textwrap.dedent(TESTS[tests]))
        env = dict(os.environ, FAKE_GPUS=str(gpus), FAKE_TESTS=str(file), FAKE_PRELUDE=str(tmp_path / "prelude.py"),
                   GPU_CHECK_OUT=str(folder), GPU_CHECK_PROBE="1" if probe else "0", FAKE_PROBE=probe or "",
                   FAKE_TIMEOUT_LOG=str(calls), PATH=f"{bin_}{os.pathsep}{os.environ['PATH']}", **(env or {}),
                   **{f"FAKE_{k.upper()}": v for k, v in fake.items()})
        env.pop("OUT", None)
        p = subprocess.run(["bash", SCRIPT, str(stub)], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
        summary = (folder / "summary.txt").read_text()
        log = folder / "pytest.log"
        assert p.stdout.strip().endswith(summary.strip().splitlines()[-1]), p.stdout + p.stderr
        return p.returncode, summary, log.read_text() if log.exists() else None
    go.timeouts = lambda: [line.split("|")[:-1] for line in calls.read_text().splitlines()] if calls.exists() else []
    return go


@pytest.mark.engine
def test_the_summary_names_each_failed_test_and_does_not_say_checked(run):
    code, summary, log = run(gpus=2, tests="mixed")
    assert code == 1
    assert "vllm imported by tba and the tests: no" in summary  # the real import check ran, and passed
    lines = summary.splitlines()
    assert any(line.startswith("FAILED ") and "test_mixed.py::test_fails" in line for line in lines), summary
    assert any(line.startswith("ERROR ") and "test_mixed.py::test_errors" in line for line in lines), summary
    assert any(line.startswith("SKIPPED ") and "needs 2 GPUs" in line for line in lines), summary
    assert "== ran, NOT all passed: on 2 GPUs" in summary and "== checked" not in summary


@pytest.mark.engine
def test_a_passing_run_says_what_it_checked_on_the_gpus_found(run):
    code, summary, _ = run(gpus=1, tests="passing")
    assert code == 0
    assert "== pytest exit status 0" in summary and "1 passed" in summary
    assert "== checked on 1 GPU: " in summary and "NOT covered (they need 2 GPUs)" in summary


@pytest.mark.engine
def test_a_skip_for_a_missing_package_fails_the_check(run):
    code, summary, _ = run(gpus=2, tests="a package missing")
    assert code == 10
    assert "could not import 'no_such_package_here'" in summary
    assert "the check is incomplete (exit status 10)" in summary and "== checked" not in summary


@pytest.mark.engine
@pytest.mark.parametrize("fake,code,said", [
    (dict(missing="transformers"), 10, "missing packages: transformers"),
    (dict(gpus=0), 11, "torch sees no CUDA device"),
], ids=["no-transformers", "no-gpu"])
def test_the_setup_refuses_before_anything_runs(run, fake, code, said):
    got, summary, log = run(**{"gpus": 2, **fake})
    assert got == code, summary
    assert said in summary and f"setup check failed (exit status {code}): nothing was run" in summary
    assert log is None  # pytest never started


@pytest.mark.engine
def test_another_torch_runs_the_checks_with_a_warning(run):
    """A GPU machine often has another torch (2.11, no vLLM): the trainer's side is checked on it, said in the summary."""
    code, summary, log = run(gpus=1, tests="passing", torch="2.11.0")
    assert code == 0 and log is not None and "== checked on 1 GPU" in summary
    assert "warning: torch 2.11.0: the GPU path is written against torch 2.13" in summary


@pytest.mark.engine
def test_each_stage_runs_under_timeout_within_540_s_in_all(run):
    """One command on a lent GPU may run 600 s: nvidia-smi, the setup check, pytest and the probe each run under
    `timeout -k`, and their limits with the kill grace add up to at most 540 s."""
    code, summary, _ = run(gpus=1, tests="passing", probe="ok")
    assert code == 0, summary
    assert "GPU 0: NVIDIA H200" in summary
    assert "== probe exit status 0 (lines in probe.jsonl: 2; parts failed: none)" in summary
    calls = run.timeouts()
    stage = lambda c: ("nvidia-smi" if c[3] == "nvidia-smi" else "setup" if c[4:5] == ["-"] else
                       "pytest" if c[4:6] == ["-m", "pytest"] else "probe" if c[4].endswith("gpu_probe.py") else c)
    assert sorted(map(stage, calls)) == ["nvidia-smi", "probe", "pytest", "setup"], calls
    assert all(c[0] == "-k" and c[1].isdigit() and c[2].isdigit() for c in calls), calls
    assert sum(int(c[1]) + int(c[2]) for c in calls) <= 540, calls


@pytest.mark.engine
def test_a_failed_probe_part_is_named_and_fails_the_check(run):
    code, summary, _ = run(gpus=1, tests="passing", probe="fail")
    assert code == 14, summary
    assert "== checked on 1 GPU" in summary  # the tests' own verdict stands
    assert "== probe exit status 1 (lines in probe.jsonl: 2; parts failed: write)" in summary


@pytest.mark.engine
def test_a_probe_past_its_share_is_stopped_and_keeps_its_figures(run):
    code, summary, _ = run(gpus=1, tests="passing", probe="slow", env={"GPU_CHECK_PROBE_TIMEOUT": "2"})
    assert code == 14, summary
    assert "== probe exit status 124 (stopped after 2 s: the figures up to there) (lines in probe.jsonl: 1;" in summary
    assert (run.folder / "probe.jsonl").read_text() == '{"figure": "machine"}\n'
