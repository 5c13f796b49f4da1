"""Several nodes, simulated on one machine: two torchrun launches (static rendezvous, gloo) that each
believe they are a node, with one trainer process and one searcher each. Also the wire format of
the trajectories between nodes, and the cast before FSDP2's all-gather."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import types

import numpy as np
import psutil
import pytest
import torch

import buffer
from buffer import ReplayBuffer, Trajectory
from runtime.config import Config
from runtime import nodes, weights
from conftest import ROOT, env, free_port, get_report, metrics
from test_faults import assert_all_gone, assert_checkpoint, searcher_pids, wait_for_steps

SMALL = ["--prompts-per-step", "8", "--samples-per-prompt", "4", "--max-new-tokens", "6"]


def launch(node: int, port: int, args, tmp, output=None, script=None):
    """One 'node': torchrun with a static rendezvous on 127.0.0.1:port, in its own session; its output
    to a pipe, or to the file `output` (readable while it runs). `script`: a wrapper of tba.py in `tmp`, whose
    modules there the searchers import too (on PYTHONPATH: the fork server's path)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
           "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
           script or os.path.join(ROOT, "tba.py"), *args]
    environ = dict(env(tmp), PYTHONPATH=str(tmp)) if script else env(tmp)
    if output is None:
        return subprocess.Popen(cmd, cwd=tmp, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    with open(output, "w") as f:
        return subprocess.Popen(cmd, cwd=tmp, env=environ, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def tree(proc) -> list[int]:
    """The launcher's pid and its descendants', while it runs (a reaped pid could be anyone's)."""
    if proc.poll() is not None:
        return []
    try:
        return [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_all(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.engine
def test_two_nodes_learn_with_node_1s_trajectories(tiny_model, tmp_path):
    """Both launches complete; rank 0 trains on node 1's trajectories, which come from weights that
    node 1's leader received (versions past 0), under a reuse cap that counts both nodes' data, and
    held-out accuracy rises."""
    out, port = tmp_path / "run", free_port()
    # B = 32 x K = 8 and lr 5e-5 (the defaults): this model learns there (0.27 -> 0.31 in 30 steps, at
    # B = 8 x K = 4 it did not; at lr 1e-3 it collapsed)
    # R = 0.3: under the 0.4 draws a trajectory that 40 steps take here uncapped, so that the cap holds the trainer
    args = ["--model", tiny_model, "--max-new-tokens", "6", "--steps", "40", "--eval-every", "0", "--max-reuse", "0.3",
            "--out", str(out)]
    node1 = launch(1, port, args, tmp_path)
    node0 = launch(0, port, args, tmp_path)
    try:
        outputs = [p.communicate(timeout=600)[0] for p in (node0, node1)]
    finally:
        kill_all(tree(node0) + tree(node1))  # only if the test failed: by now none of them is left
    assert node0.returncode == 0, outputs[0][-3000:]
    assert node1.returncode == 0, outputs[1][-3000:]
    rows = metrics(out)
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, 41))
    for r in train:
        assert len(r["samples_per_node"]) == 2 and sum(r["samples_per_node"]) == r["samples"]
    assert train[-1]["samples_per_node"][1] > 0, "nothing arrived from node 1"
    assert max(r["version_per_node"][1] for r in train) >= 2, "node 1's searcher never got new weights"
    # the reuse cap counts every node's data: never more than R draws a trajectory received, and more than
    # R x node 0's (a cap fed by node 0's count alone could not allow them)
    assert all(r["reuse"] <= 0.3 + 1e-9 for r in train), [r["reuse"] for r in train]
    assert train[-1]["reuse"] * train[-1]["samples"] > 0.3 * train[-1]["samples_per_node"][0], train[-1]
    assert evals[0]["version"] == 0 and evals[-1]["version"] == 40
    assert evals[-1]["accuracy"] > evals[0]["accuracy"], [e["accuracy"] for e in evals]
    assert "done: 40 steps" in outputs[0]


@pytest.mark.engine
def test_a_resume_over_two_nodes_keeps_each_nodes_count(tiny_model, tmp_path):
    """Two nodes, 6 steps and a checkpoint, then resumed to 8 steps: the checkpoint carries each node's count (plain
    data), and every row after the resume counts on from it, for node 1 too. Before, every trajectory from before the
    checkpoint was credited to node 0 and node 1's count restarted at 0."""
    out = tmp_path / "run"
    for steps, extra in ((6, ["--save-every", "6"]), (8, ["--resume", str(out / "checkpoint")])):
        args = ["--model", tiny_model, *SMALL, "--steps", str(steps), "--eval-every", "0", "--out", str(out), *extra]
        port = free_port()
        node1, node0 = launch(1, port, args, tmp_path), launch(0, port, args, tmp_path)
        try:
            outputs = [p.communicate(timeout=600)[0] for p in (node0, node1)]
        finally:
            kill_all(tree(node0) + tree(node1))  # only if the test failed: by now none of them is left
        assert node0.returncode == node1.returncode == 0, (outputs[0][-3000:], outputs[1][-3000:])
        if steps == 6:
            saved = torch.load(out / "checkpoint" / "trainer.pt", weights_only=True)
    train = [r for r in metrics(out) if r["kind"] == "train"]
    before, after = [r for r in train if "resumed" not in r], [r for r in train if r.get("resumed") == 6]
    assert [r["step"] for r in after] == [7, 8] and before[-1]["step"] == 6
    assert saved["node_samples"][1:] == before[-1]["samples_per_node"][1:] and before[-1]["samples_per_node"][1] > 0
    for r in after:
        assert sum(r["samples_per_node"]) == r["samples"]
        assert all(now >= then for now, then in zip(r["samples_per_node"], before[-1]["samples_per_node"])), (
            r["samples_per_node"], before[-1]["samples_per_node"])


def in_flow(port: int, args, out, tmp, outputs=(None, None), script1=None):
    """Two 'nodes' (node 1 launched first, through `script1` if given) in full flow: node 0 has taken 3 steps
    and node 1's searcher has sent data. Returns (node 0, node 1); kills both if they do not get there."""
    node1 = launch(1, port, args, tmp, outputs[1], script1)
    node0 = launch(0, port, args, tmp, outputs[0])
    try:
        wait_for_steps(node0, out, 3)
        deadline = time.time() + 120
        while max(r.get("samples_per_node", [0, 0])[1] for r in metrics(out)) == 0:
            assert time.time() < deadline and node0.poll() is None and node1.poll() is None, "no data from node 1"
            time.sleep(0.5)
    except BaseException:
        kill_all(tree(node0) + tree(node1))
        raise
    return node0, node1

@pytest.mark.engine
@pytest.mark.parametrize("lost", ["node 1", "node 0", "node 1's searcher"])
def test_a_lost_node_stops_every_node(lost, tiny_model, tmp_path):
    """kill -9 of a whole 'node' (launcher, trainer, searcher) or of one searcher on node 1, mid-run:
    the other node stops within --timeout with a non-zero status and a line saying what was lost,
    and no process is left on either."""
    out, port, timeout = tmp_path / "run", free_port(), 40
    args = ["--model", tiny_model, *SMALL, "--steps", "100000", "--eval-every", "0", "--timeout", str(timeout),
            "--out", str(out)]
    node0, node1 = in_flow(port, args, out, tmp_path)
    launches = {"node 0": node0, "node 1": node1}
    try:
        everything = tree(node0) + tree(node1)
        if lost == "node 1's searcher":  # node 0 names the node; node 1's torchrun report, the searcher
            victims, expect = searcher_pids(node1.pid), {node0: "node 1: searcher 0 (pid", node1: "searcher 0 (pid"}
        else:
            other = node1 if lost == "node 0" else node0
            victims, expect = tree(launches[lost]), {other: "lost contact with another node"}
        assert victims
        t0 = time.time()
        kill_all(victims)
        for p, line in expect.items():
            output = p.communicate(timeout=timeout + 30)[0]
            assert time.time() - t0 < timeout, output[-3000:]
            assert p.returncode not in (0, None), output[-3000:]
            assert line in output, output[-3000:]
        assert_all_gone(everything, within=10)
    finally:
        kill_all(tree(node0) + tree(node1))  # only if the test failed: by now none of them is left


@pytest.mark.engine
@pytest.mark.parametrize("node", [1, 0])
def test_a_silent_searcher_of_any_node_stops_the_run_after_a_checkpoint(node, tiny_model, tmp_path):
    """SIGSTOP one node's searcher (alive, silent: stuck in vLLM, a wedged GPU): rank 0 warns, naming
    the node and the searcher, and after --timeout the run stops after a checkpoint of the last step
    with one line naming them; both launches exit, and nothing is left on either."""
    out, port, timeout = tmp_path / "run", free_port(), 15  # --start-timeout (600) covers the start-up
    args = ["--model", tiny_model, *SMALL, "--steps", "100000", "--eval-every", "0", "--timeout", str(timeout),
            "--out", str(out)]
    logs = [tmp_path / "node0.txt", tmp_path / "node1.txt"]
    node0, node1 = in_flow(port, args, out, tmp_path, logs)
    launches = [node0, node1]
    try:
        everything = tree(node0) + tree(node1)
        (pid,) = searcher_pids(launches[node].pid)
        steps = lambda: sum(r["kind"] == "train" for r in metrics(out))
        for _ in range(5):  # stopped outside its weight reload: the run goes on 3 steps (a sync every 2)
            n = steps()
            os.kill(pid, signal.SIGSTOP)
            deadline = time.time() + timeout - 10
            while steps() < n + 3 and time.time() < deadline:
                assert node0.poll() is None and node1.poll() is None, logs[0].read_text()[-3000:]
                time.sleep(0.1)
            if steps() >= n + 3:
                break
            os.kill(pid, signal.SIGCONT)  # it held the lock (a different fault: the test above); again
            time.sleep(0.5)
        else:
            raise AssertionError("the run made no progress with the searcher stopped")
        t0 = time.time()
        codes = [p.wait(timeout=timeout + 120) for p in launches]
        output = logs[0].read_text()
    finally:
        kill_all(tree(node0) + tree(node1))  # only if the test failed: by now none of them is left
    assert all(c not in (0, None) for c in codes), (codes, output[-3000:], logs[1].read_text()[-3000:])
    assert time.time() - t0 < timeout + 90, output[-3000:]
    assert f"tba.py: warning: node {node}: searcher 0 (pid {pid}) has sent nothing for " in output, output[-3000:]
    assert_silent_searcher_stopped_the_run(output, node, pid, timeout, out, everything)


def assert_silent_searcher_stopped_the_run(output: str, node: int, pid: int, timeout: int, out, everything):
    """Node 0's last error names `node`'s searcher 0 as silent for --timeout; the checkpoint holds the last step
    trained; every process of both launches is gone."""
    last = next(line for line in output.splitlines() if line.startswith("tba.py: error:"))
    assert last.startswith(f"tba.py: error: node {node}: searcher 0 (pid {pid}) has sent nothing for "), output[-3000:]
    assert last.endswith(f"(--timeout {timeout}); checkpoint in {out / 'checkpoint'}"), last
    state = assert_checkpoint(out)
    assert state["step"] == max(r["step"] for r in metrics(out) if r["kind"] == "train")
    assert_all_gone(everything, within=30)


# node 1's searcher, once the file STOP exists, writes its next search message half-way into the queue's pipe and
# stops itself (SIGSTOP): as if stopped while the queue's thread wrote it (a message over 16 KB goes in two writes,
# and a full pipe cuts any; a round at the default sizes is about 19 KB), at a moment the test chooses
HALFWAY = textwrap.dedent("""
    import os, signal, struct
    from multiprocessing.reduction import ForkingPickler
    import searcher

    def run(index, cfg, shared, channels, *rest):
        if index == 1:  # node 1's first searcher
            plain = searcher.send

            def send(queue, message, stop):
                if message["kind"] == "search" and os.path.exists({stop!r}):
                    data = ForkingPickler.dumps(message)
                    with queue._wlock:  # the queue's thread writes under it: no other message in between
                        os.write(queue._writer.fileno(), struct.pack("!i", len(data)) + bytes(data[:len(data) // 2]))
                        os.kill(os.getpid(), signal.SIGSTOP)
                return plain(queue, message, stop)
            searcher.send = send
        searcher.run(index, cfg, shared, channels, *rest)
""")
HALFWAY_TBA = textwrap.dedent("""
    import runpy, sys
    sys.path.insert(0, {root!r})
    sys.argv = [{tba!r}, *sys.argv[1:]]
    from runtime import vllm_env
    vllm_env.set_up()
    import halfway, searcher
    searcher.run = halfway.run  # Fleet.spawn's target, pickled by name: the searcher imports it from PYTHONPATH
    runpy.run_path({tba!r}, run_name="__main__")
""")


@pytest.mark.engine
def test_a_searcher_stopped_half_way_through_a_message_stops_the_run_after_a_checkpoint(tiny_model, tmp_path):
    """multiprocessing reads a queued message whole, with no timeout: a leader that read it itself would wait inside
    the half message for good, and rank 0 in the leaders' meeting until the groups' timeout (2 x --timeout + 600 s),
    with no checkpoint and no line naming the searcher (the watchdog sees a leader outside any collective). A thread
    reads the messages (runtime.processes.Messages): the run stops after a checkpoint within --timeout and a little,
    with one line naming node 1's searcher, as for a silent one."""
    out, port, timeout = tmp_path / "run", free_port(), 15
    stop = tmp_path / "STOP"
    (tmp_path / "halfway.py").write_text(HALFWAY.format(stop=str(stop)))
    wrapper = tmp_path / "halfway_tba.py"
    wrapper.write_text(HALFWAY_TBA.format(root=ROOT, tba=os.path.join(ROOT, "tba.py")))
    args = ["--model", tiny_model, *SMALL, "--steps", "100000", "--eval-every", "0", "--timeout", str(timeout),
            "--out", str(out)]
    logs = [tmp_path / "node0.txt", tmp_path / "node1.txt"]
    node0, node1 = in_flow(port, args, out, tmp_path, logs, script1=str(wrapper))
    try:
        everything = tree(node0) + tree(node1)
        (pid,) = searcher_pids(node1.pid)
        stop.touch()
        deadline = time.time() + 60
        while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
            assert time.time() < deadline, "node 1's searcher did not stop half-way through a message"
            time.sleep(0.1)
        t0 = time.time()
        while (node0.poll() is None or node1.poll() is None) and time.time() - t0 < timeout + 60:
            time.sleep(0.2)
        took, codes = time.time() - t0, [node0.poll(), node1.poll()]
        output = logs[0].read_text()
    finally:
        kill_all(tree(node0) + tree(node1))  # only if the test failed: by now none of them is left
    assert all(c not in (0, None) for c in codes), (codes, took, output[-3000:], logs[1].read_text()[-3000:])
    assert_silent_searcher_stopped_the_run(output, 1, pid, timeout, out, everything)


# --- the wire format and the cast: no launches -----------------------------------------------------
def test_trajectories_cross_nodes_as_plain_data():
    ts = [Trajectory(3, np.array([5, 1, 70000], dtype=np.int32), 0.5, -1.25, -2.0000001, 4, 2),
          Trajectory(7, np.zeros(0, dtype=np.int32), 1.0, -0.1, float("nan"), 6, 0)]
    payload = nodes.encode(ts)
    assert payload.dtype == torch.uint8
    back, report = nodes.decode(payload)
    assert len(back) == 2
    for a, b in zip(ts, back):
        for f in buffer.SCALARS:
            assert getattr(a, f) == getattr(b, f) or np.isnan(getattr(a, f)) and np.isnan(getattr(b, f))
        assert b.response.dtype == np.int32 and np.array_equal(a.response, b.response)
    assert report == {"error": None, "silent": None, "said": []}
    assert nodes.decode(nodes.encode([], error="searcher 1 died")) == (
        [], {"error": "searcher 1 died", "silent": None, "said": []})
    report = {"error": None, "silent": "node 1: searcher 0 (pid 9) has sent nothing for 31 s (--timeout 30)",
              "said": ["tba.py: warning: node 1: searcher 0 (pid 9) has sent nothing for 15 s (...)"]}
    back, got = nodes.decode(nodes.encode(ts[:1], silent=report["silent"], said=report["said"]))
    assert got == report and len(back) == 1
    import json
    head = json.dumps({"error": None, "silent": {"not": "a line"}, "said": [], "rows": []}).encode()
    for bad in (payload[:-4], payload[:20], torch.zeros(3, dtype=torch.uint8),
                nodes.encode([]).clone().fill_(7),
                torch.frombuffer(bytearray(len(head).to_bytes(8, "little") + head), dtype=torch.uint8)):
        with pytest.raises(ValueError, match="does not parse"):
            nodes.decode(bad)


def test_embeddings_cross_nodes_too():
    """--dedup-similarity: each trajectory's embedding travels as float32 after the tokens."""
    ts = [Trajectory(1, np.array([5, 6], dtype=np.int32), 0.5, -1.0, -2.0, 4, 0, np.array([0.6, 0.8], np.float32)),
          Trajectory(2, np.array([7], dtype=np.int32), 0.1, -1.0, -2.0, 4, 0, np.array([1.0, 0.0], np.float32))]
    back, _ = nodes.decode(nodes.encode(ts))
    assert all(np.array_equal(a.embedding, b.embedding) and b.embedding.dtype == np.float32 for a, b in zip(ts, back))
    assert all(np.array_equal(a.response, b.response) for a, b in zip(ts, back))
    assert nodes.decode(nodes.encode(ts[:1] + [Trajectory(2, np.array([7], np.int32), 0.1, -1.0, -2.0, 4)]))[0][0].embedding is None
    with pytest.raises(ValueError, match="does not parse"):
        nodes.decode(nodes.encode(ts)[:-4])


def test_lost_connections_are_told_apart_from_bugs(monkeypatch):
    """A lost connection names another node on several nodes, and a trainer rank on one (before, a rank's death on
    one node was 'lost contact with another node'); other errors are no lost connection."""
    gone = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
                        "peer [127.0.0.1]:60095. This is typically caused by a remote worker crashing.")
    said = " (Connection closed by peer [127.0.0.1]:60095); stopping"
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")  # torchrun's: nodes, and trainer ranks on each
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert nodes.lost(gone, 0, 2) == "lost contact with another node of the run" + said
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert nodes.lost(gone, 0, 2) == "lost contact with trainer rank 1" + said
    assert nodes.lost(gone, 1, 2) == "lost contact with trainer rank 0" + said
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert nodes.lost(gone, 0, 4) == "lost contact with another trainer rank" + said
    assert nodes.lost(RuntimeError("CUDA out of memory"), 0, 4) is None
    assert nodes.lost(ValueError("Connection closed by peer"), 0, 4) is None


def cast_worker(rank, port, results):
    """FSDP2 over two gloo ranks: the full weights gathered in bf16 equal those gathered in float32
    and rounded afterwards, bit for bit."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from runtime.weights import gather
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 33))
        with torch.no_grad():
            model[0].weight.mul_(1 + 1e-3 * torch.randn(96, 64))  # values that bf16 must round
        fully_shard(model[0])
        fully_shard(model)
        plain = {n: t.to(torch.bfloat16) for n, t in gather(model)}
        cast = dict(gather(model, torch.bfloat16))
        if rank == 0:
            results.put({n: (cast[n].dtype == torch.bfloat16 and torch.equal(cast[n], plain[n]),
                             cast[n].shape == plain[n].shape) for n in plain})
    finally:
        dist.destroy_process_group()
    results.close()
    results.join_thread()  # rank 0's result is sent; then out without the interpreter's teardown, which can abort
    os._exit(0)  # a finished gloo rank ("terminate called without an active exception": tba.py's end says why)


@pytest.mark.engine
def test_gathering_in_bf16_gives_the_same_weights():
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    torch.multiprocessing.start_processes(cast_worker, args=(free_port(), results), nprocs=2, start_method="spawn")
    checked = results.get(timeout=10)
    assert len(checked) == 4 and all(same and shape for same, shape in checked.values()), checked


def two_nodes(target, *args, timeout: float = 180) -> list[dict]:
    """Run target(rank, *args, port, results) in two spawned processes, each a node of one trainer rank
    (torchrun's variables set as for --nnodes 2 --nproc-per-node 1); their two reports, rank 0's first.
    Both are joined, or killed, before this returns."""
    ctx = torch.multiprocessing.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=target, args=(rank, *args, port, results), daemon=True) for rank in (0, 1)]
    for p in procs:
        p.start()
    try:
        reports = [get_report(results, procs, timeout) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return sorted(reports, key=lambda r: r["rank"])


def as_node(rank: int, port: int):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank),
                      GROUP_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def alone(rank, port, results):
    """Rank 0 alone for 3 x --timeout (as while it writes a checkpoint) while the other leader waits in
    a meeting: the leaders' group waits on, as the default group does (nodes.allowance)."""
    import datetime
    import traceback
    import torch.distributed as dist
    try:
        as_node(rank, port)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=2))
        multi = nodes.Nodes(2, 1, timeout=2.0)
        if rank == 0:
            time.sleep(6)
        parts = multi.gather(nodes.encode([], said=[f"from rank {rank}"]))
        said = [nodes.decode(p)[1]["said"] for p in parts] if rank == 0 else None
        results.put({"rank": rank, "said": said})
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.engine
def test_the_leaders_group_outlasts_the_timeout_while_rank_0_is_alone():
    reports = two_nodes(alone, timeout=60)
    assert reports[0]["said"] == [["from rank 0"], ["from rank 1"]], reports


def lock_on_node_1(rank, died, path, out, port, results):
    """Two nodes of one trainer rank. Node 1's searcher stopped (or, if `died`, was killed) while it held
    the node's weight lock (taken here, never given back): at the next sync node 1's leader waits
    --timeout for a stopped one (not for a dead one), then still joins every all-gather (rank 0
    publishes meanwhile), and at the next meeting rank 0 gets the node's silent line and ends the wait
    with it, or the node's line saying which searcher died, and stops with it."""
    import traceback
    import torch.distributed as dist
    from runtime.errors import Dead
    try:
        as_node(rank, port)
        fleet, model = searcherless_fleet(path, out, 2)
        try:
            if rank == 1:
                fleet.shared.lock.acquire()  # the stopped searcher's
                if died:  # a real process, killed (this daemon cannot have multiprocessing children)
                    searcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
                    searcher.kill()
                    fleet.procs = [types.SimpleNamespace(pid=searcher.pid, exitcode=searcher.wait())]
            t0 = time.time()
            fleet.publish(weights.gather(model), 2)
            synced = time.time() - t0
            report = {"rank": rank, "version": fleet.shared.version.value, "seconds": synced, "stopped": None}
            try:
                fleet.meet(ReplayBuffer(4, 0.5, 0.0), lambda: False)
            except Dead as e:
                report["stopped"] = str(e)
            results.put({**report, "silent": [fleet.silent] if fleet.silent else []})
        finally:
            fleet.log.close()
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def searcherless_fleet(path, out, world):
    """This rank's Fleet of a run of the tiny model with --timeout 2 on `world` ranks, built without spawning its
    searcher (this daemon cannot have children): an empty queue and a watch that hears nothing; its weights
    shared from a freshly loaded model. Returns (fleet, model)."""
    import dataclasses
    import queue as queue_module
    import tba
    from runtime import checks, policy, ranks
    from runtime.fleet import Fleet
    from runtime.log import Log
    cfg, data, _ = checks.check(checks.parse(Config, ["--model", path, *SMALL, "--timeout", "2", "--out", out]),
                                world)
    ranks.init_distributed(cfg.timeout, "cpu")  # as the Trainer does
    log = Log(cfg, int(os.environ["RANK"]), time.time())
    signals = types.SimpleNamespace(first=None, training=True)
    fleet = Fleet(dataclasses.replace(cfg, searchers=0), data, int(os.environ["RANK"]), world, log, signals)
    from runtime.processes import Messages
    fleet.channels = types.SimpleNamespace(queue=queue_module.Queue())
    fleet.messages = Messages(queue_module.Queue(), 4)
    fleet.watch = types.SimpleNamespace(heard=lambda msg: [], check=lambda: [])
    model = policy.load_policy(cfg.model_path, torch.device("cpu"), "float32")
    fleet.share(model, 0)
    return fleet, model


@pytest.mark.engine
def test_a_weight_lock_never_freed_on_node_1_stops_the_run_like_a_silent_searcher(tiny_model, tmp_path):
    line = "node 1: the weight-sync lock was not free for 2 s: a searcher stopped while it held it (--timeout 2)"
    node0, node1 = two_nodes(lock_on_node_1, False, tiny_model, str(tmp_path / "run"))
    assert node0["silent"] == [line] and node1["silent"] == [line], (node0, node1)
    assert (node0["version"], node1["version"]) == (2, 0)  # node 0 published; node 1 waited, then joined
    assert node1["seconds"] >= 2


@pytest.mark.engine
def test_a_searcher_of_node_1_killed_holding_the_weight_lock_is_named_to_rank_0(tiny_model, tmp_path):
    """Not a closed connection: node 1's leader takes part in the all-gathers and reports the death at
    the next meeting, so node 0 stops naming the node and the searcher."""
    node0, node1 = two_nodes(lock_on_node_1, True, tiny_model, str(tmp_path / "run"))
    assert "error" not in node0 and "error" not in node1, (node0, node1)
    assert re.fullmatch(r"node 1: searcher 0 \(pid \d+\) died with exit code -9", node0["stopped"]), node0
    assert re.fullmatch(r"searcher 0 \(pid \d+\) died with exit code -9", node1["stopped"]), node1
    assert (node0["version"], node1["version"]) == (2, 0) and node1["seconds"] < 2  # no wait for the dead


@pytest.mark.engine
def test_only_node_0s_first_searcher_evaluates(monkeypatch):
    """Every node spawns its searchers alike, numbered from node x searchers, but the evaluation channel
    goes to node 0's first only: the others build no evaluation models (a TL;DR policy copy)."""
    import contextlib
    import types
    from runtime.fleet import Fleet
    from tasks.task import Data
    spawned = []

    class Process:
        def __init__(self, target, name, daemon, args):
            spawned.append((name, args[0], args[3].evals))

        def start(self):
            pass

    ctx = types.SimpleNamespace(Queue=lambda maxsize=0: object(), Event=object, Value=lambda *a: object(), Lock=object,
                                Process=Process)
    cfg = types.SimpleNamespace(searchers=2, device="cuda", evaluator="searcher")  # the CPU's context is a fork server
    for rank, expected in ((0, [("searcher-0", 0, True), ("searcher-1", 1, False)]),
                           (2, [("searcher-2", 2, False), ("searcher-3", 3, False)])):  # nodes of 2 ranks
        spawned.clear()
        fleet = Fleet.__new__(Fleet)
        fleet.cfg, fleet.rank, fleet.world, fleet.first, fleet.shared, fleet.procs, fleet.step = cfg, rank, 4, rank, None, [], 0
        fleet.data, fleet.signals = Data([], [], [], []), types.SimpleNamespace(deferred=contextlib.nullcontext)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        fleet.spawn(ctx)
        evals = fleet.channels.evals
        assert [(name, index, channel is evals) for name, index, channel in spawned] == expected
        assert all(channel is None for name, index, channel in spawned if channel is not evals)


def test_take_hears_every_message():
    """A leader's take (Fleet.queued): the trajectories of search messages; every message (beats too) is heard by the
    watch in the watchdog's beat (Fleet.watching: its lines kept for rank 0, a silent searcher recorded), at the time
    the reading thread read it."""
    import multiprocessing
    import types
    from runtime.errors import Silent
    from runtime.fleet import Fleet
    from runtime.processes import Messages
    q, heard = multiprocessing.get_context("spawn").Queue(), []
    t = Trajectory(3, np.array([5, 1], dtype=np.int32), 0.5, -1.0, -2.0, 4, 0)
    messages = Messages(q, 4)
    try:
        for msg in ({"kind": "search", "searcher": 2, "trajectories": [t]}, {"kind": "beat", "searcher": 2, "done": 8}):
            q.put(msg)
        fleet = Fleet.__new__(Fleet)
        fleet.messages, fleet.silent, fleet.dead, fleet.said, fleet.rank, fleet.procs = messages, None, None, [], 1, []
        fleet.watch = types.SimpleNamespace(heard=lambda msg, now: heard.append((msg, now)) or [f"heard {msg['kind']}"],
                                            check=lambda: ["checked"])
        deadline = time.time() + 30
        while len(messages.stamps) < 2 and time.time() < deadline:
            time.sleep(0.01)
        got, said = fleet.queued()
        assert [g.prompt_id for g in got] == [3] and said == []  # the watch's lines come from its beat
        fleet.watching()
        assert [m["kind"] for m, _ in heard] == ["search", "beat"] and all(now <= time.time() for _, now in heard)
        assert fleet.queued() == ([], ["heard search", "heard beat", "checked"])
        fleet.watch.check = lambda: (_ for _ in ()).throw(Silent("searcher 2 has sent nothing"))
        fleet.watching()
        assert fleet.silent == "searcher 2 has sent nothing" and fleet.said == []
    finally:
        messages.close()


def test_a_message_left_half_written_blocks_no_wait():
    """runtime.processes.Messages: a message whose writer stopped half-way (a searcher stopped while its queue's thread
    wrote) keeps only the reading thread waiting; the leader's take (Fleet.queued) and every timed get return on
    time, so that the watch can name the silent searcher."""
    import multiprocessing
    import queue as queue_module
    import struct
    from runtime.fleet import Fleet
    from runtime.processes import Messages
    q = multiprocessing.get_context("spawn").Queue()
    messages = Messages(q, 4)
    try:
        q.put({"kind": "beat", "searcher": 0})
        assert messages.get(timeout=30)["kind"] == "beat"
        os.write(q._writer.fileno(), struct.pack("!i", 1000) + bytes(500))  # the length, then half the message
        fleet = Fleet.__new__(Fleet)
        fleet.messages, fleet.silent, fleet.said = messages, None, []
        t0 = time.time()
        assert fleet.queued() == ([], [])
        with pytest.raises(queue_module.Empty):
            messages.get(timeout=1.0)
        assert time.time() - t0 < 5
    finally:
        messages.close()
        os.write(q._writer.fileno(), bytes(500))  # the rest: the reading thread gets its message (no pickle) and ends


@pytest.mark.engine
def test_a_host_name_on_loopback_is_refused_when_the_master_is_another_machine(monkeypatch, capsys):
    """gloo listens where this machine's name resolves: 127.0.1.1 on stock Debian/Ubuntu. With the
    master on another machine and no GLOO_SOCKET_IFNAME, every CPU collective would wait until
    --timeout: refused in one line (status 2), on each node. Launches on one machine work on loopback."""
    import socket
    import types
    import psutil
    import tba
    table = {"node-b": ["127.0.1.1"], "node-c": ["10.0.0.3"], "10.0.0.1": ["10.0.0.1"], "10.0.0.2": ["10.0.0.2"],
             "127.0.0.1": ["127.0.0.1"]}

    def getaddrinfo(name, port):
        if name not in table:
            raise socket.gaierror("unknown name")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, 0)) for ip in table[name]]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket, "gethostname", lambda: "node-b")
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: {"lo": [types.SimpleNamespace(address="127.0.0.1")],
                                                         "eth0": [types.SimpleNamespace(address="10.0.0.2")]})
    line = nodes.unreachable({"MASTER_ADDR": "10.0.0.1"})
    assert line.startswith("GLOO_SOCKET_IFNAME: this machine's name 'node-b' resolves to 127.0.1.1 (loopback), "
                           "where gloo would listen for the CPU collectives, and the master 10.0.0.1 is another "
                           "machine"), line
    assert nodes.unreachable({"MASTER_ADDR": "10.0.0.1", "GLOO_SOCKET_IFNAME": "eth0"}) is None
    assert nodes.unreachable({"MASTER_ADDR": "127.0.0.1"}) is None  # two launches on one machine (the tests)
    assert nodes.unreachable({"MASTER_ADDR": "10.0.0.2"}) is None  # this machine is the master
    assert nodes.unreachable({}) is None  # one node
    monkeypatch.setattr(socket, "gethostname", lambda: "node-x")  # no address: gloo falls back to loopback
    assert "resolves to no address" in nodes.unreachable({"MASTER_ADDR": "10.0.0.1"})
    monkeypatch.setattr(socket, "gethostname", lambda: "node-c")  # resolves to its network address
    assert nodes.unreachable({"MASTER_ADDR": "10.0.0.1"}) is None
    monkeypatch.setattr(socket, "gethostname", lambda: "node-b")  # through tba.py, before any collective
    for k, v in dict(GROUP_WORLD_SIZE="2", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", RANK="1", LOCAL_RANK="0",
                     MASTER_ADDR="10.0.0.1").items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    with pytest.raises(SystemExit) as e:
        tba.main(["--steps", "2"])
    assert e.value.code == 2 and capsys.readouterr().err.strip() == f"tba.py: error: {line}"
