"""The searchers' fleet: the trainer's one object for its searchers, whatever their number and nodes.

`Fleet` spawns this node's searchers (searcher.run) and holds everything between them and the trainer:
the queue of their messages, the shared weights (runtime/weights.py), the evaluation requests, the
watch on their silence, the meetings of the nodes' leaders (runtime/nodes.py), signals and the reasons
to stop. The trainer (tba.py) calls it through a few verbs:
- `share(model, ...)`: the shared copy of the weights, made from the model and handed to the searchers;
- `collect(buffer, step, waiting_for)`: the searchers' trajectories into the buffer, waiting while
  `waiting_for()` says what the next step still lacks;
- `publish(named, version)`: new weights for the searchers (TBA′: `pi_ref` too); with --lag L they are kept
  (`history`, on the CPU) and each version is published once no searcher needs the one before (`serve`):
  round r of every searcher is sampled by the weights of step r - L exactly;
- `request_eval(step)`, `wait_for_eval(step)`: an evaluation by searcher 0, and the wait for the last;
- `stop_reason()`: why the run must stop (a silent searcher, a signal), or None; `close()`.
`LocalFleet` is the same for `--searchers 0` (the synchronous baseline): the trainer's process searches
itself, with the same Engine, before each step.

Every wait polls, has a timeout and checks that the other side lives: a dead searcher raises Dead, none
heard from for --timeout raises TimeoutError, and `Watch` notices a searcher that lives but has gone
silent (a warning, then Silent, which stops the run after a checkpoint). Several trainer ranks wait with
rank 0 (runtime/ranks.py, `wait_together`); several nodes' leaders meet every POLL seconds (`meet`).
"""

import atexit
import contextlib
import math
import os
import signal
import sys
import time
from queue import Empty
from typing import NamedTuple

import numpy as np
import torch

import searcher
from runtime import nodes, seeds, slowdown, vllm_env
from runtime.errors import Dead, Silent, Stop
from runtime.ranks import wait_together
from runtime.weights import (WAIT, aliases, allocate, cpu_copy, create, every_name, gather, join_gathers,
                             publish)


class Signals:
    """SIGINT and SIGTERM: before the first step one stops the run at once (nothing to save, Stop);
    after it, the first asks the trainer to stop after a checkpoint (`first`), and a second one
    stops it at once (KeyboardInterrupt). Under torchrun, Ctrl-C's SIGINT reaches the trainer twice
    at once (the terminal's and torchrun's): a second signal counts only after 1 s. One that comes while
    a searcher starts acts once it has started (`held`)."""

    def __init__(self):
        self.first = None      # (name, time) of the first signal once training began
        self.training = False  # set by the loop after its first step
        self.holding = None    # signals that came while `held`, acted on at its end
        signal.signal(signal.SIGINT, self.on_signal)
        signal.signal(signal.SIGTERM, self.on_signal)

    @contextlib.contextmanager
    def held(self):
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
        if not self.training:
            raise Stop(name, False)
        if self.first and time.time() - self.first[1] > 1:
            raise KeyboardInterrupt
        self.first = self.first or (name, time.time())


class Channels(NamedTuple):
    """Between a node's leader and one of its searchers (spawn)."""
    queue: object        # mp.Queue: the searchers' messages (trajectories, evaluations, beats) to the trainer
    stop: object         # mp.Event: set to stop the searchers
    evals: object        # mp.Queue: evaluation requests (a step) to searcher 0 of node 0; None for the others
    calibration: tuple   # (started engines, lock): --generation-slowdown's calibration


class Fleet:
    """This node's searchers and every wait on them (the module docstring gives the verbs). On several nodes
    each node's leader (LOCAL_RANK 0) does for its node what rank 0 does on one; rank 0 holds the buffer."""

    def __init__(self, cfg, data, rank: int, world: int, log, signals, step: int = 0):
        self.cfg, self.data, self.rank, self.world, self.log, self.signals = cfg, data, rank, world, log, signals
        self.step = step  # the trainer's: where a resumed run's searchers begin (--lag: round r is step r's)
        local = nodes.layout(world)[1]
        self.leader = rank % local == 0  # its node's shared weights, searchers and queue (rank 0 on one node)
        self.nodes = nodes.Nodes(world, local, cfg.timeout) if world > local else None
        self.where = f"node {rank // local}: " if self.nodes else ""  # in this node's lines
        self.first = rank // local * cfg.searchers  # this node's searchers are numbered from here
        self.received = 0      # trajectories received over the run (every node's; rank 0)
        self.kept = 0          # those the buffer kept (--max-reuse counts them)
        self.newest = -1       # the newest weight version that sampled data received (--max-staleness)
        self.published = {}    # weight version -> (time, overhead) when the trainer made them (eval rows)
        self.evaluated = []    # versions whose evaluation came
        self.silent = None     # a line, once a searcher of this node has sent nothing for --timeout
        self.said = []         # a leader of node >= 1: its watch's lines, for rank 0 to print
        self.history = {}      # --lag: step -> the weights of that step (the leaders, CPU), L steps back
        self.procs, self.channels, self.watch = [], None, None
        ctx = torch.multiprocessing.get_context("spawn")
        self.shared = create(ctx, cfg.searchers) if self.leader else None
        if self.leader and cfg.searchers:  # first: their vLLM engines start while the trainer loads its model
            try:
                self.spawn(ctx)
            except BaseException:  # a signal, a failed start: the searchers already started stop too
                self.close()
                raise

    def spawn(self, ctx):
        """This node's `--searchers` processes (searcher.run). Searcher i of this node runs on GPU (trainer
        ranks + i); node n's are numbered from n x searchers (their seeds differ). Node 0's first also
        evaluates (rank 0 asks it); the others get no evaluation channel, so they build no evaluation models
        (a TL;DR policy copy: 5.5 GB at 2.8B, reloaded at every sync)."""
        cfg, local = self.cfg, nodes.layout(self.world)[1]
        # --generation-slowdown's calibration: engines started, and one calibrates at a time (kept alive with
        # the channels: a semaphore collected before a child unpickles it is gone)
        self.channels = Channels(ctx.Queue(maxsize=4 * cfg.searchers), ctx.Event(), ctx.Queue(),
                                 (ctx.Value("i", 0), ctx.Lock()))
        start = fork_server() if cfg.device == "cpu" else ctx
        for i in range(cfg.searchers):
            own = self.channels._replace(evals=self.channels.evals if i == 0 and self.rank == 0 else None)
            dev = f"cuda:{local + i}" if cfg.device == "cuda" else "cpu"
            p = start.Process(target=searcher.run, name=f"searcher-{self.first + i}", daemon=True,
                              args=(self.first + i, cfg, self.shared, own, self.data, dev, self.step))
            with self.signals.held():  # on the CPU it waits for the fork server's imports: seconds
                p.start()
            self.procs.append(p)

    def beside(self):
        """Build the trainer's model inside this (LocalFleet: beside its vLLM engine)."""
        return contextlib.nullcontext()

    def share(self, model, version: int, held: dict | None = None, newest: int = -1):
        """The shared weights (every rank gathers; each leader allocates them once), at `version`, or with
        `held` (a checkpoint's) the older weights the searchers held and TBA′'s pi_ref; then handed to the
        searchers, which may read them from now on (shared memory / CUDA IPC handles, not copies)."""
        cfg, dtype = self.cfg, getattr(torch, self.cfg.dtype)
        device = next(model.parameters()).device
        allocate(self.shared, gather(model, dtype), aliases(model), device, dtype, with_pi_ref=cfg.ref_reset_every > 0)
        self.newest = newest
        if not self.leader:
            return
        self.shared.version.value = version
        if cfg.lag is not None:  # the weights the next rounds need: the checkpoint's L steps, and these
            self.history = {int(v): w for v, w in (held or {}).get("history", {}).items()}
            self.history[version] = {n: t.cpu().clone() for n, t in self.shared.tensors.items() if n not in aliases(model)}
            first = max(0, version - cfg.lag)  # round `version`'s, where the searchers begin
            if first != version:
                publish(self.shared, self.history[first].items(), first, lambda: None, cfg.timeout)
        elif held and held["synced"] is not None:  # the searchers held older weights
            publish(self.shared, held["synced"].items(), held["synced_version"], lambda: None, cfg.timeout)
        if held and held["pi_ref"] is not None:  # TBA′: pi_ref of the latest reset
            publish(self.shared, held["pi_ref"].items(), held["pi_ref_version"], lambda: None, cfg.timeout,
                    to=("pi_ref",))
        for _ in self.procs:
            self.shared.handoff.put((self.shared.tensors, self.shared.pi_ref))
        self.published[self.shared.version.value] = self.log.clock()
        if self.procs:  # silent searchers: each node's leader watches its own
            say = (lambda line: self.log.print(line, file=sys.stderr)) if self.rank == 0 else self.said.append
            self.watch = Watch(self.procs, cfg.timeout, say, first=self.first, where=self.where)

    def held(self, step: int) -> dict:
        """What a checkpoint keeps of the shared weights (rank 0): those the searchers hold if older than step
        `step`'s, and TBA′'s pi_ref."""
        cpu = lambda tensors: {n: t.cpu() for n, t in tensors.items()}
        s, lag = self.shared, self.cfg.lag
        return dict(synced=cpu(s.tensors) if s.version.value != step else None, synced_version=s.version.value,
                    pi_ref=cpu(s.pi_ref) if s.pi_ref is not None else None, pi_ref_version=s.pi_ref_version.value,
                    history={v: w for v, w in self.history.items() if v >= step - lag} if lag is not None else {})

    # --- collect ------------------------------------------------------------------------------
    def collect(self, buffer, step: int, waiting_for) -> tuple[float, float]:
        """The searchers' trajectories into `buffer`: whatever arrived, waiting (polling, checking the
        searchers, signals and the timeout) while rank 0's `waiting_for()` names what the next step lacks,
        until a signal or a silent searcher stops the run. Returns (seconds waited, seconds searched here)."""
        if self.nodes:  # several nodes: the leaders meet; the other ranks go on to the batch's broadcast
            return (self.meet(buffer, lambda: waiting_for() is None or bool(self.signals.first)) if self.leader
                    else 0.0), 0.0
        return self.wait_for(buffer, lambda: waiting_for() is None, waiting_for), 0.0

    def wait_for(self, buffer, until, what) -> float:
        """Take the searchers' messages; wait until `until()` holds, or a signal or a silent searcher stops
        the run. Every rank waits with rank 0 (wait_together); `what()` says what for. Returns seconds waited."""
        def some(seconds):
            try:
                return self.take(buffer, done, seconds)
            except Silent as e:
                self.silent = str(e)
                return 0.0
        done = lambda: self.rank == 0 and (until() or bool(self.signals.first) or bool(self.silent))
        return wait_together(self.rank, self.world, some, done, what, self.log, min(30.0, self.cfg.timeout / 4))

    def take(self, buffer, done, budget: float = math.inf) -> float:
        """Move every waiting message into the buffer (trajectories) or the log (evaluations; searcher 0's
        beats while it evaluates only count as signs of life); then, while not done(), wait for more,
        polling, checking the searchers (silent ones too) and a timeout, for at most `budget` seconds.
        Returns seconds waited."""
        queue, timeout = self.channels.queue, self.cfg.timeout
        waited, deadline = 0.0, time.time() + timeout  # the deadline moves on with every message
        end = time.time() + budget
        while True:
            block = not done() and time.time() < end
            t0 = time.time()
            try:
                msg = queue.get(timeout=WAIT) if block else queue.get_nowait()
            except Empty:
                self.alive()
                self.watch.check()
                self.serve()
                if not block:
                    return waited
                waited += time.time() - t0
                if time.time() > deadline:
                    raise TimeoutError(f"no message from the searchers in {timeout:.0f} s (see --timeout)")
                continue
            if block:
                waited += time.time() - t0
            deadline = time.time() + timeout
            self.watch.heard(msg)
            self.serve()
            if msg["kind"] == "eval":
                self.log.eval(msg["version"], msg["scores"], msg["example"], msg["seconds"],
                              self.published[msg["version"]])
                self.evaluated.append(msg["version"])
            elif msg["kind"] == "search":
                self.add(buffer, msg["trajectories"])
                self.newest = max(self.newest, msg["version"])
                self.log.searched(msg)

    def add(self, buffer, trajectories):
        self.received += len(trajectories)
        self.kept += len(buffer.add(trajectories))

    def meet(self, buffer, until) -> float:
        """Several nodes, every leader: meet, forward, and repeat every POLL seconds until rank 0 says that
        `until()` holds (the first step also waits for a first message from every node), or that a node's
        searcher went silent. Rank 0 takes node 0's messages as on one node; each other leader sends what its
        searchers queued, with its watch's lines (printed by rank 0) and its silent line (its watch's, or its
        weight lock's). Rank 0 takes the first silent line of any node, naming the node, as its own, and ends
        the wait: the loop then stops after a checkpoint, as on one node. Returns seconds waited."""
        waited, deadline, timeout, multi = 0.0, time.time() + self.cfg.timeout, self.cfg.timeout, self.nodes
        while True:
            error, got = None, False
            try:
                self.serve()
                if self.rank == 0:
                    before = (self.received, len(self.evaluated))
                    try:
                        self.take(buffer, lambda: True)  # node 0: whatever its searchers queued, without waiting
                    except Silent as e:
                        self.silent = self.silent or str(e)
                    got = (self.received, len(self.evaluated)) != before
                    multi.heard[0] = multi.heard[0] or self.received > before[0]
                    payload = nodes.encode([])
                else:
                    self.alive()
                    payload = nodes.encode(self.queued(), silent=self.silent, said=self.said)
                    self.said.clear()  # in place: the watch appends to this list
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

    def queued(self) -> list:
        """A leader of node >= 1: every trajectory its searchers queued, without waiting for more, heard by its
        watch; a silent searcher is recorded, for rank 0 (`meet`)."""
        trajectories = []
        while True:
            try:
                msg = self.channels.queue.get_nowait()
            except Empty:
                break
            self.watch.heard(msg)
            if msg["kind"] == "search":  # evaluations come from node 0's searcher 0 only
                trajectories += msg["trajectories"]
        try:
            self.watch.check()
        except Silent as e:
            self.silent = self.silent or str(e)
        return trajectories

    def round_size(self) -> int:
        """--lag: the trajectories of one step's rounds, every node's searchers' (one round each)."""
        cfg = self.cfg
        return (cfg.searchers * nodes.layout(self.world)[0] * min(cfg.round_prompts, len(self.data.prompts))
                * cfg.search_samples_per_prompt)

    def alive(self):
        for i, p in enumerate(self.procs):
            if p.exitcode is not None:
                raise Dead(f"searcher {i} (pid {p.pid}) died with exit code {p.exitcode}")

    # --- the weights' trips to the searchers ---------------------------------------------------------
    def publish(self, named, version: int, pi_ref: bool = False, final: bool = False) -> bool:
        """Publish `named` (weights.gather's pairs of the weights of step `version`); searchers reload them before
        their next round. `pi_ref`: they also become pi_ref (TBA′), at once. With --lag they are kept on the CPU
        and served when the searchers' rounds need them (`serve`), unless `final` (the last step's: every
        round is made). Every rank calls it. True where weights were published (a leader), so that the
        buffer's window moves."""
        lag = self.cfg.lag
        if lag is not None and not final:
            copy = cpu_copy(self.shared, named)  # every rank joins the all-gathers; the leaders keep a copy
            if copy is None:
                return False
            self.history[version] = copy
            self.published[version] = self.log.clock()
            self.step = version
            if pi_ref:  # TBA′: pi_ref is the current weights at once, while the policy stays L steps behind
                self.put(copy.items(), version, ("pi_ref",))
            self.serve()
            return True
        if final:
            self.history = {}
        return self.put(named, version, ("policy", "pi_ref") if pi_ref else ("policy",))

    def put(self, named, version: int, to: tuple) -> bool:
        """weights.publish under this node's lock, and its faults: a lock a stopped searcher never freed stops
        the run like a silent searcher; a searcher that died holding it, at once (several nodes: at the next
        meeting). True where published (a leader)."""
        try:
            publish(self.shared, named, version, self.alive, self.cfg.timeout, to=to)
        except TimeoutError:  # the lock stayed taken: a searcher of this node stopped while it read the weights
            join_gathers(named)  # every other rank waits in these all-gathers; then all stop at the next batch
            self.silent = self.silent or (  # rank 0's, or sent to it at the next meeting (`meet`)
                f"{self.where}the weight-sync lock was not free for {self.cfg.timeout:g} s: a searcher stopped while "
                f"it read the weights (--timeout {self.cfg.timeout:g})")
            return False
        except Dead:  # a searcher died holding the lock
            if not self.nodes:
                raise
            # several nodes: leaving now would show the others a closed connection only; the next
            # meeting's alive() names the searcher to rank 0 (`meet`)
            join_gathers(named)
            return False
        if self.leader and "policy" in to:
            self.published.setdefault(version, self.log.clock())
        return self.leader

    def serve(self):
        """--lag, each leader: publish the next version the searchers' rounds need, once none needs the one
        published (each searcher says which it needs next in `wants`, -1 when it needs none); then keep only
        the last L steps' weights and those still to serve (a checkpoint saves them: a resumed run's searchers
        begin at its step's round)."""
        if self.cfg.lag is None or not self.leader or not self.history:
            return
        held, wants = self.shared.version.value, [w for w in self.shared.wants[:len(self.procs) or 1]]
        needed = [w for w in wants if w >= 0]
        if needed and min(needed) > held and min(needed) in self.history:
            self.put(self.history[min(needed)].items(), min(needed), ("policy",))
        floor = min(self.shared.version.value, self.step - self.cfg.lag)
        for v in [v for v in self.history if v < floor]:
            del self.history[v]

    # --- evaluation, stopping --------------------------------------------------------------------------
    def request_eval(self, step: int):
        """Ask searcher 0 to evaluate, between two rounds, the weights of `step` if it holds them (the initial
        model's at the start), else the newest published (rank 0 asks)."""
        if self.rank == 0:
            self.channels.evals.put(step)
            self.watch.evaluating = True  # its parts may each take longer than a round: no warning

    def wait_for_eval(self, buffer, step: int):
        """Wait for the evaluation of step `step` (the final one), taking whatever else comes (node 0's: the
        evaluation is its searcher 0's; every rank waits with rank 0)."""
        done = lambda: bool(self.evaluated) and self.evaluated[-1] == step
        return self.wait_for(buffer, done, lambda: f"the final evaluation (of step {step}) from searcher 0")

    def stop_reason(self):
        """Why rank 0 stops the run, or None: ("silent", message) or ("signal", name)."""
        first = self.signals.first
        return ("silent", self.silent) if self.silent else ("signal", first[0]) if first else None

    def close(self):
        """Stop the searchers: ask (they finish their round), then kill; nothing is left behind."""
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


class LocalFleet(Fleet):
    """--searchers 0, the synchronous baseline: a vLLM engine inside the trainer's one process (runtime.checks
    refuses more ranks), which generates with the current weights before each step and evaluates."""

    def __init__(self, cfg, data, rank: int, world: int, log, signals, device, step: int = 0):
        super().__init__(cfg, data, rank, world, log, signals, step)
        self.engine = searcher.Engine(cfg, str(device), cfg.trainer_memory, data.prompts, data.answers)
        if cfg.generation_slowdown != 1:
            for timed in (False, True):
                slowdown.calibrate(self.engine, cfg.prompts_per_step, cfg.search_samples_per_prompt, timed)

    def beside(self):
        """The trainer's model beside the engine (runtime/vllm_env.eager_transformers)."""
        return self.engine.beside()

    def share(self, model, version: int, held: dict | None = None, newest: int = -1):
        super().share(model, version, held, newest)
        self.model = model  # evaluated as it is (request_eval)

    def collect(self, buffer, step: int, waiting_for) -> tuple[float, float]:
        """One search round of B prompts with the current weights, or with --lag L those of step `step` - L (more
        while `waiting_for()` names something: the initial buffer). Returns (0, seconds searched)."""
        cfg, search = self.cfg, 0.0
        if self.signals.first:
            return 0.0, 0.0
        if cfg.lag is not None and self.shared.version.value != max(0, step - cfg.lag):
            self.put(self.history[max(0, step - cfg.lag)].items(), max(0, step - cfg.lag), ("policy",))
        self.engine.sync(self.shared, self.alive, cfg.timeout)
        for round_ in range(10**9):
            ids = np.random.default_rng([cfg.seed, step, seeds.SYNC_PROMPTS, round_]).choice(
                len(self.data.prompts), cfg.prompts_per_step, replace=False)
            t_search = time.time()
            trajectories, made = self.engine.search(ids, cfg.search_samples_per_prompt, (cfg.seed, round_, step),
                                                    for_step=step if cfg.lag is not None else -1)
            search += time.time() - t_search
            self.add(buffer, trajectories)
            self.newest = max(self.newest, self.engine.version)
            self.log.searched(made)
            if waiting_for() is None or self.signals.first:
                return 0.0, search

    def round_size(self) -> int:
        return self.cfg.prompts_per_step * self.cfg.search_samples_per_prompt

    def request_eval(self, step: int):
        """Evaluate now, on the held-out problems, the weights of step `step` as a sync sends them (its dtype,
        tied names too)."""
        t0 = time.time()
        if self.engine.version != step:
            self.engine.load(every_name(self.model, getattr(torch, self.cfg.dtype)), step)
        scores, example = self.engine.evaluate(self.data.test_prompts, self.data.test_answers)
        self.log.eval(step, scores, example, time.time() - t0, self.log.clock())
        self.evaluated.append(step)
        self.log.overhead += time.time() - t0

    def wait_for_eval(self, buffer, step: int):
        return 0.0

    def serve(self):
        """--lag: this process searches with the weights it needs itself (`collect`); only the history is kept short."""
        for v in [v for v in self.history if v < self.step - self.cfg.lag]:
            del self.history[v]

    def close(self):
        self.engine.close()


def fork_server():
    """On the CPU, searchers start from a fork server that has imported vLLM once (about 5 s of one core
    each, which N searchers spawned afresh would spend side by side on the cores they share: 4 on 2
    cores started 10 s later). On a GPU node each searcher imports on cores of its own, and spawn keeps
    every process free of anything a parent could have set up for CUDA. The server imports runtime/vllm_env.py
    first (it ignores SIGTERM and SIGINT there), then searcher.py, so it must find the repository: Python 3.11's fork
    server does not take the trainer's sys.path (multiprocessing/forkserver.py, main), so PYTHONPATH is
    given it for its start."""
    from multiprocessing import forkserver
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["runtime.vllm_env", "searcher", "transformers", "vllm", "vllm.entrypoints.llm"])
    before = os.environ.get("PYTHONPATH")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository, above runtime/
    os.environ["PYTHONPATH"] = os.pathsep.join([root] + ([before] if before else []))
    os.environ[vllm_env.FORK_SERVER] = "1"
    try:
        forkserver.ensure_running()
        atexit.unregister(stop_fork_server)  # once, however often it is called
        atexit.register(stop_fork_server)
    finally:
        del os.environ[vllm_env.FORK_SERVER]
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before
    return ctx


def stop_fork_server():
    """At the trainer's exit (`fork_server` makes it an exit function): the fork server goes at once. It starts
    before the checks (tba.py, main), and while it still imports vLLM it ignores SIGINT and SIGTERM and sees no
    end of the trainer, so a refused or stopped run would leave it printing vLLM's import lines after the run's
    last. Python 3.11's ForkServer keeps its pid
    (multiprocessing/forkserver.py:37, 161); its socket is in multiprocessing's temporary folder, which the exit
    functions remove (multiprocessing/connection.py:77, util.py:get_temp_dir)."""
    pid = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    pid = pid and pid._forkserver_pid
    if pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class Watch:
    """Each node's leader (rank 0 on one node) watches its searchers' messages. A searcher stuck in
    vLLM, on a wedged GPU or a stalled file system still lives, and the trainer, which never waits once
    the buffer has data, would train on frozen data without a word. So: a warning (`say`) once a
    searcher has sent nothing for well over its usual time between two messages (a round), and Silent
    once --timeout passes with nothing from it (start-up counts: vLLM's load and compile). Searcher 0
    beats after each part of an evaluation, so a long one is not silence; while one is asked for
    (`evaluating`, until its result comes) a part longer than a round is no cause for a warning. On several
    nodes a leader's searchers are numbered from `first` in their messages, and its lines begin with
    `where` ("node 1: ")."""
    WARN_FACTOR, WARN_MIN = 5.0, 10.0  # warn after 5 x its longest gap so far, 10 s at least

    def __init__(self, procs, timeout: float, say, first: int = 0, where: str = ""):
        self.procs, self.timeout, self.say, self.first, self.where = procs, timeout, say, first, where
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
        if msg["kind"] == "eval":
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
