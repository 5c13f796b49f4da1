"""Evaluations: the held-out score of the weights of a step, asked for by the trainer and made by searcher 0 of node 0
(`--evaluator searcher`, the default), or in the trainer's process (`--searchers 0`; `--evaluator after`: the weights
kept and evaluated after the last step). Both ends of the protocol are here; the fleets hold the trainer's end as
`evals`, with the same verbs either way (`request`, `pending`, `wait`, `kept`):
- `Asked`: the trainer's end with searchers (rank 0 asks; every rank waits with it). A request is the step, on
  `Channels.evals`; `Channels.asked` is set before it is sent, `Channels.pinned` says which weights searcher 0 holds
  for an evaluation. Streaming, the next step waits until searcher 0 holds the weights asked for (`pending`): the
  next publish would replace them. With --lag its rounds reach them in order, and past its last round it asks for
  them (runtime/weights.py's `wants`).
- `Requests`: searcher 0's end: the steps asked, each evaluated when the engine holds its weights, before newer ones
  load (`hold`), its scores sent as an "eval" message (runtime/processes.py's `send`).
- `Here` and `evaluate_here`: in the trainer's process, at once.
"""

import sys
import time
from queue import Empty

import torch

from runtime.weights import WAIT, aliases, every_name, gather


class Asked:
    """The trainer's end with searchers (Fleet.evals): the steps asked (rank 0) and those evaluated; --evaluator after:
    the weights kept on the host (`snapshots`), evaluated by the fleet's `evaluator` engine after the last step."""

    def __init__(self, fleet):
        self.fleet = fleet
        self.asked = []      # steps whose evaluation was asked (rank 0)
        self.evaluated = []  # versions whose evaluation came
        self.snapshots = []  # --evaluator after: (step, its weights on the host, when they were made)
        self.held_since = None  # since when the next step waits for searcher 0 to hold an evaluation's weights

    def request(self, step: int):
        """Ask searcher 0 for the evaluation of the weights of `step`, which the trainer has published
        (--evaluator after: `snapshot`, chosen once by the fleet)."""
        f = self.fleet
        if f.rank == 0:
            self.asked.append(step)
            f.channels.asked.value = step  # before the request: a searcher that sees newer weights sees it asked
            f.channels.evals.put(step)
            f.watch.asked, f.watch.evaluating = step, True  # its parts may each outlast a round: no warning

    def snapshot(self, step: int):
        """--evaluator after's `request`: the weights of `step` kept on the host, evaluated after the last
        step (`wait`); one tensor at a time, a tied one once (its names added at the evaluation)."""
        f, t0 = self.fleet, time.time()
        named = {n: t.to("cpu", copy=True) for n, t in gather(f.model, getattr(torch, f.cfg.dtype))}
        self.snapshots.append((step, named, f.log.clock()))
        f.log.overhead += time.time() - t0

    def came(self, msg: dict):
        """Searcher 0's "eval" message: its row in the log, with the time its weights were made."""
        self.fleet.log.eval(msg["version"], msg["scores"], msg["example"], msg["seconds"],
                            self.fleet.published[msg["version"]])
        self.evaluated.append(msg["version"])

    def pending(self) -> str | None:
        """Streaming (rank 0): what the next step waits for while searcher 0 does not hold the weights of an
        evaluation asked for (the next publish would replace them), else None; that wait is the log's
        overhead."""
        pending = [s for s in self.asked if s not in self.evaluated]
        if pending and self.fleet.channels.pinned.value < min(pending):
            self.held_since = self.held_since or time.time()
            return f"searcher 0 to hold the weights of step {min(pending)} for its evaluation"
        if self.held_since:
            self.fleet.log.overhead += time.time() - self.held_since
            self.held_since = None

    def wait(self, buffer, step: int | None = None):
        """Wait for the evaluation of step `step` (None: of every step asked so far), taking whatever else comes
        (node 0's: the evaluation is its searcher 0's; every rank waits with rank 0). --evaluator after: the kept
        weights evaluated now, each row with the time its weights were made."""
        self.kept()
        done = lambda: all(s in self.evaluated for s in (self.asked if step is None else [step]))
        what = "every evaluation asked" if step is None else f"the final evaluation (of step {step})"
        return self.fleet.wait_for(buffer, done, lambda: f"{what} from searcher 0")

    def kept(self):
        """--evaluator after: the evaluations of the weights kept so far, each row at the time they were made; at the
        end, and on any stop (Trainer.close), so that no evaluation asked for is lost."""
        f = self.fleet
        if self.snapshots and f.signals.first:
            f.log.print(f"tba.py: evaluating the weights of {len(self.snapshots)} kept step(s) before stopping "
                        f"(a second signal skips them)", file=sys.stderr)
        tied = aliases(f.model) if self.snapshots else {}
        while self.snapshots:
            v, named, made = self.snapshots[0]
            evaluate_here(f.evaluator, [*named.items(), *((a, named[t]) for a, t in tied.items())], v, f.cfg,
                          f.data, f.log, made)
            self.evaluated.append(v)
            self.snapshots.pop(0)


class Requests:
    """Searcher 0's evaluations (of node 0; for the others, and with no channels, there are none): the steps the
    trainer asked for (`Channels.evals`), each of whose weights is evaluated when the engine holds them, before
    newer ones load (`hold`). `asked` is set before each request is sent and read before any newer weights are,
    so a request on its way is waited for (the trainer published those weights before asking, and publishes no
    newer ones until `pinned` says they are held: `Asked.pending`)."""

    def __init__(self, channels=None, alive=lambda: None, timeout: float = 60.0):
        self.queue = channels.evals if channels is not None else None
        self.asked, self.pinned = (channels.asked, channels.pinned) if self.queue is not None else (None, None)
        self.alive, self.timeout = alive, timeout
        self.pending, self.latest = [], -1  # steps asked and not yet evaluated; the latest received

    def read(self) -> list[int]:
        """The steps asked for and not yet evaluated, every request up to `asked` received (`asked` is set before a
        request is sent: none is on its way once the latest received is `asked`)."""
        deadline = time.time() + self.timeout
        while self.queue is not None and self.latest < self.asked.value:
            try:
                self.latest = self.queue.get(timeout=WAIT / 10)
                self.pending.append(self.latest)
            except Empty:
                self.alive()
                if time.time() > deadline:
                    raise TimeoutError(f"the request to evaluate step {self.asked.value} did not come in "
                                       f"{self.timeout:g} s (--timeout)")
        return self.pending

    def hold(self, held: int, published: int | None = None) -> bool:
        """The engine holds the weights of step `held`: if an evaluation of them is asked for, the trainer
        learns so (`pinned`). Returns whether it keeps them rather than load those of `published` (None: none
        to load): it holds an evaluation's, or newer ones would pass one asked for."""
        pending = self.read()
        if held in pending:
            self.pinned.value = held
        return published is not None and bool(pending) and published > min(pending) and held <= min(pending)

    def due(self, version: int) -> bool:
        """An evaluation of the weights held (or of older ones it can no longer reach) is asked for."""
        return any(step <= version for step in self.read())

    def done(self, version: int):
        self.pending = [step for step in self.pending if step > version]

    def evaluate(self, engine, data, say):
        """The evaluation asked of the weights held (or of older ones: `due`, which the loop asks first): the
        held-out problems' scores, a beat after each part (a long evaluation is no silence)."""
        t0 = self.drain(engine, say) if engine.decoder.busy() else time.time()  # --keep-full: those in flight first
        scores, example = engine.evaluate(data.test_prompts, data.test_answers, lambda n: say(dict(kind="beat", done=n)))
        self.done(engine.version)
        say(dict(kind="eval", version=engine.version, scores=scores, example=example, seconds=time.time() - t0))

    def drain(self, engine, say) -> float:
        """--keep-full, before an evaluation: every response in flight decoded, and the prompts done sent. Returns
        the time it ended."""
        t0 = time.time()
        trajectories, stats = engine.search(None, engine.cfg.search_samples_per_prompt, ())
        say(dict(kind="search", version=engine.version, verified=engine.verified, trajectories=trajectories,
                 started=t0, seconds=time.time() - t0, **stats))
        return time.time()

    def wanted(self, held: int) -> int | None:
        """--lag, past the last round: the weights of the next evaluation asked for, newer than those `held` (the
        trainer serves them once asked: `wants`); None: none."""
        ahead = [step for step in self.read() if step > held]
        return min(ahead) if ahead else None


class Here:
    """The trainer's end with --searchers 0 (LocalFleet.evals): each evaluation made at once, by the fleet's engine."""

    def __init__(self, fleet):
        self.fleet, self.evaluated = fleet, []

    def request(self, step: int):
        f = self.fleet
        evaluate_here(f.engine, f.model, step, f.cfg, f.data, f.log)
        self.evaluated.append(step)

    def pending(self) -> None:
        return None

    def wait(self, buffer, step: int | None = None):
        return 0.0

    def kept(self):
        """Nothing kept."""


def evaluate_here(engine, weights, step: int, cfg, data, log, made: tuple | None = None):
    """An evaluation in the trainer's process, on the held-out problems, of the weights of step `step`: a model's, as a
    sync sends them (its dtype, tied names too; --searchers 0's), or (name, tensor) pairs kept from it (--evaluator
    after, `made`: when they were). Its time is the trainer's overhead, left out of the run's time as a checkpoint's."""
    t0 = time.time()
    if engine.version != step:
        engine.load(every_name(weights, getattr(torch, cfg.dtype)) if hasattr(weights, "parameters") else weights, step)
    scores, example = engine.evaluate(data.test_prompts, data.test_answers)
    log.eval(step, scores, example, time.time() - t0, made or log.clock())
    log.overhead += time.time() - t0
