"""Faults: signals, a dying searcher, checkpoints and resume, non-finite losses. No hangs, no
process left behind, no data lost."""

import contextlib
import errno
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import types

import psutil
import pytest
import torch

from runtime.config import Config
from runtime import checkpoint
from conftest import ROOT, env, metrics, run_tba, shared_run

SMALL = ["--prompts-per-step", "4", "--samples-per-prompt", "4", "--max-new-tokens", "6", "--lr", "1e-3",
         "--eval-every", "0"]


def sync_checkpoint(tmp_path_factory, tiny_model):
    """(its --out, its output) of a synchronous 2-step run saved at step 2, made once a session
    (conftest.shared_run) for the tests that copy or resume its checkpoint."""
    return shared_run(tmp_path_factory, "sync-checkpoint", ["--model", tiny_model, "--searchers", "0", "--steps", "2",
                                                            "--save-every", "2", *SMALL])


def start(args, tmp, torchrun=False, preexec_fn=None):
    cmd = [sys.executable, os.path.join(ROOT, "tba.py"), *args]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", *cmd[1:]]
    return subprocess.Popen(cmd, cwd=tmp, env=env(tmp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, preexec_fn=preexec_fn)


def wait_for_steps(proc, out, n, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-3000:] if proc.stdout else "the run stopped"
        if os.path.exists(out / "metrics.jsonl") and sum(r["kind"] == "train" for r in metrics(out)) >= n:
            return
        time.sleep(0.2)
    raise AssertionError("the run made no progress")


def searcher_pids(pid):
    """The searchers below process `pid`: spawned, or (on the CPU) forked by the fork server."""
    procs = psutil.Process(pid).children(recursive=True)
    cmd = lambda p: " ".join(p.cmdline())
    servers = {p.pid for p in procs if "forkserver import main" in cmd(p)}
    return [p.pid for p in procs if p.ppid() in servers or ("spawn_main" in cmd(p) and "resource_tracker" not in cmd(p))]


def assert_all_gone(pids, within=30):
    deadline = time.time() + within
    alive = pids
    while alive and time.time() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.2)
    assert not alive, f"left behind: {alive}"


def assert_checkpoint(out):
    ckpt = out / "checkpoint"
    assert ckpt.is_symlink() and (ckpt / "trainer.pt").is_file() and (ckpt / "buffer.npz").is_file()
    assert (ckpt / "model" / "config.json").is_file()
    state = torch.load(ckpt / "trainer.pt", weights_only=True)  # tensors and plain data only
    assert state["step"] >= 3
    return state


@pytest.mark.engine
@pytest.mark.parametrize("how", ["SIGINT to the process group", "SIGTERM to torchrun",
                                 "SIGINT to torchrun's process group"])
def test_signal_stops_everything_with_a_checkpoint(how, tiny_model, tmp_path):
    """Ctrl-C in a terminal is SIGINT to the whole group; under torchrun the trainer then gets it
    twice (torchrun forwards it), which must still count as one: a checkpoint is written."""
    out = tmp_path / "run"
    torchrun = "torchrun" in how
    proc = start(["--model", tiny_model, "--steps", "100000", *SMALL, "--out", str(out)], tmp_path, torchrun)
    try:
        wait_for_steps(proc, out, 3)
        everything = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert searcher_pids(proc.pid), "no searcher running"
        t0 = time.time()
        if how == "SIGTERM to torchrun":
            os.kill(proc.pid, signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        output = proc.communicate(timeout=60)[0]  # a hang: until a timeout of minutes; a loaded machine: seconds
        assert time.time() - t0 < 60
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert "stopped by SIG" in output, output[-3000:]
    assert_all_gone(everything)
    state = assert_checkpoint(out)
    assert state["step"] == max(r["step"] for r in metrics(out) if r["kind"] == "train")


def catches(pid, sig) -> bool:
    """Whether process `pid` has a handler for `sig` (its SigCgt mask in /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(mask >> (sig - 1) & 1)


@pytest.mark.engine
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP, signal.SIGUSR1])
def test_signal_during_start_up_stops_quietly(sig, tiny_model, tmp_path):
    """While tba.py imports and checks (seconds): one line, status 128 + the signal, nothing left. The signal
    goes as soon as tba.py's start-up handlers are in (Python catches SIGINT from its own start,
    the others only once tba.py asks), not after a fixed sleep that a loaded machine may outlast. SIGHUP (a closed
    terminal or ssh session) and SIGUSR1 (issue 67 item 4) killed it at once, without a line."""
    out = tmp_path / "run"
    proc = start(["--model", tiny_model, *SMALL, "--out", str(out)], tmp_path)
    deadline = time.time() + 60
    while not catches(proc.pid, signal.SIGTERM if sig == signal.SIGINT else sig):
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.01)
    os.killpg(proc.pid, sig)
    output = proc.communicate(timeout=30)[0]
    assert proc.returncode == 128 + sig, output[-3000:]
    assert output.strip().splitlines() == [f"tba.py: stopped by {sig.name} during start-up"], output[-3000:]
    assert not out.exists()


@pytest.mark.engine
def test_signal_before_the_first_step_stops_quietly(tiny_model, tmp_path):
    """Searchers running, the trainer waiting for its initial buffer: one line, status 143, no
    checkpoint (nothing was learned), no process left."""
    out = tmp_path / "run"
    proc = start(["--model", tiny_model, *SMALL, "--initial-buffer", "700000", "--out", str(out)], tmp_path)
    try:
        deadline = time.time() + 180
        while not (os.path.exists(out / "metrics.jsonl") and metrics(out)):  # the first evaluation: searching
            assert time.time() < deadline and proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.2)
        everything = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert searcher_pids(proc.pid)
        os.killpg(proc.pid, signal.SIGTERM)
        output = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, output[-3000:]
    assert output.strip().splitlines()[-1] == "tba.py: stopped by SIGTERM; before the first step: nothing to save"
    assert "Traceback" not in output
    assert not (out / "checkpoint").exists() and not any(r["kind"] == "train" for r in metrics(out))
    assert_all_gone(everything)


SWALLOWED = """
import os, runpy, signal, sys
sys.path.insert(0, {root!r})
from runtime import processes
made = processes.Signals.__init__
class Finalized:  # the signal comes while the GC runs a finalizer, which swallows what its handler raises
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        [None for _ in range(100)]
def signals(self, *args):
    made(self, *args)
    Finalized()
processes.Signals.__init__ = signals
sys.argv = [{tba!r}, *sys.argv[1:]]
runpy.run_path({tba!r}, run_name="__main__")
"""


@pytest.mark.engine
def test_a_signal_whose_stop_a_finalizer_swallowed_still_stops_the_run(tiny_model, tmp_path):
    """SIGTERM before the first step, its handler run inside a __del__ (which prints "Exception ignored" and goes
    on): the run stops at its next collect as if the Stop had reached, instead of training on to --steps."""
    out = tmp_path / "run"
    code = SWALLOWED.format(root=ROOT, tba=os.path.join(ROOT, "tba.py"))
    proc = subprocess.run([sys.executable, "-c", code, "--model", tiny_model, *SMALL, "--steps", "40", "--out",
                           str(out)], cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert "Exception ignored" in output and "Stop: ('SIGTERM', False)" in output, output[-3000:]
    assert proc.returncode == 143, output[-3000:]
    assert output.strip().splitlines()[-1] == "tba.py: stopped by SIGTERM; before the first step: nothing to save"
    assert not any(r["kind"] == "train" for r in metrics(out))


def signal_mask(pid, field: str) -> int:
    """Process `pid`'s signal mask `field` (SigIgn, SigCgt) from /proc; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1], 16) for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return 0


def importing_fork_server(pid):
    """The pid of the fork server below process `pid` while it imports its preload modules (vLLM among them), or
    None: it ignores SIGTERM (runtime/vllm_env.py, its first module, is in) and has no SIGCHLD handler yet (Python
    3.11's multiprocessing/forkserver.py sets one once the imports are done)."""
    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    for p in procs:
        try:
            if "forkserver import main" not in " ".join(p.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue
        bit = lambda sig: 1 << (sig - 1)
        if signal_mask(p.pid, "SigIgn") & bit(signal.SIGTERM) and not signal_mask(p.pid, "SigCgt") & bit(signal.SIGCHLD):
            return p.pid
    return None


def test_the_resource_tracker_ignores_a_closed_terminals_signals():
    """Issue 67 item 4: SIGHUP to the run's process group (a closed terminal) killed multiprocessing's resource
    tracker, and the one started in its place printed a KeyError traceback for each name it did not know."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from runtime import vllm_env; "
            "from multiprocessing import resource_tracker as r; vllm_env.quiet_resource_tracker(); "
            "print(open(f'/proc/{r._resource_tracker._pid}/status').read())")
    status = subprocess.run([sys.executable, "-c", code, ROOT], capture_output=True, text=True, timeout=60).stdout
    ignored = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)
    assert all(ignored >> (sig - 1) & 1 for sig in (signal.SIGHUP, signal.SIGUSR1))  # (it ignores INT, TERM itself)


@pytest.mark.engine
def test_ctrl_c_while_the_fork_server_imports_vllm_stops_quietly(tiny_model, tmp_path):
    """Ctrl-C (SIGINT to the process group) while the CPU's fork server imports vLLM for the searchers: the run's
    one line, no KeyboardInterrupt traceback of the fork server's imports, nothing left."""
    out = tmp_path / "run"
    proc = start(["--model", tiny_model, *SMALL, "--out", str(out)], tmp_path)
    try:
        deadline = time.time() + 180
        while (server := importing_fork_server(proc.pid)) is None:
            assert time.time() < deadline and proc.poll() is None, proc.stdout.read()[-3000:] if proc.stdout else ""
            time.sleep(0.01)
        everything = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        os.killpg(proc.pid, signal.SIGINT)
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    assert output.strip().splitlines()[-1] in ("tba.py: stopped by SIGINT during start-up",  # the checks (tba.py, main)
                                               "tba.py: stopped by SIGINT; before the first step: nothing to save")
    assert server in everything
    assert_all_gone(everything)  # the fork server too, once its imports are done and it sees the trainer gone


@pytest.mark.engine
def test_dead_searcher_stops_the_run(tiny_model, tmp_path):
    out = tmp_path / "run"
    proc = start(["--model", tiny_model, "--steps", "100000", *SMALL, "--out", str(out)], tmp_path)
    try:
        wait_for_steps(proc, out, 2)
        everything = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        (pid,) = searcher_pids(proc.pid)
        t0 = time.time()
        os.kill(pid, signal.SIGKILL)
        output = proc.communicate(timeout=60)[0]
        assert time.time() - t0 < 60
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1
    lines = [line for line in output.splitlines() if line.strip()]
    line = f"tba.py: error: searcher 0 (pid {pid}) died with exit code -9; checkpoint in {out / 'checkpoint'}"
    assert line in lines, output[-3000:]  # the trainer lives: its progress is kept, as for a silent searcher
    assert not any("resource_tracker" in x or "leaked" in x for x in lines[lines.index(line):]), output[-3000:]
    assert_checkpoint(out)
    assert_all_gone(everything)


@pytest.mark.engine
@pytest.mark.parametrize("extra", [[], ["--ref-reset-every", "2"]], ids=["tb", "tba-prime"])
def test_resume_gives_the_same_weights(extra, tiny_model, tmp_path):
    """Synchronous mode, fixed seed: 6 steps straight == 3 steps, then resume to 6; with TBA′ the
    resumed run keeps pi_ref of the step-2 reset and the reset schedule (steps 4 and 6)."""
    from transformers import AutoModelForCausalLM
    common = ["--model", tiny_model, "--searchers", "0", "--seed", "3", "--sync-every", "2", *SMALL, *extra]
    a = run_tba([*common, "--steps", "6", "--out", str(tmp_path / "a")], tmp_path)
    assert a.returncode == 0, a.stdout[-3000:]
    b1 = run_tba([*common, "--steps", "3", "--save-every", "3", "--out", str(tmp_path / "b")], tmp_path)
    assert b1.returncode == 0, b1.stdout[-3000:]
    state = assert_checkpoint(tmp_path / "b")
    assert state["step"] == 3 and state["synced_version"] == 2 and state["synced"] is not None
    b2 = run_tba([*common, "--steps", "6", "--resume", str(tmp_path / "b" / "checkpoint"),
                  "--out", str(tmp_path / "b2")], tmp_path)
    assert b2.returncode == 0, b2.stdout[-3000:]
    rows_a = [r for r in metrics(tmp_path / "a") if r["kind"] == "train"]
    rows_b = [r for r in metrics(tmp_path / "b2") if r["kind"] == "train"]
    assert [r["step"] for r in rows_b] == [4, 5, 6]
    assert {r.get("resumed") for r in metrics(tmp_path / "b2")} == {3}  # its rows say which branch they are
    assert not any("resumed" in r for r in metrics(tmp_path / "a"))
    assert [r["samples"] for r in rows_a[3:]] == [r["samples"] for r in rows_b]  # counters carried over
    assert [r["reference"] for r in rows_a[3:]] == [r["reference"] for r in rows_b] == ([4, 4, 6] if extra else [0] * 3)
    start = next(r for r in metrics(tmp_path / "a") if r["kind"] == "eval")["accuracy"]
    resumed = next(r for r in metrics(tmp_path / "b2") if r["kind"] == "eval")
    summary = b2.stdout.strip().splitlines()[-1]
    assert f"held-out accuracy {start:.3f} (step 0) -> " in summary, summary  # the whole run's start
    assert f"resumed at step 3 ({resumed['accuracy']:.3f})" in summary, summary
    for ra, rb in zip(rows_a[3:], rows_b):  # same learning rate, beta, batches and losses
        assert ra["lr"] == rb["lr"] and ra["beta"] == rb["beta"] and ra["reward"] == rb["reward"]
        assert abs(ra["loss"] - rb["loss"]) <= 1e-4 * max(1.0, abs(ra["loss"]))
    wa = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "final").state_dict()
    wb = AutoModelForCausalLM.from_pretrained(tmp_path / "b2" / "final").state_dict()
    start = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-4
    assert max((wa[k] - start[k]).abs().max().item() for k in wa) > 1e-3  # and they did train


def capped_checkpoint(tmp_path_factory, tiny_model):
    """(its --out, its output) of a streaming run under --max-reuse 1 saved at step 3, made once a session
    (shared_run: test_probes resumes it too)."""
    return shared_run(tmp_path_factory, "capped-checkpoint", ["--model", tiny_model, *SMALL, "--max-reuse", "1",
                                                              "--steps", "3", "--save-every", "3"])


@pytest.mark.engine
def test_async_resume_carries_the_reuse_counts(tiny_model, tmp_path, tmp_path_factory):
    """--max-reuse's counts are in the checkpoint: after --resume the draws and the trajectories received go
    on from the checkpoint's, so that the cap holds over the whole run."""
    common = ["--model", tiny_model, *SMALL, "--max-reuse", "1"]
    a, _ = capped_checkpoint(tmp_path_factory, tiny_model)
    credit, counted, drawn = assert_checkpoint(a)["reuse"]
    assert drawn == 3 * 16 and drawn <= counted and 0 <= credit <= counted - drawn
    b = run_tba([*common, "--steps", "5", "--resume", str(a / "checkpoint"), "--out", str(tmp_path / "b")], tmp_path)
    assert b.returncode == 0, b.stdout[-3000:]
    rows = [r for r in metrics(tmp_path / "b") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [4, 5] and rows[0]["samples"] >= counted
    for r in rows:  # every step of the whole run drew B x K = 16
        assert r["reuse"] == pytest.approx(r["step"] * 16 / r["samples"]) and r["reuse"] <= 1 + 1e-9


class RunsCode:
    """Unpickling this runs a shell command: what a malicious checkpoint could carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.engine
def test_checkpoint_that_could_run_code_is_refused(tiny_model, tmp_path, tmp_path_factory, refusal):
    """Checkpoints are tensors and plain data: one that holds a pickled object is refused in one
    line, before anything runs, and the object's code never runs."""
    import shutil
    a, _ = sync_checkpoint(tmp_path_factory, tiny_model)
    marker = tmp_path / "code-ran"
    evil = tmp_path / "evil"
    shutil.copytree(a / "checkpoint", evil)
    state = torch.load(evil / "trainer.pt", weights_only=True)
    torch.save(dict(state, first_eval=RunsCode(marker)), evil / "trainer.pt")
    status, lines = refusal(["--model", tiny_model, "--resume", str(evil), "--out", str(tmp_path / "b")])
    assert status == 2 and not marker.exists(), lines
    assert lines[-1].startswith(f"tba.py: error: --resume: {evil} does not parse")
    shutil.copy(a / "checkpoint" / "trainer.pt", evil / "trainer.pt")
    (evil / "buffer.npz").write_bytes(b"not an archive")
    status, lines = refusal(["--model", tiny_model, "--resume", str(evil), "--out", str(tmp_path / "b")])
    assert status == 2 and "does not parse as a checkpoint" in lines[-1], lines


def test_checkpoint_swap_is_atomic(tmp_path):
    def write(value):
        def w(folder):
            open(os.path.join(folder, "trainer.pt"), "w").write(value)
            if value == "crash":
                raise KeyboardInterrupt("killed while saving")
        return w

    checkpoint.atomic_checkpoint(str(tmp_path), 3, write("three"))
    assert (tmp_path / "checkpoint" / "trainer.pt").read_text() == "three"
    with pytest.raises(KeyboardInterrupt):
        checkpoint.atomic_checkpoint(str(tmp_path), 6, write("crash"))
    assert (tmp_path / "checkpoint" / "trainer.pt").read_text() == "three"  # the previous one, intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "checkpoint-000003"]  # its tmp gone already
    checkpoint.atomic_checkpoint(str(tmp_path), 9, write("nine"))
    assert (tmp_path / "checkpoint" / "trainer.pt").read_text() == "nine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "checkpoint-000009"]  # no leftovers


@contextlib.contextmanager
def file_size_limit(limit: int):
    """Every file this process writes cut at `limit` bytes, as on a full disk: a write beyond it fails with EFBIG
    ("File too large"; Python ignores SIGXFSZ, which would kill it), needing no root and no small file system."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_row_that_cannot_be_written_stops_the_run_and_leaves_no_half_line(tmp_path, capsys):  # (in memory)
    """Issue 67 item 5: a full disk while a row was written ended in three chained OSError tracebacks, no checkpoint
    tried, metrics.jsonl's last line half-written. Now the row is cut off whole, the rows after it are not tried, and
    the fleets' stop reason says it: the run stops after a checkpoint, in one line."""
    from runtime.config import Config
    from runtime.fleet import Fleet
    from runtime.local import LocalFleet
    from runtime.log import Log
    out = tmp_path / "run"
    log = Log(Config(out=str(out), steps=5), 0, time.time())
    try:
        log.row(kind="eval", step=0, accuracy=0.5, example={})
        with file_size_limit((out / "metrics.jsonl").stat().st_size + 40):
            log.row(kind="eval", step=1, accuracy=0.25, example={"completion": "x" * 100})
            log.row(kind="eval", step=2, accuracy=0.25, example={})
    finally:
        log.close()
    line = f"{out}/metrics.jsonl could not be written (File too large)"
    assert log.unwritten == line and [r["step"] for r in metrics(out)] == [0]
    fleet = types.SimpleNamespace(signals=types.SimpleNamespace(first=None), dead=None, silent=None, log=log)
    assert Fleet.stop_reason(fleet) == LocalFleet.stop_reason(fleet) == ("dead", line)


def test_a_failed_write_is_told_from_a_bug(tmp_path):
    """write_error: each writer of a checkpoint and of final/ that fails on a full disk (here a file size limit) is
    a failed write, with the OS's reason: safetensors (transformers' save_pretrained) says it in its message only,
    torch.save's RuntimeError keeps the OSError of a file of ours; any other error is a bug (its traceback)."""
    import json
    import numpy as np
    from safetensors.torch import save_file
    big = torch.zeros(100_000)

    def torch_save(path):
        with open(path, "wb") as f:
            torch.save({"w": big}, f)
    writes = {"safetensors": lambda p: save_file({"w": big}, p), "torch.save": torch_save,
              "numpy": lambda p: np.savez(p, w=big.numpy()), "json": lambda p: json.dump(big.tolist(), open(p, "w"))}
    for name, write in writes.items():
        with file_size_limit(100_000), pytest.raises(Exception) as e:
            write(str(tmp_path / name))
        assert checkpoint.write_error(e.value) == os.strerror(errno.EFBIG), (name, repr(e.value))
    assert checkpoint.write_error(ValueError("a bug")) is None
    assert checkpoint.write_error(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")) is None


def final_writer(tmp_path, monkeypatch, fails: int, signals=None, error=OSError(errno.ENOSPC, "No space left on device")):
    """save_final with save_hf failing its first `fails` tries (half a file written first) and tries every 0.05 s;
    returns (a call of it with `timeout`, the lines it said)."""
    tries, said = [], []

    def save_hf(model, sd, tokenizer, path):
        tries.append(path)
        open(os.path.join(path, "model.safetensors"), "w").write("half")
        if len(tries) <= fails:
            raise error
        open(os.path.join(path, "config.json"), "w").write("{}")
    monkeypatch.setattr(checkpoint, "save_hf", save_hf)
    monkeypatch.setattr(checkpoint, "RETRY", 0.05)
    log = types.SimpleNamespace(print=lambda line, file=None: said.append(line))
    signals = signals or types.SimpleNamespace(first=None)
    return lambda timeout: checkpoint.save_final(None, {}, None, str(tmp_path), 7, timeout, signals, log), said


def test_final_is_kept_in_memory_and_written_again_on_a_full_disk(tmp_path, monkeypatch):
    """OUT/final is written whole or not at all: a write that fails keeps the weights in memory, says so once and is
    tried again until it succeeds (replacing an older final/ only then) or --timeout passes (then one line naming
    what is lost and the last checkpoint); a signal stops the tries at once; a bug is raised. No temporary folder is
    ever left."""
    (tmp_path / "final").mkdir()  # a resumed run's older one: replaced only by a whole new one
    (tmp_path / "final" / "old").write_text("")
    save, said = final_writer(tmp_path, monkeypatch, fails=3)
    assert save(60) is None
    assert sorted(os.listdir(tmp_path)) == ["final"] and sorted(os.listdir(tmp_path / "final")) == [
        "config.json", "model.safetensors"]
    assert said == [f"tba.py: warning: {tmp_path / 'final'} could not be written (No space left on device): free space "
                    f"there; the weights of step 7 are kept in memory and written again every 0.05 s, for 60 s "
                    f"(--timeout)", f"tba.py: {tmp_path / 'final'} written at a later try"]
    (tmp_path / "final" / "config.json").unlink()

    save, said = final_writer(tmp_path / "final", monkeypatch, fails=10**9)
    t0 = time.time()
    line = save(0.5)
    assert 0.5 <= time.time() - t0 < 5 and len(said) == 1
    assert line == (f"{tmp_path / 'final' / 'final'} could not be written (No space left on device) in 0.5 s of tries "
                    f"(--timeout): the weights of step 7 are lost; the last checkpoint is none (--save-every)")
    assert os.listdir(tmp_path / "final") == ["model.safetensors"]  # no final/, no final.tmp

    signals = types.SimpleNamespace(first=None)
    save, said = final_writer(tmp_path / "final", monkeypatch, fails=10**9, signals=signals)
    threading.Timer(0.3, lambda: setattr(signals, "first", ("SIGTERM", time.time()))).start()  # as Signals does
    t0 = time.time()
    line = save(60)
    assert time.time() - t0 < 5 and line.endswith(", and SIGTERM stopped the tries: the weights of step 7 are lost; "
                                                  "the last checkpoint is none (--save-every)"), line
    assert os.listdir(tmp_path / "final") == ["model.safetensors"]

    save, said = final_writer(tmp_path / "final", monkeypatch, fails=1, error=ValueError("a bug"))
    with pytest.raises(ValueError):
        save(60)
    assert os.listdir(tmp_path / "final") == ["model.safetensors"] and said == []


FULL_DISK = 1_000_000  # bytes: the tiny model's weights (2.6 MB) and checkpoints do not fit; every other file of a run
# does (its log and config, the searcher's and the fork server's files: tried with one searcher)


def full_disk():
    """A run's preexec_fn: every file it writes cut at FULL_DISK bytes (file_size_limit)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FULL_DISK, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


@pytest.mark.engine
def test_a_full_disk_loses_no_weights(tiny_model, tmp_path):
    """A run on a full disk (every file cut at 1 MB), with a searcher: each checkpoint (--save-every 1) fails, with one
    warning for both and no temporary folder, and training goes on; final/ fails, the weights stay in memory and the
    write is tried again until space comes back (the limit raised, as a user frees space): final/ whole, status 0, no
    traceback. Before: a SafetensorError traceback, a half-written final/ and no checkpoint (two chained tracebacks
    and a checkpoint-*.tmp with --save-every)."""
    out, log = tmp_path / "run", tmp_path / "log.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tba.py"), "--model", tiny_model, *SMALL, "--steps",
                                 "2", "--save-every", "1", "--timeout", "300", "--out", str(out)], cwd=tmp_path,
                                env=env(tmp_path), stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=full_disk)
    try:
        deadline = time.time() + 300
        while "could not be written (File too large): free space there" not in log.read_text():
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        assert not (out / "final").exists()
        hard = resource.prlimit(proc.pid, resource.RLIMIT_FSIZE)[1]
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (hard, hard))  # space freed (the run's own process only)
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = log.read_text()
    assert "Traceback" not in output, output[-3000:]
    warned = [line for line in output.splitlines() if "checkpoint of step" in line]
    assert warned == [f"tba.py: warning: the checkpoint of step 1 could not be written in {out} (File too large): the "
                      f"last is none (--save-every); training goes on (a later checkpoint that fails is not said "
                      f"again)"], output[-3000:]
    assert f"tba.py: {out / 'final'} written at a later try" in output and "done: 2 steps" in output
    assert sorted(os.listdir(out)) == ["config.json", "final", "metrics.jsonl"]  # no checkpoint, no temporary folder
    from runtime.hub import check_weights
    check_weights(str(out / "final"))


@pytest.mark.engine
def test_a_checkpoint_that_cannot_be_written_on_a_stop_says_so(tiny_model, tmp_path):
    """SIGTERM on a full disk: the stop's checkpoint fails, and the run's one line says so and names the last one
    (status 143, no traceback, no temporary folder, nothing left). Before: "checkpoint in OUT/checkpoint" after two
    chained tracebacks, with no checkpoint there."""
    out = tmp_path / "run"
    proc = start(["--model", tiny_model, "--steps", "100000", *SMALL, "--out", str(out)], tmp_path,
                 preexec_fn=full_disk)
    try:
        wait_for_steps(proc, out, 2)
        everything = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        os.kill(proc.pid, signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143 and "Traceback" not in output, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith("tba.py: stopped by SIGTERM; the checkpoint of step ") and last.endswith(
        f" could not be written in {out} (File too large): the last is none (--save-every)"), output[-3000:]
    assert sorted(os.listdir(out)) == ["config.json", "metrics.jsonl"]
    assert_all_gone(everything)


def save_twice(path, out, port, results):
    """One trainer rank (synchronous: no searcher process) checkpoints step 2 twice, as when a signal comes right
    after a --save-every save or finish() runs after the last one. Reports whether the first checkpoint (marked)
    is still the linked one, untouched."""
    import traceback
    import types
    import tba
    import torch.distributed as dist
    from runtime import checks
    try:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cfg, data, _ = checks.check(checks.parse(Config, ["--model", path, *SMALL, "--searchers", "0",
                                                              "--out", out]), 1)
        t = tba.Trainer(cfg, data, None, types.SimpleNamespace(first=None, training=True, launcher=None), time.time())
        try:
            t.step = 2
            checkpoint.save_checkpoint(t)
            first = os.path.realpath(os.path.join(out, "checkpoint"))
            open(os.path.join(first, "marker"), "w").close()
            checkpoint.save_checkpoint(t)
            results.put({"linked": os.path.realpath(os.path.join(out, "checkpoint")) == first,
                         "untouched": os.path.exists(os.path.join(first, "marker")),
                         "folders": sorted(os.listdir(out))})
        finally:
            t.close()
    except BaseException:
        results.put({"error": traceback.format_exc()})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.engine
def test_a_step_is_not_saved_twice(tiny_model, tmp_path):
    """A second save of the linked step would delete that checkpoint before renaming its copy in (a kill
    between the two leaves the link on nothing): it is skipped."""
    from conftest import report_of
    got = report_of(save_twice, tiny_model, str(tmp_path / "run"))
    assert got["linked"] and got["untouched"], got
    assert got["folders"] == ["checkpoint", "checkpoint-000002", "config.json", "metrics.jsonl"]


@pytest.mark.engine
def test_an_unexpected_error_exits_1_with_its_traceback_once(tiny_model, tmp_path):
    """An exception tba.py does not expect (here a simulated CUDA out-of-memory error in the loss): its
    traceback once, status 1, and no interpreter teardown (which can abort a finished 2-rank run; a
    canary's __del__ would print at teardown)."""
    script = (f"import builtins, runpy, sys, torch; sys.path.insert(0, {ROOT!r}); import loss\n"
              "tb = loss.LOSSES['tb']\n"  # the start-up probe's batch (runtime.checks.probe_pools: float64) passes
              "def boom(**kw):\n"
              "    if kw['logp'].dtype == torch.float64: return tb(**kw)\n"
              "    raise RuntimeError('CUDA out of memory (simulated)')\n"
              "loss.LOSSES['tb'] = boom\n"
              "class Canary:\n    def __del__(self): print('interpreter teardown', flush=True)\n"
              "builtins.canary = Canary()\n"
              f"sys.argv = ['tba.py', '--model', {tiny_model!r}, '--searchers', '0', '--steps', '2', *{SMALL!r},"
              f" '--out', {str(tmp_path / 'run')!r}]\n"
              f"runpy.run_path({os.path.join(ROOT, 'tba.py')!r}, run_name='__main__')\n")
    p = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env(tmp_path), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=300)
    assert p.returncode == 1, p.stdout[-3000:]
    assert p.stdout.count("Traceback (most recent call last)") == 1, p.stdout[-3000:]
    assert p.stdout.strip().splitlines()[-1] == "RuntimeError: CUDA out of memory (simulated)", p.stdout[-3000:]
    assert "interpreter teardown" not in p.stdout


@pytest.mark.engine
def test_non_finite_loss_stops_with_the_step(tiny_model, tmp_path):
    out = tmp_path / "run"
    p = run_tba(["--model", tiny_model, "--searchers", "0", "--steps", "20", "--save-every", "1", *SMALL[:6],
                 "--lr", "1e30", "--eval-every", "0", "--out", str(out)], tmp_path)
    assert p.returncode == 1
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("tba.py: error: non-finite loss at step "), p.stdout[-2000:]
    step = int(last.split("at step ")[1].split(";")[0])
    assert torch.load(out / "checkpoint" / "trainer.pt", weights_only=True)["step"] == step - 1


WRONG_WEIGHTS = """
import runpy, sys
sys.path.insert(0, {root!r})
sys.argv = [{tba!r}, *sys.argv[1:]]
import torch
from runtime import weights
plain_write, plain_sync = weights.write, weights.synchronize


def write(shared, named, version, *args, **kwargs):  # the weights of step 3: one tensor altered after its fingerprint
    if shared is not None and version == 3 and "policy" in kwargs.get("to", ("policy",)):
        def sync(tensors, *devices):  # under the lock, before the version moves
            with torch.no_grad():
                shared.tensors["model.layers.0.mlp.down_proj.weight"][0, 0] += 1e-3
            weights.synchronize = plain_sync
            return plain_sync(tensors, *devices)
        weights.synchronize = sync
    return plain_write(shared, named, version, *args, **kwargs)


weights.write = write
runpy.run_path({tba!r}, run_name="__main__")
"""


@pytest.mark.engine
@pytest.mark.parametrize("ranks", [1, 2])
def test_weights_that_do_not_arrive_intact_stop_the_run_in_one_line(tiny_model, tmp_path, ranks):
    """One tensor of the weights of step 3 altered in the shared copy after the trainer fingerprinted it: the searcher
    that loads them finds it (read back from its engine) and the run stops after a checkpoint, in one line naming the
    version, the searcher and the tensor; the rows before say which versions were verified. Two trainer ranks under
    torchrun too (before, their line was 'searcher 0 died with exit code 5': the trainer saw the exit first)."""
    wrapper = tmp_path / "wrong_weights.py"
    wrapper.write_text(WRONG_WEIGHTS.format(root=ROOT, tba=os.path.join(ROOT, "tba.py")))
    out = tmp_path / "run"
    launch = [sys.executable] + (["-m", "torch.distributed.run", "--nproc_per_node=2"] if ranks == 2 else [])
    p = subprocess.run([*launch, str(wrapper), "--model", tiny_model, "--steps", "50", *SMALL, "--out", str(out)],
                       cwd=tmp_path, env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=400)
    assert p.returncode == 1, p.stdout[-3000:]
    last = [line for line in p.stdout.splitlines() if line.startswith("tba.py: ")][-1]  # torchrun's report follows
    assert last.startswith("tba.py: error: searcher 0: the weights of step 3 did not arrive intact: "
                           "model.layers.0.mlp.down_proj.weight holds sum"), last
    assert last.endswith(f"checkpoint in {out / 'checkpoint'}")
    verified = [r["verified"] for r in metrics(out) if r["kind"] == "train"]
    assert verified[0] == -1 and 1 in verified and max(verified) <= 2, verified  # (the initial weights came from disk)


def test_a_searchers_own_line_wins_over_its_exit_code():
    """A searcher that says its fault (searcher.SAID) puts its line in the pipe before it exits, but the trainer may
    see the exit first (waiting for the weights' lock, or between two messages): alive() waits for the line and
    raises it (before, under torchrun: 'searcher 0 died with exit code 5'). A searcher that said nothing: its exit
    code, at once."""
    import queue
    import threading
    import types
    import searcher
    from runtime.errors import Dead
    from runtime.fleet import Fleet
    from runtime.processes import Messages
    line = "searcher 0: the weights of step 3 did not arrive intact: model.embed_tokens.weight holds sum 1"
    fleet = Fleet.__new__(Fleet)
    fleet.first, fleet.procs, q = 0, [types.SimpleNamespace(pid=42, exitcode=searcher.SAID)], queue.Queue()
    fleet.messages = Messages(q, 4)
    try:
        threading.Timer(0.5, q.put, [dict(kind="fault", searcher=0, line=line)]).start()  # read after the exit is seen
        with pytest.raises(Dead) as said:
            fleet.alive()
        assert str(said.value) == line
        fleet.messages.faults, fleet.procs[0].exitcode, t0 = {}, 1, time.time()
        with pytest.raises(Dead) as said:
            fleet.alive()
        assert str(said.value) == "searcher 0 (pid 42) died with exit code 1" and time.time() - t0 < 0.5
    finally:
        fleet.messages.close()
