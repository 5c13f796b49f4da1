"""The trainer's side of the process layout, apart from the algorithm: the process group, the
searchers' start and stop, the waits and the faults.

- Every wait polls, has a timeout and checks that the other side lives: `drain` takes the searchers'
  messages (a dead searcher raises Dead, none for --timeout raises TimeoutError); `Watch` notices a
  searcher that lives but has gone silent (a warning, then Silent, which stops the run after a
  checkpoint).
- Any decision that leads to a collective is taken by all ranks together: rank 0 decides and
  broadcasts it (`broadcast`, `broadcast_batch`: plain data and tensors, never pickled), and its long waits
  answer the other ranks every slice (`wait_together`), so that no rank sits in a collective while
  rank 0 checkpoints alone. A refusal of the configuration on any rank stops all (`first_refusal`).
- Signals (`Signals`): a checkpoint, then a stop with one line (`fail`), on every rank at once.
- GPU settings a spawned process would fail on (too few GPUs, bf16 on an old one, EXCLUSIVE_PROCESS mode,
  a searcher's models that do not fit its GPU) are refused before any process starts (`check_gpus`,
  `check_memory`, called by config.check).
"""

import json
import math
import os
import signal
import socket
import sys
import time
from queue import Empty
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from runtime import nodes
import searcher
from runtime.errors import ConfigError, Silent, Stop


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


def init_distributed(cfg):
    """One process group even for a single process, so one code path serves 1 and N ranks. Called
    again (run() after main() under torchrun), it returns the group's ranks."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])
    if "RANK" not in os.environ:  # plain `python tba.py`: a group of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(s.getsockname()[1]))
    import datetime
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    # joining waits at most --timeout: a rank that failed before it joined never comes
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=max(cfg.timeout, 1)))
    # every later collective (torch/distributed/distributed_c10d.py:1616): see nodes.allowance
    dist.distributed_c10d._set_pg_timeout(nodes.allowance(cfg.timeout))
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


class Signals:
    """SIGINT and SIGTERM: before the first step one stops the run at once (nothing to save, Stop);
    after it, the first asks the trainer to stop after a checkpoint (`first`), and a second one
    stops it at once (KeyboardInterrupt). Under torchrun, Ctrl-C's SIGINT reaches the trainer twice
    at once (the terminal's and torchrun's): a second signal counts only after 1 s."""

    def __init__(self):
        self.first = None      # (name, time) of the first signal once training began
        self.training = False  # set by the loop after its first step
        signal.signal(signal.SIGINT, self.on_signal)
        signal.signal(signal.SIGTERM, self.on_signal)

    def on_signal(self, signum, frame):
        name = signal.Signals(signum).name
        if not self.training:
            raise Stop(name, False)
        if self.first and time.time() - self.first[1] > 1:
            raise KeyboardInterrupt
        self.first = self.first or (name, time.time())


class Channels(NamedTuple):
    """Between a node's leader and its searchers (start_searchers)."""
    queue: object        # mp.Queue: the searchers' messages (trajectories, evaluations, beats) to the trainer
    stop: object         # mp.Event: set to stop the searchers
    evals: object        # mp.Queue: evaluation requests (a step) to searcher 0 of node 0
    calibration: tuple   # (started engines, lock): --generation-slowdown's calibration


def start_searchers(ctx, cfg, rank: int, local_world: int, shared, data):
    """Spawn this node's `--searchers` processes (searcher.run) before the trainer loads its model, so
    that their vLLM engines start meanwhile. Searcher i of this node runs on GPU (trainer ranks + i);
    node n's are numbered from n x searchers (their seeds differ). Node 0's first also evaluates (rank 0
    asks it); the others get no evaluation channel, so they build no evaluation models (a TL;DR policy
    copy: 5.5 GB at 2.8B, reloaded at every sync).
    Returns (processes, Channels)."""
    # --generation-slowdown's calibration: engines started, and one calibrates at a time (kept alive with
    # the channels: a semaphore collected before a child unpickles it is gone)
    calibration = (ctx.Value("i", 0), ctx.Lock())
    channels = Channels(ctx.Queue(maxsize=4 * cfg.searchers), ctx.Event(), ctx.Queue(), calibration)
    queue, stop, evals, _ = channels
    first, procs = rank // local_world * cfg.searchers, []
    start = fork_server() if cfg.device == "cpu" else ctx
    for i in range(cfg.searchers):
        dev = f"cuda:{local_world + i}" if cfg.device == "cuda" else "cpu"
        p = start.Process(target=searcher.run, name=f"searcher-{first + i}", daemon=True,
                          args=(first + i, dict(vars(cfg)), shared, queue, stop, evals if i == 0 and rank == 0 else None,
                                data, dev, calibration))
        p.start()
        procs.append(p)
    return procs, channels


def fork_server():
    """On the CPU, searchers start from a fork server that has imported vLLM once (about 5 s of one core
    each, which N searchers spawned afresh would spend side by side on the cores they share: 4 on 2
    cores started 10 s later). On a GPU node each searcher imports on cores of its own, and spawn keeps
    every process free of anything a parent could have set up for CUDA. The server imports searcher.py
    first (its top calls vllm_env.set_up), so it must find this folder: Python 3.11's fork server does not
    take the trainer's sys.path (multiprocessing/forkserver.py, main), so PYTHONPATH is given it for its start."""
    from multiprocessing import forkserver
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["searcher", "transformers", "vllm", "vllm.entrypoints.llm"])
    before = os.environ.get("PYTHONPATH")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root, above runtime/
    os.environ["PYTHONPATH"] = os.pathsep.join([root] + ([before] if before else []))
    os.environ[searcher.FORK_SERVER] = "1"  # searcher.py, imported there first, then ignores SIGTERM: see there
    try:
        forkserver.ensure_running()
    finally:
        del os.environ[searcher.FORK_SERVER]
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return ctx


def drain(queue, buffer, log, alive, done, timeout: float, watch=None, budget: float = math.inf) -> float:
    """Move every waiting message into the buffer (trajectories) or the log (evaluations; searcher 0's
    beats while it evaluates only count as signs of life); then, while not done(), wait for more,
    polling, checking the searchers (`watch`: silent ones too) and a timeout, for at most `budget`
    seconds. Returns seconds waited."""
    waited, deadline = 0.0, time.time() + timeout  # the deadline moves on with every message
    end = time.time() + budget
    while True:
        block = not done() and time.time() < end
        t0 = time.time()
        try:
            msg = queue.get(timeout=searcher.WAIT) if block else queue.get_nowait()
        except Empty:
            alive()
            if watch is not None:
                watch.check()
            if not block:
                return waited
            waited += time.time() - t0
            if time.time() > deadline:
                raise TimeoutError(f"no message from the searchers in {timeout:.0f} s (see --timeout)")
            continue
        if block:
            waited += time.time() - t0
        deadline = time.time() + timeout
        if watch is not None:
            watch.heard(msg)
        if msg["kind"] == "eval":
            log.eval(msg["version"], msg["scores"], msg["example"], msg["seconds"], log.published[msg["version"]])
        elif msg["kind"] == "search":
            buffer.add(msg["trajectories"])
            log.samples += len(msg["trajectories"])
            log.searched(msg)


class Watch:
    """Each node's leader (rank 0 on one node) watches its searchers' messages. A searcher stuck in
    vLLM, on a wedged GPU or a stalled file system still lives, and the trainer, which never waits once
    the buffer has data, would train on frozen data without a word. So: a warning (`say`) once a
    searcher has sent nothing for well over its usual time between two messages (a round), and Silent
    once --timeout passes with nothing from it (start-up counts: vLLM's load and compile). Searcher 0
    beats after each part of an evaluation, so a long one is not silence; while one is asked for
    (`evaluating`, until its result comes) a part longer than a round is no cause for a warning. `newest`: the
    newest weight version that sampled data the trainer received (for --max-staleness). On several
    nodes a leader's searchers are numbered from `first` in their messages, and its lines begin with
    `where` ("node 1: ")."""
    WARN_FACTOR, WARN_MIN = 5.0, 10.0  # warn after 5 x its longest gap so far, 10 s at least

    def __init__(self, procs, timeout: float, say, newest: int, first: int = 0, where: str = ""):
        self.procs, self.timeout, self.say, self.newest = procs, timeout, say, newest
        self.first, self.where = first, where
        self.evaluating = False  # an evaluation asked of searcher 0 has not come yet
        self.last = [time.time()] * len(procs)  # when each was last heard from (or spawned)
        self.gap = [None] * len(procs)          # its longest time between two messages (None: one or none yet)
        self.heard_once = [False] * len(procs)
        self.warned = [False] * len(procs)

    def heard(self, msg):
        i, now = msg.get("searcher", self.first) - self.first, time.time()
        if self.heard_once[i] and not (i == 0 and self.evaluating):  # a round's gap, not an evaluation's
            self.gap[i] = max(self.gap[i] or 0.0, now - self.last[i])
        if self.warned[i]:
            self.say(f"tba.py: {self.where}searcher {i} sends again, after {now - self.last[i]:.0f} s")
        self.last[i], self.heard_once[i], self.warned[i] = now, True, False
        if msg["kind"] == "search":
            self.newest = max(self.newest, msg["version"])
        elif msg["kind"] == "eval":
            self.evaluating = False

    def check(self):
        now = time.time()
        for i, p in enumerate(self.procs):
            quiet = now - self.last[i]
            if quiet > self.timeout:
                raise Silent(f"{self.where}searcher {i} (pid {p.pid}) has sent nothing for {quiet:.0f} s "
                             f"(--timeout {self.timeout:g})")
            usual = self.gap[i]
            if usual is not None and not self.warned[i] and not (i == 0 and self.evaluating) and quiet > min(
                    max(self.WARN_FACTOR * usual, self.WARN_MIN), self.timeout / 2):
                self.warned[i] = True
                self.say(f"tba.py: warning: {self.where}searcher {i} (pid {p.pid}) has sent nothing for {quiet:.0f} s "
                         f"(usually every {usual:.1f} s at most); the run stops if it stays silent "
                         f"{self.timeout:g} s (--timeout)")


def newest(buffer) -> int:
    """The newest weight version among the buffer's data (a resumed buffer), or -1 if empty."""
    return max((t.version for group in buffer.groups.values() for t, _ in group.values()), default=-1)


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
    """Stop every rank for rank 0's reason (broadcast): a silent searcher or a signal."""
    kind, what = why or ("signal", "a signal")
    where = f"checkpoint in {os.path.join(out, 'checkpoint')}" if saved else "before the first step: nothing to save"
    if kind == "silent":
        raise Silent(f"{what}; {where}")
    raise Stop(what, saved)


def stop_searchers(procs, queue, stop, handoff):
    """Stop the searchers: ask (they finish their round), then kill; nothing is left behind."""
    stop.set()
    deadline = time.time() + 5
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.time()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    queue.cancel_join_thread()
    handoff.cancel_join_thread()


# --- GPU settings a spawned process would fail on, refused by config.check before any starts -----------
def check_gpus(cfg, local: int):
    """GPU settings that would fail inside a spawned process: refuse them here, in one line. `local`: the
    trainer ranks on this node (torchrun's LOCAL_WORLD_SIZE), which with this node's searchers use this
    node's GPUs; on several nodes every node checks its own."""
    gpus = torch.cuda.device_count()
    used = range(local + cfg.searchers)
    if len(used) > gpus:
        raise ConfigError(f"--searchers: {cfg.searchers} searcher(s) + {local} trainer rank(s) on this node need "
                          f"{len(used)} GPUs on it, {gpus} visible")
    # vLLM refuses bf16 below compute capability 8.0 (vllm/platforms/cuda.py:636-654, checking GPU 0
    # only); torch.cuda.is_bf16_supported() says True there (emulation) and checks one device
    oldest = min((torch.cuda.get_device_capability(i), i) for i in used)
    if cfg.dtype == "auto":
        cfg.dtype = "bfloat16" if oldest[0] >= (8, 0) else "float16"
    if cfg.dtype == "bfloat16" and oldest[0] < (8, 0):
        raise ConfigError(f"--dtype: bfloat16 needs compute capability 8.0 or newer; GPU {oldest[1]} has "
                          f"{'.'.join(map(str, oldest[0]))} (use --dtype float16)")
    if cfg.searchers and compute_mode(0) == 3:  # NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
        raise ConfigError("--searchers: GPU 0 is in EXCLUSIVE_PROCESS compute mode, but the searchers open the "
                          "shared weights there beside the trainer; set it to DEFAULT (nvidia-smi -i 0 -c DEFAULT)")


def compute_mode(index: int) -> int | None:
    """NVML compute mode of CUDA device `index` (as torch numbers it), or None without NVML. vLLM ships
    nvidia-ml-py as vllm.third_party.pynvml (vllm/utils/import_utils.py:24-52); NVML numbers GPUs
    physically, so the device is found by its UUID."""
    try:
        import pynvml
    except ImportError:
        from vllm.third_party import pynvml
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        uuid = uuid if uuid.startswith(("GPU-", "MIG-")) else "GPU-" + uuid
        return pynvml.nvmlDeviceGetComputeMode(pynvml.nvmlDeviceGetHandleByUUID(uuid))
    except pynvml.NVMLError:  # a MIG device or a UUID NVML does not know: the mode is unknown, as without NVML
        return None
    finally:
        pynvml.nvmlShutdown()


def check_memory(cfg, local: int):
    """GPUs: the vLLM engines of a searcher (of the trainer, with --searchers 0) and the models it loads beside
    them fit the smallest of this node's searcher GPUs, split as the searchers will split it (searcher.
    memory_split), or a refusal in one line naming what does not fit; --searcher-memory's default computed."""
    flag = "searcher-memory" if cfg.searchers else "trainer-memory"
    gpus = range(local, local + cfg.searchers) if cfg.searchers else range(local)
    card = min(torch.cuda.get_device_properties(i).total_memory for i in gpus)
    engines, beside = searcher.memory_needs(cfg)  # searcher 0's, which evaluates: the most
    share = getattr(cfg, flag.replace("-", "_"))
    share = searcher.memory_share(card, beside) if share is None else share
    try:
        searcher.memory_split(card, share, engines, beside)
    except ValueError as e:
        raise ConfigError(f"--{flag}: {e}") from None
    setattr(cfg, flag.replace("-", "_"), share)
