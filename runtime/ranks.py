"""Several trainer ranks: the process group (one even for a single process, so one code path serves 1 and N ranks),
and the decisions all ranks take together: rank 0 decides and broadcasts (plain data and tensors, never pickled),
and its long waits answer the other ranks every slice (`wait_together`). `Watchdog` ends a stall in the collectives,
a rank that stopped answering, or a signal to a rank stuck in one, in one line (docs/faults.md)."""

import contextlib
import datetime
import json
import os
import select
import signal
import socket
import sys
import threading
import time

import numpy as np
import psutil
import torch
import torch.distributed as dist

from runtime import nodes
from runtime.checkpoint import last_checkpoint
from runtime.errors import Dead, Silent, Stop
from runtime.vllm_env import stop_fork_server


def fail(message: str, code: int, rank: int):
    """Exit with one line. Under torchrun, also leave it in the worker's error file, so that
    torchrun's failure report names it (torch/distributed/elastic/multiprocessing/errors/__init__.py,
    _format_failure: it shows the file's message.extraInfo.py_callstack)."""
    stop_fork_server()  # the searchers' fork server, maybe still importing vLLM: gone before the line, not after it
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
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: cpu or cuda")
    # joining waits at most --timeout: a rank that failed before it joined never comes
    dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=max(timeout, 1)))
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


def wait_together(rank: int, world: int, wait, done, what, log, slice_s: float, signals=None,
                  say_every: float = 30.0) -> float:
    """Rank 0 waits (`wait(seconds)`, returning seconds waited) until `done()`, in slices of `slice_s` s,
    saying every `say_every` s what for (`what()`); after each slice all ranks decide together whether to go
    on (rank 0 not done, no rank signalled): no collective waits longer than a slice. Returns seconds
    waited."""
    waited, said, finished = 0.0, 0.0, None
    while not finished:
        if rank == 0:
            waited += wait(slice_s)
            if not (finished := done()) and waited - said >= say_every - 1e-6:
                log.print(f"tba.py: waiting for {what()} ({waited:.0f} s so far)", file=sys.stderr)
                said = waited
        if world > 1:
            flags = torch.tensor([float(bool(finished)), float(bool(signals and signals.first))])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            finished = bool(flags.any())
    return waited


def share_signals(signals, world: int):
    """All ranks: a signal that came to any rank becomes rank 0's too (its stop reason, runtime.fleet.stop_reason), so
    that the run stops together, after a checkpoint, whichever rank torchrun or a user signalled."""
    if world == 1:
        return
    came = torch.tensor([float(signal.Signals[signals.first[0]].value) if signals.first else 0.0])
    dist.all_reduce(came, op=dist.ReduceOp.MAX)
    if came.item() and not signals.first:
        signals.first = (signal.Signals(int(came.item())).name, time.time())


def raise_stop(why, saved: bool | str, out: str):
    """Stop every rank for rank 0's reason (broadcast): a dead or silent searcher, or a signal. `saved`: whether a
    checkpoint was written, or the line of one that could not be (runtime.checkpoint.save_checkpoint)."""
    kind, what = why or ("signal", "a signal")
    if kind in ("dead", "silent"):
        raise (Dead if kind == "dead" else Silent)(f"{what}; {saved_where(saved, out)}")
    raise Stop(what, saved)


def saved_where(saved: bool | str, out: str) -> str:
    """What a stopped run left: its checkpoint, nothing yet, or why its checkpoint could not be written."""
    if isinstance(saved, str):
        return saved
    return f"checkpoint in {os.path.join(out, 'checkpoint')}" if saved else "before the first step: nothing to save"


GRACE = 5.0  # s a rank stuck in a collective may keep a signal waiting before it ends at once
TORCH = os.path.dirname(torch.__file__) + os.sep
DISTRIBUTED = os.path.join(TORCH, "distributed") + os.sep


def stall_bound(timeout: float) -> float:
    """The most every trainer rank may wait inside collectives that do not complete before the run ends: --timeout,
    at most 60 s (a single collective of a 7B model's largest tensor takes seconds; a rank's long work alone, such as
    writing a checkpoint, is outside any collective and does not count)."""
    return min(timeout, 60.0)


class Watchdog:
    """Each trainer rank's watch over its main thread, from a thread of its own: a thread still runs while the main
    one waits inside a collective, where no Python signal handler runs and no timeout of ours can act. It ends the
    rank, in one line (docs/faults.md: what each says and kills): on a stall (this rank inside a collective that has
    not completed for `bound` s, `where`, and so is every other rank, or it stopped answering: its beats, once a
    second into the process group's store, plain JSON, stopped), on a signal while inside a collective that has not
    moved for GRACE s, or a second signal, and once its launcher is gone (`signals.launcher`: it sends itself
    SIGTERM). On one rank only signals and the launcher are watched (no collective can stall there)."""

    def __init__(self, rank: int, world: int, bound: float, step, procs, out: str, signals=None, beat=lambda: None):
        """`step()`: the step under way, for the lines; `procs()`: this rank's searchers, killed when it ends;
        `beat()`: run each beat (runtime.fleet.Fleet.watching: the searchers' silence and exits)."""
        self.rank, self.world, self.bound, self.step, self.procs, self.out = rank, world, bound, step, procs, out
        self.signals, self.orphaned, self.beat = signals, False, beat
        self.main, self.closed, self.came = threading.main_thread().ident, False, []
        self.store = None
        if world > 1:  # a client of its own: the store's default client is the main thread's
            self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                       timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
            self.publish(0, None, 0.0)
        self.seen = {}  # rank -> (its last beat, when it changed)
        # torchrun's other ranks here (pid, start): one stopped (SIGSTOP) outlives the run a signal ends
        self.siblings = [(p.pid, p.create_time()) for p in psutil.Process(os.getppid()).children()
                         if p.pid != os.getpid()] if signals is not None and signals.launcher else []
        self.pipe = os.pipe()
        for fd in self.pipe:
            os.set_blocking(fd, False)
        self.old_fd = signal.set_wakeup_fd(self.pipe[1], warn_on_full_buffer=False)
        self.thread = threading.Thread(target=self.run, name="tba-watchdog", daemon=True)
        self.thread.start()

    def publish(self, beat: int, where, stuck: float):
        self.store.set(f"tba/watch/{self.rank}", json.dumps(dict(beat=beat, where=where, stuck=stuck, pid=os.getpid())))

    def where(self):
        """Where the main thread waits, if inside torch.distributed: the innermost torch.distributed function on
        its stack and our caller; else None. The stack is walked outward through torch's own frames (a collective
        may wait under others: DTensor's wait_tensor, whose innermost frame is torch/_ops.py) to the first frame
        outside torch (the model's code, ours), where the thread computes (docs/faults.md)."""
        frame = sys._current_frames().get(self.main)
        while frame is not None and frame.f_code.co_filename.startswith(TORCH) and \
                not frame.f_code.co_filename.startswith(DISTRIBUTED):
            frame = frame.f_back
        if frame is None or not frame.f_code.co_filename.startswith(DISTRIBUTED):
            return None
        here, root = frame, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        while here is not None and not (here.f_code.co_filename.startswith(root) and "site-packages" not in
                                        here.f_code.co_filename):
            here = here.f_back
        caller = (f", from {os.path.relpath(here.f_code.co_filename, root)}:{here.f_lineno} ({here.f_code.co_name})"
                  if here is not None else "")
        return f"{frame.f_code.co_name}{caller}"

    def sequence(self):
        """The collectives issued so far on every process group of this rank (the leaders' too: runtime/nodes.py)."""
        try:
            return sum(pg._get_sequence_number_for_group() for pg in list(dist.distributed_c10d._world.pg_map))
        except Exception:  # a backend without one: the frame alone
            return None

    def run(self):
        state = dict(beat=0, last=None, since=time.time())
        while not self.closed:
            try:
                self.watch(state)
            except Exception:  # the store gone with rank 0's node (the main thread's collective fails too), ...
                time.sleep(1.0)

    def watch(self, state: dict):
        """One beat: a signal that came, the launcher, where the main thread waits and since when, the others' beats."""
        if select.select([self.pipe[0]], [], [], 1.0)[0]:
            try:
                self.came += [(b, time.time()) for b in os.read(self.pipe[0], 64)]
            except OSError:
                pass
        self.beat()
        for pid, began in self.siblings if self.came else ():  # the run ends: a stopped rank never sees it
            with contextlib.suppress(Exception):
                sibling = psutil.Process(pid)
                if sibling.create_time() == began and sibling.status() == psutil.STATUS_STOPPED:
                    sibling.kill()  # (torchrun, waiting for it, would kill it 30 s later; gone, never)
        if not self.orphaned and self.signals is not None and self.signals.orphaned():  # torchrun gone, its store too
            self.orphaned = True
            if not self.came:  # else a signal came first (torchrun's own, before it died): the rank stops for that
                os.kill(os.getpid(), signal.SIGTERM)
        now, where = time.time(), self.where()
        if (self.sequence(), where) != state["last"] or where is None:  # a collective issued, or none waited in
            state.update(last=(self.sequence(), where), since=now)
        stuck = now - state["since"] if where else 0.0
        if self.came:
            signum, first = self.came[0]
            if (len(self.came) > 1 and self.came[-1][1] - first > 1) or (where and min(stuck, now - first) >= GRACE):
                name = signal.Signals(signum).name
                name = self.signals.named(name) if self.signals is not None else name
                self.end(128 + signum, f"tba.py: {'' if self.rank == 0 else f'(rank {self.rank}) '}stopped by "
                         f"{name} while this rank waited in a collective ({where}); no checkpoint: the last is "
                         f"{last_checkpoint(self.out)}", say=True)
        if self.store is None:
            return
        state["beat"] += 1
        if self.store.check(["tba/watch/verdict"]):  # another rank found the run stalled: end with it; rank 0
            said = self.rank == 0 and self.store.get(f"tba/watch/line/{int(self.store.get('tba/watch/verdict'))}")
            self.end(1, said.decode() if said else "", say=bool(said), mark=True)  # rank 0 says its line (the
        self.publish(state["beat"], where, stuck)
        if stuck >= self.bound / 2:  # the others' beats watched from here on
            self.check_others(now, stuck)
        else:
            self.seen = {}

    def check_others(self, now: float, stuck: float):
        """This rank has waited in a collective: once `bound` s, end the run if every rank has too, or stopped
        answering (no new beat for bound / 2 s)."""
        waits, quiet, pids, working = {}, [], {}, False
        for r in range(self.world):
            if r == self.rank:
                continue
            key = f"tba/watch/{r}"
            if not self.store.check([key]):
                quiet.append(r)
                continue
            state = json.loads(self.store.get(key))
            beat, changed = self.seen.get(r, (None, now))
            if state["beat"] != beat:
                self.seen[r] = (state["beat"], now)
            elif now - changed >= self.bound / 2:
                quiet.append(r)
                pids[r] = state["pid"]
                continue
            working = working or state["stuck"] < self.bound  # it works, or has not waited as long: it may yet join
            waits[r] = state["where"]
        if working or stuck < self.bound:
            return
        waits[self.rank] = self.where()
        parts = [f"rank {r} in {waits[r]}" for r in sorted(waits)] + [f"rank {r} stopped answering (no beat for "
                                                                       f"{self.bound / 2:.0f} s)" for r in quiet]
        line = (f"tba.py: error: step {self.step()}: the trainer ranks have waited {self.bound:.0f} s in "
                f"collectives that do not complete: {'; '.join(parts)}; no checkpoint can be written now (it is "
                f"collective): the last is {last_checkpoint(self.out)}")
        self.store.set(f"tba/watch/line/{self.rank}", line)  # for rank 0 to say, if this rank decides
        if self.store.compare_set("tba/watch/verdict", "", str(self.rank)) != str(self.rank).encode():
            return  # another rank decided first: this one ends at its next beat, when it sees that
        self.end(1, line, say=self.rank == 0 or 0 in quiet,  # else rank 0 says it, at its next beat
                 others=[r for r in range(self.world) if r != self.rank and r not in quiet], stopped=pids.values(),
                 began=now - stuck)

    def end(self, code: int, line: str, say: bool, others=(), mark: bool = False, stopped=(), began=None):
        """End this rank now: its searchers killed, the line said (`say`: one rank says it), status `code`, whatever
        fails. `others`: ranks this one waits for (5 s at most) to end first (a rank gone first would fail their
        collectives with tracebacks of their own); `mark`: this rank is such another, and says it ends as its last
        act; `stopped`: pids of ranks that stopped answering, killed if this rank's siblings (stopped, they would
        outlive the run); `began`: when the fault began, for torchrun's error file (its report names the earliest)."""
        try:
            for p in self.procs():
                try:
                    p.kill()
                except Exception:
                    pass
            stop_fork_server()
            if say:
                print(line, file=sys.stderr, flush=True)
                error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
                if error_file:
                    with open(error_file, "w") as f:
                        json.dump({"message": {"message": line, "extraInfo": {
                            "py_callstack": line, "timestamp": str(int(began or time.time()))}}}, f)
            for pid in stopped:
                with contextlib.suppress(Exception):
                    if psutil.Process(pid).ppid() == os.getppid():
                        os.kill(pid, signal.SIGKILL)
            # whichever rank goes first, the others' collectives fail ("Connection closed by peer") in their main
            # threads, which would print that traceback after the line: from here on this rank's output goes nowhere
            quiet = os.open(os.devnull, os.O_WRONLY)
            os.dup2(quiet, 1)
            os.dup2(quiet, 2)
            deadline = time.time() + 5
            while others and time.time() < deadline and not self.store.check([f"tba/watch/ended/{r}" for r in others]):
                time.sleep(0.1)
        finally:
            if mark:
                with contextlib.suppress(Exception):
                    self.store.set(f"tba/watch/ended/{self.rank}", "1")
            os._exit(code)

    def close(self):
        self.closed = True
        try:
            signal.set_wakeup_fd(self.old_fd)
        except ValueError:  # not the main thread
            pass
