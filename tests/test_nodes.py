"""Several nodes, simulated on one machine: two torchrun launches (static rendezvous, gloo) that each
believe they are a node, with one trainer process and one searcher each. Also the wire format of
the trajectories between nodes, and the cast before FSDP2's all-gather."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import torch

import nodes
from buffer import Trajectory
from conftest import ROOT, env, free_port, metrics
from test_faults import assert_all_gone, searcher_pids, wait_for_steps

SMALL = ["--prompts-per-step", "8", "--samples-per-prompt", "4", "--max-new-tokens", "6"]


def launch(node: int, port: int, args, tmp):
    """One 'node': torchrun with a static rendezvous on 127.0.0.1:port, in its own session."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
           "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
           os.path.join(ROOT, "tba.py"), *args]
    return subprocess.Popen(cmd, cwd=tmp, env=env(tmp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


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


def test_two_nodes_learn_with_node_1s_trajectories(tiny_model, tmp_path):
    """Both launches complete; rank 0 trains on node 1's trajectories, which come from weights that
    node 1's leader received (versions past 0), and held-out accuracy rises."""
    out, port = tmp_path / "run", free_port()
    # B = 32 x K = 8 and lr 5e-5 (the defaults): this model learns there (0.27 -> 0.31 in 30 steps, at
    # B = 8 x K = 4 it did not; at lr 1e-3 it collapsed)
    args = ["--model", tiny_model, "--max-new-tokens", "6", "--steps", "40", "--eval-every", "0", "--out", str(out)]
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
    assert evals[0]["version"] == 0 and evals[-1]["version"] == 40
    assert evals[-1]["accuracy"] > evals[0]["accuracy"], [e["accuracy"] for e in evals]
    assert "done: 40 steps" in outputs[0]


@pytest.mark.parametrize("lost", ["node 1", "node 0", "node 1's searcher"])
def test_a_lost_node_stops_every_node(lost, tiny_model, tmp_path):
    """kill -9 of a whole 'node' (launcher, trainer, searcher) or of one searcher on node 1, mid-run:
    the other node stops within --timeout with a non-zero status and a line saying what was lost,
    and no process is left on either."""
    out, port, timeout = tmp_path / "run", free_port(), 60
    args = ["--model", tiny_model, *SMALL, "--steps", "100000", "--eval-every", "0", "--timeout", str(timeout),
            "--out", str(out)]
    node1 = launch(1, port, args, tmp_path)
    node0 = launch(0, port, args, tmp_path)
    launches = {"node 0": node0, "node 1": node1}
    try:
        wait_for_steps(node0, out, 3)
        deadline = time.time() + 120  # node 1's searcher has sent data: the run is in full flow
        while max(r.get("samples_per_node", [0, 0])[1] for r in metrics(out)) == 0:
            assert time.time() < deadline and node0.poll() is None and node1.poll() is None, "no data from node 1"
            time.sleep(0.5)
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


# --- the wire format and the cast: no launches -----------------------------------------------------
def test_trajectories_cross_nodes_as_plain_data():
    ts = [Trajectory(3, np.array([5, 1, 70000], dtype=np.int32), 0.5, -1.25, -2.0000001, 4, 2),
          Trajectory(7, np.zeros(0, dtype=np.int32), 1.0, -0.1, float("nan"), 6, 0)]
    payload = nodes.encode(ts)
    assert payload.dtype == torch.uint8
    back, error = nodes.decode(payload)
    assert error is None and len(back) == 2
    for a, b in zip(ts, back):
        for f in nodes.FIELDS:
            assert getattr(a, f) == getattr(b, f) or np.isnan(getattr(a, f)) and np.isnan(getattr(b, f))
        assert b.response.dtype == np.int32 and np.array_equal(a.response, b.response)
    assert nodes.decode(nodes.encode([], error="searcher 1 died")) == ([], "searcher 1 died")
    for bad in (payload[:-4], payload[:20], torch.zeros(3, dtype=torch.uint8),
                nodes.encode([]).clone().fill_(7)):
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


def test_lost_connections_are_told_apart_from_bugs():
    gone = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
                        "peer [127.0.0.1]:60095. This is typically caused by a remote worker crashing.")
    assert nodes.lost(gone) == ("lost contact with another node of the run (Connection closed by peer "
                                "[127.0.0.1]:60095); stopping")
    assert nodes.lost(RuntimeError("CUDA out of memory")) is None
    assert nodes.lost(ValueError("Connection closed by peer")) is None


def cast_worker(rank, port, results):
    """FSDP2 over two gloo ranks: the full weights gathered in bf16 equal those gathered in float32
    and rounded afterwards, bit for bit."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from weights import gather
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


def test_gathering_in_bf16_gives_the_same_weights():
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    torch.multiprocessing.start_processes(cast_worker, args=(free_port(), results), nprocs=2, start_method="spawn")
    checked = results.get(timeout=10)
    assert len(checked) == 4 and all(same and shape for same, shape in checked.values()), checked
