"""The searchers' fleet: the trainer's one object for its searchers, whatever their number and nodes.

`Fleet` spawns this node's searchers (searcher.run) and holds everything between them and the trainer:
the queue of their messages, the shared weights (runtime/weights.py's `Outbox`), the evaluation requests,
the watch on their silence (runtime/processes.py), the meetings of the nodes' leaders (runtime/nodes.py) and
the reasons to stop. The trainer (tba.py) calls it through a few verbs, which runtime/local.py's `LocalFleet`
(`--searchers 0`: the trainer's process searches itself, with the same Engine, before each step) has too:
- `share(model, version, saved)`: the shared copy of the weights, made from the model and handed to the searchers;
- `collect(buffer, step, waiting_for)`: the searchers' trajectories into the buffer, waiting while
  `waiting_for()` says what the next step still lacks; `round_size()`: one step's rounds (--lag);
- `publish(named, version)`: new weights for the searchers (TBA′: `pi_ref` too); with --lag L, `keep` instead
  (the trainer chooses once): kept (the outbox's history, on the CPU) and each version published once no searcher
  needs the one before (`serve`): round r of every searcher is sampled by the weights of step r - L exactly;
- `evals`: the evaluations (runtime/evaluations.py: `evals.request(step)`, `evals.wait(buffer, step)`, ...);
- `saved(step)`: what a checkpoint keeps of the weights; `beside()`: where the trainer builds its model;
- `stop_reason()`: why the run must stop (a silent searcher, a signal), or None; `close()`.

Every wait polls, has a timeout and checks that the other side lives: the watch, in the trainer's watchdog
thread, notices a dead searcher (Dead) and one that lives but has gone silent (a warning, then Silent after
--timeout, --start-timeout before its first message); either ends the wait, and the run stops after a
checkpoint. A thread reads the searchers' messages (runtime/processes.py's `Messages`): a message a stopped
searcher left half-written blocks no wait. Several trainer ranks wait with rank 0 (runtime/ranks.py,
`wait_together`); several nodes' leaders meet every POLL seconds (`meet`). This file and runtime/checks.py
are the assembly above the core: they import searcher.py and tasks/ to start and check what the algorithm's
files define.
"""

import contextlib
import math
import sys
import time
from queue import Empty

import torch

import searcher
from buffer import unfit
from runtime import nodes
from runtime.errors import Dead, Silent
from runtime.evaluations import Asked
from runtime.processes import SAID, Channels, Messages, Watch, fork_server
from runtime.ranks import wait_together
from runtime.weights import WAIT, Outbox, Reading, create, join_gathers

FAULT_WAIT = 5.0  # s the trainer waits for the line of a searcher that exited saying one (SAID)


class Fleet:
    """This node's searchers and every wait on them (the module docstring gives the verbs). On several nodes
    each node's leader (LOCAL_RANK 0) does for its node what rank 0 does on one; rank 0 holds the buffer."""

    def __init__(self, cfg, data, rank: int, world: int, log, signals, step: int = 0, device: str = "cpu"):
        self.cfg, self.data, self.rank, self.world, self.log, self.signals = cfg, data, rank, world, log, signals
        self.step = step  # the trainer's: where a resumed run's searchers begin (--lag: round r is step r's)
        local = nodes.layout(world)[1]
        self.leader = rank % local == 0  # its node's shared weights, searchers and queue (rank 0 on one node)
        self.nodes = nodes.Nodes(world, local, cfg.timeout) if world > local else None
        self.where = f"node {rank // local}: " if self.nodes else ""  # in this node's lines
        self.first = rank // local * cfg.searchers  # this node's searchers are numbered from here
        # s between the ranks' decisions in a wait (`wait_for`), and between its lines of what it waits for
        self.slice_s, self.say_every = min(5.0, cfg.timeout / 4), min(30.0, cfg.timeout / 4)
        self.received = 0      # trajectories received over the run (every node's; rank 0)
        self.tokens = 0        # their responses' tokens
        self.kept = 0          # those the buffer kept (--max-reuse counts them)
        self.newest = -1       # the newest weight version that sampled data received (--max-staleness)
        self.verified = {}     # searcher -> the last version whose arrival in its engine it checked (this node's)
        self.published = {}    # weight version -> (time, overhead) when the trainer made them (eval rows)
        self.sent = {}         # weight version -> seconds since the start when the shared copy held it (train rows)
        self.evals = Asked(self)  # searcher 0's evaluations: the trainer's end (runtime/evaluations.py)
        self.silent = None     # a line, once a searcher of this node has sent nothing for --timeout
        self.dead = None       # a line, once a searcher of this node has died (one node; several: `meet`)
        self.procs, self.channels, self.watch = [], None, None
        self.said = []         # the watch's lines, for rank 0 to print (a leader of another node: `queued`)
        self.messages = None   # the searchers' messages, as this process reads them (`Messages`)
        ctx = torch.multiprocessing.get_context("spawn")
        self.shared = create(ctx, cfg.searchers) if self.leader else None
        self.out = Outbox(self.shared, cfg.lag, cfg.timeout)  # the weights' way out, --lag's history
        self.evaluator = None  # --evaluator after: an engine in this process evaluates after the last step
        if self.leader and cfg.searchers:  # first: their vLLM engines start while the trainer loads its model
            try:
                self.spawn(ctx)
            except BaseException:  # a signal, a failed start: the searchers already started stop too
                self.close()
                raise
        if cfg.evaluator == "after":  # one trainer rank (runtime.checks)
            self.evaluator = searcher.Engine(cfg, device, cfg.trainer_memory, data.prompts, data.answers)
            self.evals.request = self.evals.snapshot  # the weights kept, evaluated after the last step

    def spawn(self, ctx):
        """This node's `--searchers` processes (searcher.run). Searcher i of this node runs on GPU (trainer
        ranks + i); node n's are numbered from n x searchers (their seeds differ). Node 0's first also
        evaluates (rank 0 asks it); the others get no evaluation channel, so they build no evaluation models
        (a TL;DR policy copy: 5.5 GB at 2.8B, reloaded at every sync)."""
        cfg, local = self.cfg, nodes.layout(self.world)[1]
        # --generation-slowdown's calibration: engines started, and one calibrates at a time (kept alive with
        # the channels: a semaphore collected before a child unpickles it is gone)
        self.channels = Channels(ctx.Queue(maxsize=4 * cfg.searchers), ctx.Event(), ctx.Queue(),
                                 (ctx.Value("i", 0), ctx.Lock()), ctx.Value("q", -1), ctx.Value("q", -1))
        start = fork_server() if cfg.device == "cpu" else ctx
        for i in range(cfg.searchers):
            evaluates = i == 0 and self.rank == 0 and cfg.evaluator == "searcher"
            own = self.channels._replace(evals=self.channels.evals if evaluates else None)
            dev = f"cuda:{local + i}" if cfg.device == "cuda" else "cpu"
            p = start.Process(target=searcher.run, name=f"searcher-{self.first + i}", daemon=True,
                              args=(self.first + i, cfg, self.shared, own, self.data, dev, self.step))
            with self.signals.deferred():  # on the CPU it waits for the fork server's imports: seconds
                p.start()
            self.procs.append(p)
        self.messages = Messages(self.channels.queue, 4 * cfg.searchers)

    def beside(self):
        """Build the trainer's model inside this (beside --evaluator after's engine; else nothing to do)."""
        return self.evaluator.beside() if self.evaluator else contextlib.nullcontext()

    def share(self, model, version: int, saved: dict | None = None, newest: int = -1):
        """The shared weights (every rank gathers; each leader allocates them once), at `version`, or with
        `saved` (a checkpoint's) the older weights the searchers held, --lag's history and TBA′'s pi_ref; then
        handed to the searchers, which may read them from now on (shared memory / CUDA IPC handles, not copies)."""
        self.out.share(model, version, getattr(torch, self.cfg.dtype), self.cfg.ref_reset_every > 0, saved,
                       self.cfg.trainer_dtype)
        self.newest, self.model = newest, model  # (--evaluator after keeps its weights at each evaluation's step)
        if not self.leader:
            return
        for _ in self.procs:
            self.shared.handoff.put((self.shared.tensors, self.shared.pi_ref, self.shared.prints))
        self.published[self.shared.version.value] = self.log.clock()
        if self.procs:  # silent searchers: each node's leader watches its own
            self.watch = Watch(self.procs, self.cfg.timeout, first=self.first, where=self.where,
                               start_timeout=self.cfg.start_timeout, clock=self.messages.clock)

    def saved(self, step: int) -> dict:
        """What a checkpoint keeps of the weights (rank 0: runtime/weights.Outbox.saved)."""
        return self.out.saved(step)

    # --- collect ------------------------------------------------------------------------------
    def collect(self, buffer, step: int, waiting_for) -> tuple[float, float]:
        """The searchers' trajectories into `buffer`, waiting while rank 0's `waiting_for()` names what the next step
        lacks (or a signal or a silent searcher stops the run). Returns (seconds waited, seconds searched here)."""
        if self.nodes:  # several nodes: the leaders meet; the other ranks go on to the batch's broadcast
            return (self.meet(buffer, lambda: waiting_for() is None or bool(self.signals.first)) if self.leader
                    else 0.0), 0.0
        return self.wait_for(buffer, lambda: waiting_for() is None, waiting_for), 0.0

    def wait_for(self, buffer, until, what) -> float:
        """Take the searchers' messages; wait until `until()` holds, or a signal, a silent or a dead searcher
        stops the run. Every rank waits with rank 0 (wait_together); `what()` says what for. Returns seconds
        waited."""
        done = lambda: self.rank == 0 and (until() or bool(self.signals.first or self.silent or self.dead))
        return wait_together(self.rank, self.world, lambda seconds: self.take(buffer, done, seconds), done,
                             what, self.log, self.slice_s, self.signals, self.say_every)

    def take(self, buffer, done, budget: float = math.inf) -> float:
        """Every waiting message into the buffer or the log (a beat only counts as life); then, while not
        done(), wait for more, polling, `budget` s at most (`watching` ends a wait on a silent or dead one).
        A fault line or an unfit round is kept in `dead`: the run stops after a checkpoint. Returns seconds
        waited."""
        waited, end = 0.0, time.time() + budget
        try:
            while True:
                if self.cfg.lag is not None:  # the next weights the rounds need, once none needs those before
                    self.serve()
                block, t0 = not done() and time.time() < end, time.time()
                try:
                    msg = self.messages.get(block, WAIT)
                except Empty:
                    if not block:
                        return waited
                    msg = {"kind": None}  # none in WAIT s: poll again
                waited += time.time() - t0 if block else 0.0
                if msg["kind"] == "search":
                    self.add(buffer, msg["trajectories"])
                    self.newest = max(self.newest, msg["version"])
                    self.verified[msg["searcher"]] = msg["verified"]
                    self.log.searched(msg)
                elif msg["kind"] == "eval":
                    self.evals.came(msg)
                elif msg["kind"] == "fault":  # a searcher's last word before it exits: its line
                    raise Dead(msg["line"])
        except Dead as e:  # the trainer lives, and stops after a checkpoint
            self.dead = str(e)
            return waited

    def watching(self):
        """A beat of the trainer's watchdog thread (runtime.ranks.Watchdog), off the step's path: the
        searchers heard (`Messages.stamps`), silent (Silent) or dead (Dead), kept for the waits to stop on;
        the watch's lines said on rank 0's console, or kept for it (`queued`)."""
        if self.watch is None or self.silent or self.dead:
            return
        try:
            while self.messages.stamps:
                now, msg = self.messages.stamps.popleft()
                self.said += self.watch.heard(msg, now) if isinstance(msg, dict) else []
            self.said += self.watch.check()
            self.alive()
        except Silent as e:
            self.silent = str(e)
        except Dead as e:  # the trainer lives: it stops after a checkpoint, as for a silent searcher
            self.dead = str(e)
        while self.rank == 0 and self.said:
            self.log.print(self.said.pop(0), file=sys.stderr)

    def add(self, buffer, trajectories):
        if why := unfit(trajectories, self.cfg.task):  # the run stops after a checkpoint (wait_for)
            raise Dead(why)
        self.received, self.kept = self.received + len(trajectories), self.kept + len(buffer.add(trajectories))
        self.tokens += sum(len(t.response) for t in trajectories)  # their responses' tokens (the train rows' `tokens`)

    def meet(self, buffer, until) -> float:
        """Several nodes, every leader: meet, forward, and repeat every POLL seconds until rank 0 says that
        `until()` holds (the first step also waits for a first message from every node), or that a node's
        searcher went silent. Rank 0 takes node 0's messages as on one node; each other leader sends what its
        searchers queued, with its watch's lines (printed by rank 0) and its silent line (its watch's, or its
        weight lock's). Rank 0 takes the first silent line of any node, naming the node, as its own, and ends
        the wait: the loop then stops after a checkpoint, as on one node. Returns seconds waited."""
        multi = self.nodes  # before every node's searchers have sent, their start-up may take --start-timeout
        timeout = self.cfg.timeout if all(multi.heard) else max(self.cfg.timeout, self.cfg.start_timeout)
        waited, deadline = 0.0, time.time() + timeout
        while True:
            error, got = None, False
            try:
                self.serve()
                if self.rank == 0:
                    self.alive()  # (the watchdog's finding: one node's searcher dead stops every node at once)
                    before = (self.received, len(self.evals.evaluated))
                    self.take(buffer, lambda: True)  # node 0: whatever its searchers queued, without waiting
                    if self.dead:
                        raise Dead(self.dead)
                    got = (self.received, len(self.evals.evaluated)) != before
                    multi.heard[0] = multi.heard[0] or self.received > before[0]
                    payload = nodes.encode([])
                else:
                    self.alive()
                    trajectories, said = self.queued()
                    payload = nodes.encode(trajectories, silent=self.silent, said=said)
            except BaseException as e:  # a searcher of this node died, a signal...: the run stops, with this
                error = e               # line from rank 0, after this meeting
                payload = nodes.encode([], error=str(e) if isinstance(e, Dead) else f"stopped by {type(e).__name__}")
            parts = multi.gather(payload)
            decision = nodes.CONTINUE
            try:
                if self.rank == 0:
                    if error:
                        raise error
                    for node, part in enumerate(parts[1:], start=1):
                        try:
                            trajectories, report = nodes.decode(part)
                        except ValueError as e:
                            raise Dead(f"node {node}: {e}") from None
                        if report["error"] is not None:
                            raise Dead(f"node {node}: {report['error']}")
                        for line in report["said"]:
                            self.log.print(line, file=sys.stderr)
                        self.silent = self.silent or report["silent"]  # it names its node (`where`)
                        self.add(buffer, trajectories)
                        multi.received(node, trajectories)
                        got = got or bool(trajectories)
                    self.newest = max([self.newest] + [v for v in multi.versions if v is not None])
                    deadline = time.time() + timeout if got else deadline
                    if self.silent or until() and all(multi.heard):  # the first step waits for every node's searchers
                        decision = nodes.DONE
                    elif time.time() > deadline:
                        raise TimeoutError(f"no message from the searchers of any node in {timeout:.0f} s "
                                           f"(see --timeout)")
            except BaseException:
                decision = nodes.FAILED
                raise
            finally:
                if self.rank == 0:
                    multi.decide(decision)
            if self.rank != 0:
                decision = multi.decide(decision)
                if error:
                    raise error
                if decision == nodes.FAILED:
                    raise Dead("trainer rank 0 stopped the run (its node's output says why)")
            if decision == nodes.DONE:
                return waited
            time.sleep(nodes.POLL)
            waited += nodes.POLL

    def queued(self) -> tuple[list, list[str]]:
        """A leader of node >= 1: every trajectory its searchers queued, without waiting for more, and its
        watch's lines for rank 0 to print (`watching`, which records a silent searcher, for rank 0:
        `meet`)."""
        trajectories = []
        while True:
            try:
                msg = self.messages.get_nowait()
            except Empty:
                break
            if msg["kind"] == "search":  # evaluations come from node 0's searcher 0 only
                trajectories += msg["trajectories"]
            elif msg["kind"] == "fault":
                raise Dead(msg["line"])
        said, self.said = self.said, []
        return trajectories, said

    def round_size(self) -> int:
        """--lag: the trajectories of one step's rounds, every node's searchers' (one round each)."""
        cfg = self.cfg
        return (cfg.searchers * nodes.layout(self.world)[0] * min(cfg.round_prompts, len(self.data.prompts))
                * cfg.search_samples_per_prompt)

    def alive(self):
        """Dead if a searcher of this node has exited: its own line if it said one before (SAID: it is in the
        pipe before the exit, and the trainer may see the exit first, waiting for the lock or a message), else its
        exit code."""
        for i, p in enumerate(self.procs):
            if p.exitcode is not None:
                said = self.messages.fault(self.first + i, wait=FAULT_WAIT if p.exitcode == SAID else 0)
                raise Dead(said or f"searcher {i} (pid {p.pid}) died with exit code {p.exitcode}")

    # --- the weights' trips to the searchers ---------------------------------------------------------
    def publish(self, named, version: int, pi_ref: bool = False, final: bool = False) -> bool:
        """Publish the weights of step `version` (`pi_ref`: pi_ref too, at once). Every rank calls it; True
        where published (a leader), so that the buffer's window moves."""
        return self.write(named, version, ("policy", "pi_ref") if pi_ref else ("policy",))

    def keep(self, named, version: int, pi_ref: bool = False, final: bool = False) -> bool:
        """--lag's `publish` (the trainer chooses it once): the weights kept and `serve`d when rounds need
        them; the `final` ones published at once."""
        if final:
            self.out.history = {}
            return self.publish(named, version, pi_ref)
        copy = self.out.keep(named, version)  # every rank joins the all-gathers; the leaders keep a copy
        if copy is None:
            return False
        self.published[version] = self.log.clock()
        self.step = version
        if pi_ref:  # TBA′: pi_ref is the current weights at once, while the policy stays L steps behind
            self.write(copy.items(), version, ("pi_ref",))
        self.serve()
        return True

    def write(self, named, version: int, to: tuple) -> bool:
        """The outbox's write under this node's lock; a searcher stopped inside the copy or holding its lock
        stops the run as a silent one does, one that died there at once. True where published (a leader)."""
        try:
            self.out.write(named, version, self.alive, to=to)
        except TimeoutError as e:  # a searcher of this node stopped inside the shared copy, or holding its lock
            join_gathers(named)  # every other rank waits in these all-gathers; then all stop at the next batch
            timeout = self.cfg.timeout
            if isinstance(e, Reading):
                pid = f" (pid {self.procs[e.reader].pid})" if e.reader < len(self.procs) else ""
                why = (f"searcher {self.first + e.reader}{pid} stopped while it read the weights: still reading after "
                       f"{timeout:g} s")
            else:
                why = f"the weight-sync lock was not free for {timeout:g} s: a searcher stopped while it held it"
            self.silent = self.silent or f"{self.where}{why} (--timeout {timeout:g})"  # rank 0's, or sent to it at the
            return False                                                                # next meeting (`meet`)
        except Dead as e:  # a searcher died reading or holding the lock: every other rank waits in these all-gathers
            join_gathers(named)
            if not self.nodes:  # the run stops at the next batch, after a checkpoint
                self.dead = self.dead or str(e)
            # several nodes: leaving now would show the others a closed connection only; the next
            # meeting's alive() names the searcher to rank 0 (`meet`)
            return False
        if self.leader and "policy" in to:
            self.published.setdefault(version, self.log.clock())
            self.sent[version] = self.log.now()
        return self.leader

    def serve(self):
        """--lag, each leader: publish the next version the searchers' rounds need (`wants`), once none needs
        the one published; keep only the last L steps' weights and those still to serve (a checkpoint saves
        them)."""
        if self.cfg.lag is None or not self.leader or not self.out.history:
            return
        history = self.out.history
        published, wants = self.shared.version.value, [w for w in self.shared.wants[:len(self.procs) or 1]]
        needed = [w for w in wants if w >= 0]
        if needed and min(needed) > published and min(needed) in history:
            self.write(history[min(needed)].items(), min(needed), ("policy",))
        self.out.forget(min(self.shared.version.value, self.step - self.cfg.lag))

    # --- stopping ------------------------------------------------------------------------------------
    def stop_reason(self):
        """Why rank 0 stops the run, or None: ("dead", message), ("silent", message) or ("signal", name)."""
        first, dead = self.signals.first, self.dead or self.log.unwritten  # (a row that could not be written)
        return (("dead", dead) if dead else ("silent", self.silent) if self.silent else
                ("signal", self.signals.named(first[0])) if first else None)

    def close(self):
        """Stop the searchers: ask (they finish their round), then kill; nothing is left behind."""
        if self.evaluator:
            self.evaluator.close()
        if self.messages is not None:
            self.messages.close()
        if self.channels is None:
            return
        self.channels.stop.set()
        deadline = time.time() + 5
        for p in self.procs:
            p.join(timeout=max(0.1, deadline - time.time()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.channels.queue.cancel_join_thread()
        self.shared.handoff.cancel_join_thread()
