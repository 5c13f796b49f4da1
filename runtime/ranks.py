"""Several trainer ranks: the process group, and the decisions all ranks take together.

- One process group even for a single process (`init_distributed`), so one code path serves 1 and N
  ranks; its backend follows the run's device (gloo on the CPU, NCCL beside gloo on GPUs).
- Any decision that leads to a collective is taken by all ranks together: rank 0 decides and
  broadcasts it (`broadcast`, `broadcast_batch`: plain data and tensors, never pickled), and its long
  waits answer the other ranks every slice (`wait_together`), so that no rank sits in a collective while
  rank 0 checkpoints alone. A refusal of the configuration on any rank stops all (`first_refusal`).
- `fail`: the one line a run ends with, and its exit status, also in torchrun's error file.
"""

import datetime
import json
import os
import socket
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from runtime import nodes
from runtime.errors import Dead, Silent, Stop


def fail(message: str, code: int, rank: int):
    """Exit with one line. Under torchrun, also leave it in the worker's error file, so that
    torchrun's failure report names it (torch/distributed/elastic/multiprocessing/errors/__init__.py,
    _format_failure: it shows the file's message.extraInfo.py_callstack)."""
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with open(error_file, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                                     "timestamp": str(int(time.time()))}}}, f)
    sys.exit(code)


def machine_device() -> str:
    """The run's device kind on this machine (runtime.checks fills cfg.device with it): cuda where GPUs exist."""
    return "cuda" if torch.cuda.device_count() else "cpu"


def backend_for(device: str) -> str:
    """The default group's backend for a run on `device`: NCCL only where the model's tensors are CUDA ones
    (FSDP2's all-gathers and reduce-scatters of them), gloo for CPU tensors either way."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: cpu or cuda")
    return "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"


def init_distributed(timeout: float, device: str) -> tuple[int, int, int]:
    """The process group (rank, world size, local rank). Its backend follows `device`, the run's ("cpu" or
    "cuda", never guessed here): gloo for a CPU run, even where CUDA exists, and NCCL for CUDA tensors beside
    gloo for CPU ones on GPUs. Called again (run() after main() under torchrun), it returns the group's ranks."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])
    if "RANK" not in os.environ:  # plain `python tba.py`: a group of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(s.getsockname()[1]))
    backend = backend_for(device)
    # joining waits at most --timeout: a rank that failed before it joined never comes
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=max(timeout, 1)))
    # every later collective (torch/distributed/distributed_c10d.py:1616): see nodes.allowance
    dist.distributed_c10d._set_pg_timeout(nodes.allowance(timeout))
    return dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])


def first_refusal(message: str | None) -> str | None:
    """All ranks: the configuration error of the first rank that refused one (None if none did), so
    that all stop together (ranks on other nodes may see other files). Sent as bytes, never pickled."""
    data = torch.zeros(1024, dtype=torch.uint8)
    if message:
        raw = message.encode()[:1024]
        data[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    gathered = [torch.zeros_like(data) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, data)
    for r, g in enumerate(gathered):
        if g.any():
            text = bytes(g.numpy()).rstrip(b"\0").decode(errors="ignore")
            return text if r == dist.get_rank() or r == 0 else f"(rank {r}) {text}"
    return None


def broadcast(obj, rank: int):
    """Rank 0's `obj` on every rank: plain data (None, bools, numbers, strings, lists), sent as JSON
    bytes in a tensor, never pickled (other ranks may be other machines)."""
    if dist.get_world_size() == 1:
        return obj
    return json.loads(broadcast_bytes(json.dumps(obj).encode() if rank == 0 else b"", rank))


def broadcast_batch(batch, rank: int):
    """Rank 0's batch (groups of trajectories, or None) on every rank, in nodes.encode's bytes."""
    if dist.get_world_size() == 1:
        return batch
    sizes = broadcast(None if batch is None else [len(g) for g in batch], rank)
    if sizes is None:
        return None
    data = nodes.encode([t for g in batch for t in g]).numpy().tobytes() if rank == 0 else b""
    flat, _ = nodes.decode(torch.frombuffer(bytearray(broadcast_bytes(data, rank)), dtype=torch.uint8))
    if rank == 0:
        return batch
    ends = np.cumsum(sizes).tolist()
    return [flat[end - n:end] for n, end in zip(sizes, ends)]


def broadcast_bytes(data: bytes, rank: int) -> bytes:
    """Rank 0's bytes (not empty) on every rank: their length, then them."""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=0)
    payload = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if rank == 0
               else torch.empty(int(size.item()), dtype=torch.uint8))
    dist.broadcast(payload, src=0)
    return payload.numpy().tobytes()


def wait_together(rank: int, world: int, wait, done, what, log, slice_s: float) -> float:
    """Rank 0 waits (`wait(seconds)`, returning seconds waited) until `done()`, in slices of `slice_s`
    seconds, saying after each what it still waits for (`what()`); after each slice it tells the
    other ranks, which wait in a broadcast, whether to go on. So no collective waits longer than a
    slice however long rank 0 waits, and every rank leaves the wait together. Returns seconds waited."""
    waited = 0.0
    while True:
        finished = None
        if rank == 0:
            waited += wait(slice_s)
            finished = done()
            if not finished:
                log.print(f"tba.py: waiting for {what()} ({waited:.0f} s so far)", file=sys.stderr)
        if (finished if world == 1 else broadcast(finished, rank)):
            return waited


def raise_stop(why, saved: bool, out: str):
    """Stop every rank for rank 0's reason (broadcast): a dead or silent searcher, or a signal."""
    kind, what = why or ("signal", "a signal")
    where = f"checkpoint in {os.path.join(out, 'checkpoint')}" if saved else "before the first step: nothing to save"
    if kind in ("dead", "silent"):
        raise (Dead if kind == "dead" else Silent)(f"{what}; {where}")
    raise Stop(what, saved)
