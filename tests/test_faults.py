"""Faults: signals, a dying searcher, checkpoints and resume, non-finite losses. No hangs, no
process left behind, no data lost."""

import os
import signal
import subprocess
import sys
import time

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


def start(args, tmp, torchrun=False):
    cmd = [sys.executable, os.path.join(ROOT, "tba.py"), *args]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", *cmd[1:]]
    return subprocess.Popen(cmd, cwd=tmp, env=env(tmp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


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
def test_signal_during_start_up_stops_quietly(tiny_model, tmp_path):
    """While tba.py imports and checks (seconds): one line, status 130, nothing left. The signal
    goes as soon as tba.py's start-up handlers are in (Python catches SIGINT from its own start,
    SIGTERM only once tba.py asks), not after a fixed sleep that a loaded machine may outlast."""
    out = tmp_path / "run"
    proc = start(["--model", tiny_model, *SMALL, "--out", str(out)], tmp_path)
    deadline = time.time() + 60
    while not catches(proc.pid, signal.SIGTERM):
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)
    output = proc.communicate(timeout=30)[0]
    assert proc.returncode == 130, output[-3000:]
    assert output.strip().splitlines() == ["tba.py: stopped by SIGINT during start-up"], output[-3000:]
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
    checkpoint.atomic_checkpoint(str(tmp_path), 9, write("nine"))
    assert (tmp_path / "checkpoint" / "trainer.pt").read_text() == "nine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "checkpoint-000009"]  # no leftovers


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
        t = tba.Trainer(cfg, data, None, types.SimpleNamespace(first=None, training=True), time.time())
        try:
            t.step = 2
            t.checkpoint()
            first = os.path.realpath(os.path.join(out, "checkpoint"))
            open(os.path.join(first, "marker"), "w").close()
            t.checkpoint()
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
def test_weights_that_do_not_arrive_intact_stop_the_run_in_one_line(tiny_model, tmp_path):
    """One tensor of the weights of step 3 altered in the shared copy after the trainer fingerprinted it: the searcher
    that loads them finds it (read back from its engine) and the run stops after a checkpoint, in one line naming the
    version, the searcher and the tensor; the rows before say which versions were verified."""
    wrapper = tmp_path / "wrong_weights.py"
    wrapper.write_text(WRONG_WEIGHTS.format(root=ROOT, tba=os.path.join(ROOT, "tba.py")))
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, str(wrapper), "--model", tiny_model, "--steps", "50", *SMALL, "--out", str(out)],
                       cwd=tmp_path, env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=300)
    assert p.returncode == 1, p.stdout[-3000:]
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("tba.py: error: searcher 0: the weights of step 3 did not arrive intact: "
                           "model.layers.0.mlp.down_proj.weight holds sum"), last
    assert last.endswith(f"checkpoint in {out / 'checkpoint'}")
    verified = [r["verified"] for r in metrics(out) if r["kind"] == "train"]
    assert verified[0] == -1 and 1 in verified and max(verified) <= 2, verified  # (the initial weights came from disk)
