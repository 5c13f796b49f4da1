"""The processes of a run around the trainer: signals, the channels to a searcher, the CPU's fork server,
and the watch on a searcher's silence. The fleets (runtime/fleet.py, runtime/local.py) use them; none of
them knows what a searcher computes.

- `Signals`: SIGINT and SIGTERM, before and after the first step (a checkpoint first, once training began).
- `Channels`: the queues and events between a node's leader and one searcher.
- the searchers' messages, both ends: `send` and `last_word` (a searcher's), `Messages` (the trainer's reading).
- `fork_server`: on the CPU, searchers start from a server that has imported vLLM once.
- `Watch`: a searcher that lives but has gone silent draws a warning, then `Silent`; it returns its lines,
  and the caller prints them (rank 0) or sends them to rank 0 (another node's leader).
"""

import collections
import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time
from queue import Empty, Full, Queue
from typing import NamedTuple

import torch

from runtime import vllm_env
from runtime.errors import STOPS, Dead, Silent, Stop
from runtime.weights import WAIT


class Signals:
    """SIGINT, SIGTERM, SIGHUP, SIGUSR1 (errors.STOPS): before the first step one stops the run at once;
    after it, the first asks the trainer to stop after a checkpoint (`first`), and a second one
    stops it at once (KeyboardInterrupt). Under torchrun, Ctrl-C's SIGINT reaches the trainer twice
    at once (the terminal's and torchrun's): a second signal counts only after 1 s. One that comes while
    a searcher starts acts once it has started (`deferred`). `launcher`: torchrun's pid; once it is gone, the ranks
    send themselves SIGTERM (runtime.ranks.Watchdog), and the stop's line says why (`named`)."""

    def __init__(self, launcher: int | None = None):
        self.first = None      # (name, time) of the first signal once training began
        self.training = False  # set by the loop after its first step
        self.holding = None    # signals that came while `deferred`, acted on at its end
        self.launcher = launcher
        for sig in STOPS:
            signal.signal(sig, self.on_signal)

    def orphaned(self) -> bool:
        """This process's launcher is gone (it was reparented)."""
        return bool(self.launcher) and os.getppid() != self.launcher

    def named(self, name: str) -> str:
        """A signal's name in the lines, read when they are said (any rank's signal may be rank 0's stop): SIGTERM, or
        SIGTERM (its launcher torchrun, pid 12, is gone)."""
        return name + (f" (its launcher torchrun, pid {self.launcher}, is gone)"
                       if name == "SIGTERM" and self.orphaned() else "")

    @contextlib.contextmanager
    def deferred(self):
        """A signal inside this acts at its end: a searcher's start cut short (Stop raised while the trainer writes
        the pickled process to it) would leave the searcher a truncated pickle, and its traceback."""
        self.holding = []
        try:
            yield
        finally:
            came, self.holding = self.holding, None
        if came:
            self.on_signal(came[0], None)

    def on_signal(self, signum, frame):
        name = signal.Signals(signum).name
        if self.holding is not None:
            self.holding.append(signum)
            return
        if not self.training:  # (kept in `first` too: a Stop raised inside a finalizer, a __del__ that the GC runs,
            self.first = self.first or (name, time.time())  # is swallowed; the next collect then stops the run)
            raise Stop(self.named(name), False)
        if self.first and time.time() - self.first[1] > 1:
            raise KeyboardInterrupt
        self.first = self.first or (name, time.time())


class Channels(NamedTuple):
    """Between a node's leader and one of its searchers (spawn)."""
    queue: object        # mp.Queue: the searchers' messages (trajectories, evaluations, beats) to the trainer
    stop: object         # mp.Event: set to stop the searchers
    evals: object        # mp.Queue: evaluation requests (a step) to searcher 0 of node 0; None for the others
    calibration: tuple   # (started engines, lock): --generation-slowdown's calibration
    asked: object = None   # mp.Value: the latest step whose evaluation was asked, set before the request is sent
    pinned: object = None  # mp.Value: the step whose weights searcher 0 holds for its evaluation (-1: none)


# --- the searchers' messages: both ends ------------------------------------------------------------
SAID = 5  # the exit status of a searcher that said its fault to the trainer first (`last_word`)


def parent_alive():
    """In a searcher: Dead once the trainer (its parent process) is gone."""
    parent = mp.parent_process()
    if parent is not None and not parent.is_alive():
        raise Dead("the trainer (parent process) is gone")


def send(queue, message, stop, alive=parent_alive):
    """A searcher's message (a round's trajectories, an evaluation, a beat, a fault) on the bounded queue, waiting
    while it is full, but never once `stop` is set, nor on a dead trainer (`alive()`)."""
    while not stop.is_set():
        try:
            return queue.put(message, timeout=WAIT)
        except Full:
            alive()


def last_word(channels, message):
    """A fault's message to the trainer, flushed to the pipe before this process exits (the queue's feeder thread
    would otherwise be cut off with it), so that the trainer reads it before it sees the exit."""
    send(channels.queue, message, channels.stop)
    channels.queue.close()
    channels.queue.join_thread()


class Messages:
    """The searchers' queue as the trainer reads it: a thread of its own takes each message off the queue into a
    local one, where the trainer's waits poll (`get`, `get_nowait`), so that a message a stopped searcher left
    half-written (docs/nodes.md) blocks this thread, never the trainer. A searcher's fault line is also kept as it
    is read (`fault`), for the trainer that sees the searcher's exit before the message."""

    def __init__(self, queue, size: int):
        # the local queue is as long as the searchers' own, whose bound (`send` waits) stays theirs
        self.queue, self.local, self.closed = queue, Queue(maxsize=max(1, size)), threading.Event()
        self.faults = {}  # searcher -> its fault line (`last_word`)
        self.stamps = collections.deque()  # (`clock()` when read, message): the watch's, off the trainer's thread
        self.held = (0.0, None)  # (s the local queue was full, since when it is full now): `clock`
        self.thread = threading.Thread(target=self.read, name="tba-messages", daemon=True)
        self.thread.start()

    def read(self):
        msg = None
        while not (self.closed.is_set() or isinstance(msg, Exception)):
            try:
                msg = self.queue.get(timeout=WAIT)
            except Empty:
                continue
            except Exception as e:  # a message that does not unpickle, a closed queue: raised where the trainer reads
                msg = e
            self.stamps.append((self.clock(), msg))
            if isinstance(msg, dict) and msg.get("kind") == "fault":
                self.faults[msg["searcher"]] = msg["line"]
            if self.local.full():  # the trainer reads nothing (a step, a collective): searchers wait to send
                self.held = (self.held[0], time.time())
            send(self.local, msg, self.closed, alive=lambda: None)  # (the trainer's own thread: it lives)
            if self.held[1] is not None:
                self.held = (self.held[0] + time.time() - self.held[1], None)

    def clock(self) -> float:
        """The time less the seconds the trainer read nothing, its local queue full: a searcher's silence
        then is not its own (it waits to send), so the watch counts it on this clock."""
        (total, since), now = self.held, time.time()
        return now - total - (now - since if since is not None else 0.0)

    def get(self, block: bool = True, timeout: float | None = None) -> dict:
        """The next message, as queue.Queue's get (Empty when none comes in `timeout` s, or none is there)."""
        msg = self.local.get(block, timeout)
        if isinstance(msg, Exception):
            raise msg
        return msg

    def get_nowait(self) -> dict:
        return self.get(False)

    def fault(self, searcher: int, wait: float = 0.0) -> str | None:
        """Searcher `searcher`'s fault line, waiting up to `wait` s for it to be read; None if none came."""
        deadline = time.time() + wait
        while searcher not in self.faults and time.time() < deadline and self.thread.is_alive():
            time.sleep(0.05)
        return self.faults.get(searcher)

    def close(self):
        """The thread ends within WAIT (or with the process, if it waits inside a message that never ends)."""
        self.closed.set()


def fork_server():
    """On the CPU, searchers start from a fork server that has imported vLLM once (vllm_env.start_fork_server; tba.py
    starts it before its own imports where it can). On a GPU node each searcher imports on cores of its own, and
    spawn keeps every process free of anything a parent could have set up for CUDA. Returns torch's context of it."""
    vllm_env.start_fork_server()
    return torch.multiprocessing.get_context("forkserver")


class Watch:
    """Each node's leader (rank 0 on one node) watches its searchers' messages. A searcher stuck in vLLM, on a
    wedged GPU or a stalled file system still lives, and the trainer, which never waits once the buffer has
    data, would train on frozen data without a word. So: a warning (`say`) once a searcher has sent nothing
    for well over its usual time between two messages (a round), and Silent once --timeout passes with nothing
    from it (--start-timeout before its first message: vLLM's import, load and compile). Searcher 0 beats
    after each part of an evaluation, so a long one is not silence; while one is asked for (`evaluating`,
    until its result comes) a part longer than a round is no cause for a warning. On several nodes a leader's
    searchers are numbered from `first` in their messages, and its lines begin with `where` ("node 1: ")."""
    WARN_FACTOR, WARN_MIN = 5.0, 10.0  # warn after 5 x its longest gap so far, 10 s at least

    def __init__(self, procs, timeout: float, first: int = 0, where: str = "",
                 start_timeout: float | None = None, clock=None):
        self.procs, self.timeout, self.first, self.where = procs, timeout, first, where
        self.clock = clock or time.time  # Messages.clock: the time the trainer read nothing is no silence
        self.start_timeout = timeout if start_timeout is None else start_timeout  # before a searcher's first message
        self.evaluating = False  # an evaluation asked of searcher 0 has not come yet
        self.asked = -1          # the step of the latest evaluation asked (an earlier one's ends nothing)
        self.last = [self.clock()] * len(procs)  # when each was last heard from (or spawned)
        self.gap = [None] * len(procs)          # its longest time between two messages (None: one or none yet)
        self.heard_once = [False] * len(procs)
        self.warned = [False] * len(procs)

    def heard(self, msg, now: float | None = None) -> list[str]:
        """A message from a searcher (read at `now`); the line to say if it had been warned about."""
        i, now = msg.get("searcher", self.first) - self.first, now or self.clock()
        if self.heard_once[i] and not (i == 0 and self.evaluating):  # a round's gap, not an evaluation's
            self.gap[i] = max(self.gap[i] or 0.0, now - self.last[i])
        lines = [f"tba.py: {self.where}searcher {i} sends again, after {now - self.last[i]:.0f} s"] if self.warned[i] else []
        self.last[i], self.heard_once[i], self.warned[i] = now, True, False
        if msg["kind"] == "eval" and msg["version"] >= self.asked:  # (read, maybe, after the next request)
            self.evaluating = False
        return lines

    def check(self) -> list[str]:
        """Silent for a searcher quiet for --timeout; else the warnings to say (each once)."""
        now, lines = self.clock(), []
        for i, p in enumerate(self.procs):
            quiet = now - self.last[i]
            if quiet > (self.timeout if self.heard_once[i] else self.start_timeout):
                flag = (f"--timeout {self.timeout:g}" if self.heard_once[i] else
                        f"--start-timeout {self.start_timeout:g}: it never started")
                raise Silent(f"{self.where}searcher {i} (pid {p.pid}) has sent nothing for {quiet:.3g} s ({flag})")
            usual = self.gap[i]
            if usual is not None and not self.warned[i] and not (i == 0 and self.evaluating) and quiet > min(
                    max(self.WARN_FACTOR * usual, self.WARN_MIN), self.timeout / 2):
                self.warned[i] = True
                lines.append(f"tba.py: warning: {self.where}searcher {i} (pid {p.pid}) has sent nothing for {quiet:.0f} s "
                             f"(usually every {usual:.1f} s at most); the run stops if it stays silent "
                             f"{self.timeout:g} s (--timeout)")
        return lines
