"""A searcher that hangs (SIGSTOP: alive, but silent, like one stuck in vLLM or on a wedged GPU)
and several trainer ranks waiting on rank 0: the run bounds staleness, warns, says what it waits
for, and stops with status 1 after a checkpoint; every rank takes stop decisions together."""

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import ROOT, env, metrics
from runtime.errors import Silent
from test_faults import SMALL, assert_all_gone, assert_checkpoint, searcher_pids, wait_for_steps


def start(args, tmp, ranks=1):
    """tba.py under torchrun with `ranks` trainer ranks; its output goes to tmp/output.txt (read it
    while it runs) and, at the end, to proc.communicate()."""
    log = open(tmp / "output.txt", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
                             os.path.join(ROOT, "tba.py"), *args], cwd=tmp, env=env(tmp), stdout=log,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    proc.stdout = log
    proc.communicate = lambda timeout: (proc.wait(timeout), (tmp / "output.txt").read_text())[1:]
    return proc


def train_steps(out):
    return sum(r["kind"] == "train" for r in metrics(out))


def wait_for_a_second_round(proc, out, timeout=120):
    """Until the trainer has learnt from data of weights past step 0: the searcher has sent two rounds at least (on
    a loaded machine the trainer can take its first steps on the first round alone)."""
    deadline = time.time() + timeout
    while not any(r["kind"] == "train" and r["staleness"] < r["step"] - 1 for r in metrics(out)):
        assert proc.poll() is None and time.time() < deadline, (out.parent / "output.txt").read_text()[-3000:]
        time.sleep(0.2)


def freeze_searcher(proc, out, then=3, window=60):
    """SIGSTOP the searcher while it holds no weight-sync lock: a searcher stopped inside its reload
    (a few ms of each round) stops the trainer's next publish instead, a different fault (see
    test_a_searcher_stopped_holding_the_lock_stops_the_run_like_a_silent_one). The lock is known to be
    free once the trainer has taken `then` more steps (a publish every 2), or once it says that it
    waits for fresh(er) data (it waits there, outside any publish, and never publishes again); else,
    after `window` seconds (shorter than the run's --timeout), let the searcher go on and retry."""
    output = out.parent / "output.txt"
    waits = lambda: output.read_text().count("tba.py: waiting for fresh")
    (pid,) = searcher_pids(proc.pid)
    for _ in range(5):
        n, said = train_steps(out), waits()
        os.kill(pid, signal.SIGSTOP)
        deadline = time.time() + window  # generous: the machine may be loaded
        while time.time() < deadline:
            assert proc.poll() is None, output.read_text()[-3000:]
            if train_steps(out) >= n + then or waits() > said:
                return pid, n
            time.sleep(0.1)
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.5)
    raise AssertionError("the trainer made no progress with the searcher stopped")


@pytest.mark.engine
@pytest.mark.parametrize("cap", ["reuse cap", "staleness bound"])
def test_silent_searcher_halts_training_warns_and_stops(cap, tiny_model, tmp_path):
    """The issue's probe: SIGSTOP the searcher. The trainer takes a few more steps at most: as many as
    the reuse cap's bank allows (k steps here), or, with the cap off, up to --max-staleness steps past
    the newest data. It says what it waits for, warns naming the searcher, and after --timeout of
    silence stops with status 1 naming it, after a checkpoint of the last step."""
    out, S, timeout = tmp_path / "run", 6, 12  # --start-timeout (600) covers the start-up: --timeout the silence
    bound = ["--max-reuse", "1"] if cap == "reuse cap" else ["--max-reuse", "0", "--max-staleness", str(S)]
    proc = start(["--model", tiny_model, "--steps", "100000", *SMALL, *bound, "--sync-every", "2",
                  "--timeout", str(timeout), "--out", str(out)], tmp_path)
    try:
        wait_for_steps(proc, out, 3)
        wait_for_a_second_round(proc, out)  # the warning needs the searcher's usual gap between two rounds
        everything = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        pid, stopped_at = freeze_searcher(proc, out, window=8)  # < --timeout
        t0 = time.time()
        output = proc.communicate(timeout=timeout + 120)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, output[-3000:]
    last = next(line for line in output.splitlines() if line.startswith("tba.py: error:"))  # torchrun's report follows
    assert last.startswith(f"tba.py: error: searcher 0 (pid {pid}) has sent nothing for "), output[-3000:]
    assert last.endswith(f"(--timeout {timeout}); checkpoint in {out / 'checkpoint'}"), last
    assert time.time() - t0 < timeout + 60
    assert f"tba.py: warning: searcher 0 (pid {pid}) has sent nothing for " in output, output[-3000:]
    steps = [r["step"] for r in metrics(out) if r["kind"] == "train"]
    if cap == "reuse cap":  # the data in flight (3 steps' worth in freeze_searcher), then the bank: k = 2 steps
        assert "tba.py: waiting for fresh data: " in output and "(--max-reuse 1)" in output, output[-3000:]
        assert max(steps) <= stopped_at + 3 + 2 + 1, (stopped_at, max(steps))
    else:  # the newest data is at most from the step the searcher stopped at (plus the few in flight)
        assert "tba.py: waiting for fresher data: the newest was sampled by the weights of step " in output, output[-3000:]
        assert max(steps) <= stopped_at + 3 + S + 1, (stopped_at, max(steps))
    state = assert_checkpoint(out)
    assert state["step"] == max(steps)
    assert_all_gone(everything)


SLOW_EVALUATION = """# the test's stand-in for a long evaluation: each part of searcher 0's evaluation takes 6 s more
import os, time
if os.environ.get("TBA_TEST_EVAL_PARTS"):
    from tasks import task
    real = task.Scorer.evaluate_part
    def evaluate_part(self, prompts, answers):
        with open(os.environ["TBA_TEST_EVAL_PARTS"], "a") as f:
            f.write(f"{time.time()}\\n")
        time.sleep(6)
        return real(self, prompts, answers)
    task.Scorer.evaluate_part = evaluate_part
"""


@pytest.mark.engine
def test_an_evaluation_longer_than_the_timeout_is_not_silence(tiny_model, tmp_path):
    """Searcher 0's first evaluation outlasts --timeout (2 parts, of 256 and 144 problems, each made
    6 s slower by a sitecustomize the test writes: 12 s against --timeout 9): it beats after each
    part, so the run goes on, with no warning; stopped (SIGSTOP) in the middle of its next evaluation,
    it is silent, and the run stops after --timeout with a checkpoint, naming it."""
    out, timeout, parts = tmp_path / "run", 9, tmp_path / "parts.txt"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_EVALUATION)
    os.environ.update(TBA_TEST_EVAL_PARTS=str(parts), PYTHONPATH=f"{hook}:{ROOT}")  # start() copies os.environ
    try:
        proc = start(["--model", tiny_model, "--steps", "100000", *SMALL, "--eval-every", "4",
                      "--timeout", str(timeout), "--out", str(out)], tmp_path)
    finally:
        del os.environ["TBA_TEST_EVAL_PARTS"], os.environ["PYTHONPATH"]
    evals = lambda: [r for r in metrics(out) if r["kind"] == "eval"] if (out / "metrics.jsonl").exists() else []
    count = lambda: len(parts.read_text().splitlines()) if parts.exists() else 0
    try:
        deadline = time.time() + 300
        while not evals():  # the evaluation of step 0, longer than --timeout
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "output.txt").read_text()[-3000:]
            time.sleep(0.5)
        assert evals()[0]["step"] == 0 and evals()[0]["seconds"] > timeout
        everything = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        while count() < 2 + 2:  # searcher 0 is in the second evaluation's second part
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "output.txt").read_text()[-3000:]
            time.sleep(0.2)
        (pid,) = searcher_pids(proc.pid)
        os.kill(pid, signal.SIGSTOP)
        t0 = time.time()
        before = (tmp_path / "output.txt").read_text()
        output = proc.communicate(timeout=timeout + 120)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, output[-3000:]
    assert "has sent nothing" not in before, before[-3000:]  # an evaluation longer than --timeout: no word
    last = next(line for line in output.splitlines() if line.startswith("tba.py: error:"))
    assert last.startswith(f"tba.py: error: searcher 0 (pid {pid}) has sent nothing for "), output[-3000:]
    assert last.endswith(f"(--timeout {timeout}); checkpoint in {out / 'checkpoint'}"), last
    assert time.time() - t0 < timeout + 60
    assert_checkpoint(out)
    assert_all_gone(everything)


@pytest.mark.engine
def test_ctrl_c_in_the_final_evaluation_wait_with_two_ranks(tiny_model, tmp_path):
    """Two trainer ranks; the searcher stops before the end, so rank 0 waits for the final
    evaluation; Ctrl-C there: both ranks write the checkpoint together (its gathers are collective)
    and stop at once, with status 130 and nothing left behind. No weights are published before the last step
    (--sync-every: the steps), so the searcher, which reads the weights only when they move, cannot be stopped
    inside a read, where it would hold the next publish, and the trainer, until it went on; and it is stopped
    once, whatever step the trainer (unbounded: several steps a second) has reached, for the final evaluation
    needs the last step's weights, which only then come."""
    out, steps = tmp_path / "run", 18
    proc = start(["--model", tiny_model, "--steps", str(steps), *SMALL, "--max-reuse", "0", "--max-staleness", "0",
                  "--sync-every", str(steps), "--timeout", "120", "--out", str(out)], tmp_path, ranks=2)  # no bound
    try:
        wait_for_steps(proc, out, 3)
        everything = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        (pid,) = searcher_pids(proc.pid)
        os.kill(pid, signal.SIGSTOP)
        deadline = time.time() + 120
        while train_steps(out) < steps:
            assert time.time() < deadline and proc.poll() is None, (tmp_path / "output.txt").read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(3)  # rank 0 in the wait for the final evaluation, rank 1 in its broadcast
        t0 = time.time()
        os.killpg(proc.pid, signal.SIGINT)
        output = proc.communicate(timeout=30)[0]
        assert time.time() - t0 < 30
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert f"tba.py: stopped by SIGINT; checkpoint in {out / 'checkpoint'}" in output, output[-3000:]
    state = assert_checkpoint(out)
    assert state["step"] == steps
    assert_all_gone(everything)


@pytest.mark.engine
def test_two_ranks_outlast_the_process_group_timeout_while_rank_0_waits(tiny_model, tmp_path):
    """Rank 0 waits for an initial buffer that takes longer than --timeout to fill (messages keep
    coming, so nothing is wrong); rank 1 waits for it in collectives. It must not time out: rank 0
    answers it every slice of the wait."""
    out, timeout = tmp_path / "run", 10
    proc = start(["--model", tiny_model, "--steps", "2", *SMALL, "--timeout", str(timeout), "--buffer-capacity",
                  "1000", "--initial-buffer", "200000", "--out", str(out)], tmp_path, ranks=2)
    waited = lambda: max(map(int, re.findall(r"waiting for the initial buffer \(.*\((\d+) s so far\)",
                                             (tmp_path / "output.txt").read_text())), default=0)
    try:  # rank 1 has waited longer than that in a broadcast (rank 0 loads its model after it)
        deadline = time.time() + 600
        while waited() < timeout + 15:
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "output.txt").read_text()[-3000:]
            time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGTERM)
        output = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "tba.py: stopped by SIGTERM; before the first step: nothing to save" in output.splitlines(), output[-3000:]


def test_watch_warns_then_stops_on_its_clock(monkeypatch):
    """The watch on a fake clock: no warning before the first gap is known (start-up), a warning at
    5 x the longest gap (10 s at least), once; Silent at --timeout; a message resets it all."""
    import types
    import pytest
    from runtime import processes
    now, lines = [1000.0], []
    monkeypatch.setattr(processes.time, "time", lambda: now[0])
    watch = processes.Watch([types.SimpleNamespace(pid=42)], 100.0)
    now[0] += 90
    lines += watch.check()  # start-up: silent 90 s, no warning (no usual gap yet), under --timeout
    lines += watch.heard({"kind": "search", "searcher": 0, "version": 3})
    now[0] += 4
    lines += watch.heard({"kind": "search", "searcher": 0, "version": 5})  # gap 4 s: warn after 20 s
    assert lines == []
    now[0] += 19
    lines += watch.check()
    assert lines == []
    now[0] += 2
    lines += watch.check()
    lines += watch.check()
    assert len(lines) == 1 and lines[0].startswith("tba.py: warning: searcher 0 (pid 42) has sent nothing for 21 s")
    lines += watch.heard({"kind": "eval", "searcher": 0, "version": 4})
    assert lines[-1] == "tba.py: searcher 0 sends again, after 21 s"
    now[0] += 100.5
    with pytest.raises(Silent, match=r"searcher 0 \(pid 42\) has sent nothing for 100 s \(--timeout 100\)"):
        watch.check()


def test_the_time_the_trainer_reads_nothing_is_no_searchers_silence():
    """Issue 65 (review item 4): while the trainer reads nothing (stalled in a collective, a long step), its
    local queue fills and the searchers wait to send: the watch counts no silence then (before, it warned that a
    searcher was silent beside a stalled rank's error line); once the trainer reads again, silence counts."""
    import queue as queue_module
    import types
    from runtime import processes
    q = queue_module.Queue()
    messages = processes.Messages(q, 1)
    try:
        watch = processes.Watch([types.SimpleNamespace(pid=42)], 4.0, clock=messages.clock)  # warns after 2 s
        for _ in range(2):  # a gap of 0.3 s; the second message waits for room: the trainer reads nothing
            q.put({"kind": "search", "searcher": 0})
            deadline = time.time() + 30
            while len(messages.stamps) < 1 and time.time() < deadline:
                time.sleep(0.01)
            now, msg = messages.stamps.popleft()
            assert watch.heard(msg, now) == []
            time.sleep(0.3)
        time.sleep(3)
        assert watch.check() == [] and messages.held[1] is not None
        messages.get(timeout=5)  # the trainer reads again
        time.sleep(3)
        lines = watch.check()
        assert len(lines) == 1 and lines[0].startswith("tba.py: warning: searcher 0 (pid 42) has sent"), lines
    finally:
        messages.close()


def test_take_counts_what_arrives_and_the_newest_version():
    """Fleet.take: each search message's trajectories into the buffer (received, and kept: not those scored
    under an older pi_ref), the newest weight version that sampled data; evaluations into the log."""
    import queue as queue_module
    import types
    import numpy as np
    from buffer import ReplayBuffer, Trajectory
    from runtime.evaluations import Asked
    from runtime.fleet import Fleet
    q, rows = queue_module.Queue(), []
    traj = lambda p, version, pi_ref=0: Trajectory(p, np.array([p], np.int32), 0.0, 0.0, 0.0, version, pi_ref)
    for msg in ({"kind": "search", "searcher": 0, "version": 3, "trajectories": [traj(0, 3), traj(1, 3, pi_ref=2)]},
                {"kind": "search", "searcher": 0, "version": 5, "trajectories": [traj(2, 5)]},
                {"kind": "search", "searcher": 0, "version": 4, "trajectories": [traj(3, 4)]},
                {"kind": "eval", "searcher": 0, "version": 4, "scores": {"accuracy": 0.5}, "example": {}, "seconds": 1.0}):
        q.put(dict(msg, generate=0.0, slept=0.0, charged=0.0, over=0.0, parts={}, seconds_per_token=None, verified=-1))
    fleet = Fleet.__new__(Fleet)
    fleet.messages, fleet.procs, fleet.cfg = q, [], types.SimpleNamespace(timeout=60, lag=None, task="arith")
    fleet.log = types.SimpleNamespace(eval=lambda *row: rows.append(row), searched=lambda msg: None)
    fleet.received = fleet.kept = fleet.tokens = 0
    fleet.heard, fleet.dead, fleet.silent = True, None, None
    fleet.newest, fleet.published, fleet.verified = -1, {4: (1.0, 0.0)}, {}
    fleet.evals = Asked(fleet)
    buffer = ReplayBuffer(10, 0.5, 0.0)
    assert fleet.take(buffer, lambda: True) == 0.0 and q.empty()
    assert (fleet.received, fleet.kept, len(buffer), fleet.newest, fleet.tokens) == (4, 3, 3, 5, 4)  # a token each
    assert fleet.evals.evaluated == [4] and rows == [(4, {"accuracy": 0.5}, {}, 1.0, (1.0, 0.0))]


def test_watch_hears_an_evaluations_beats_and_names_the_node(monkeypatch):
    """A long evaluation: searcher 0 beats after each part, so 250 s of evaluating under --timeout 100
    is no silence, and parts much longer than its rounds draw no warning while the evaluation is asked
    for; after its result, the same silence draws a warning, then Silent. On node 1 (searchers numbered
    from 2 there) the lines name the node and the node's own searcher."""
    import types
    import pytest
    from runtime import processes
    now, lines = [1000.0], []
    monkeypatch.setattr(processes.time, "time", lambda: now[0])
    watch = processes.Watch([types.SimpleNamespace(pid=7), types.SimpleNamespace(pid=8)], 100.0,
                            first=2, where="node 1: ")
    for _ in range(3):  # rounds every 4 s
        now[0] += 4
        for i in (2, 3):
            lines += watch.heard({"kind": "search", "searcher": i, "version": 0})
    watch.evaluating = True  # asked (Trainer.evaluate): searcher 2, node 1's first, evaluates in 5 parts of 50 s
    for _ in range(5):
        for _ in range(10):
            now[0] += 5
            lines += watch.heard({"kind": "search", "searcher": 3, "version": 0})
            lines += watch.check()
        lines += watch.heard({"kind": "beat", "searcher": 2, "done": 256})
    lines += watch.heard({"kind": "eval", "searcher": 2, "version": 0})
    assert lines == [] and not watch.evaluating and watch.gap[0] == 4
    for _ in range(5):  # then silent: a warning past 5 x its 4 s rounds, Silent at --timeout
        now[0] += 5
        lines += watch.heard({"kind": "search", "searcher": 3, "version": 0})
        lines += watch.check()
    assert lines == ["tba.py: warning: node 1: searcher 0 (pid 7) has sent nothing for 25 s (usually every 4.0 s "
                     "at most); the run stops if it stays silent 100 s (--timeout)"]
    now[0] += 76
    lines += watch.heard({"kind": "search", "searcher": 3, "version": 0})
    with pytest.raises(Silent, match=r"^node 1: searcher 0 \(pid 7\) has sent nothing for 101 s "
                                               r"\(--timeout 100\)$"):
        watch.check()


def test_max_staleness_is_checked(refusal):
    assert refusal(["--max-staleness", "-1"]) == (2, ["tba.py: error: --max-staleness: must be 0 (no bound) or more"])


def lock_rank(path, out, how, port, results):
    """One trainer rank whose searcher stopped while it held the weight-sync lock (`how` "lock": the lock taken
    here and never given back) or while it read the weights ("reading": its flag raised here and never lowered):
    the publish gives up after --timeout and rank 0 records why, naming the reader, which stops the run with a
    checkpoint at the next batch, as a silent searcher does."""
    import time
    import traceback
    import torch.distributed as dist
    from runtime import weights
    from test_nodes import searcherless_fleet
    try:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        fleet, model = searcherless_fleet(path, out, 1)
        try:
            if how == "lock":
                fleet.shared.lock.acquire()  # the stopped searcher's
            else:
                fleet.shared.reading[0] = 1  # the stopped searcher's: inside the shared copy
            t0 = time.time()
            fleet.publish(weights.gather(model), 1)
            results.put({"silent": [fleet.silent] if fleet.silent else [], "reason": fleet.stop_reason(),
                         "version": fleet.shared.version.value, "seconds": time.time() - t0})
        finally:
            fleet.log.close()
    except BaseException:
        results.put({"error": traceback.format_exc()})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.engine
@pytest.mark.parametrize("how", ["lock", "reading"])
def test_a_searcher_stopped_holding_the_lock_stops_the_run_like_a_silent_one(how, tiny_model, tmp_path):
    from conftest import report_of
    got = report_of(lock_rank, tiny_model, str(tmp_path / "run"), how)
    message = {"lock": "the weight-sync lock was not free for 2 s: a searcher stopped while it held it (--timeout 2)",
               "reading": "searcher 0 stopped while it read the weights: still reading after 2 s (--timeout 2)"}[how]
    assert got["silent"] == [message] and got["reason"] == ("silent", message)
    assert got["version"] == 0 and got["seconds"] >= 2  # nothing published; it waited out --timeout
