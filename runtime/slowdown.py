"""--generation-slowdown X: the generation-bound regime TBA is for, emulated on a machine that is not in it
(tools/bench.py part 9, docs/performance.md).

Each engine times one search round alone at start, warm, as seconds per generated token (`calibrate`;
the engines of a node warm up side by side, then time one at a time: `calibrate_alone`). After
generating a round, the process (a searcher, or the synchronous trainer) sleeps until X times that cost
of the round's tokens has passed (`slow_down`), as a model X times as slow to sample would take on a
device of its own. Sleeping uses no core, so N searchers share the CPU cores as they would share
nothing on a GPU node; pi_ref's log-probs and the rewards are not slowed.
"""

import time

import numpy as np

from runtime import seeds


def slow_down(generate: float, alone: float, factor: float) -> float:
    """After a generation that took `generate` s and would have taken `alone` s on an engine of its own,
    sleep until `factor` x `alone` has passed. Charging the cost alone, not the time taken, keeps searchers
    that share a few CPU cores from multiplying that contention by `factor`: on a GPU node they share
    nothing. Returns the seconds slept."""
    seconds = factor * alone - generate if factor != 1 else 0.0
    if seconds > 0:
        time.sleep(seconds)
    return max(0.0, seconds)


class Clock:
    """The emulated device time of one process's engine (--generation-slowdown X): each decoding step (`step`) lasts X
    times its cost alone, `seconds_per_token` (calibrated) x the sequences it runs, sleeping the rest; a whole
    generation in vLLM's own loop (`took`) is only counted. `account()` gives the seconds since the last call, for
    the round's message: generating, slept, and charged in all (X x the cost alone; the time taken, unslowed)."""

    def __init__(self, factor: float, seconds_per_token: float | None = None):
        self.factor, self.seconds_per_token = factor, seconds_per_token
        self.emulated = factor != 1
        self.generate = self.slept = self.charged = 0.0

    def step(self, seconds: float, running: int):
        """One decoding step took `seconds` and ran `running` sequences."""
        self.generate += seconds
        if not (self.emulated and self.seconds_per_token):  # off, or calibrating
            self.charged += seconds
            return
        alone = running * self.seconds_per_token
        self.charged += self.factor * alone
        self.slept += slow_down(seconds, alone, self.factor)

    def took(self, seconds: float):
        """A generation in vLLM's own loop took `seconds` (not emulated)."""
        self.generate += seconds
        self.charged += seconds

    def account(self) -> dict:
        """The seconds since the last call (generate, slept, charged) and the calibration, then from zero again."""
        out = dict(generate=self.generate, slept=self.slept, charged=self.charged,
                   seconds_per_token=self.seconds_per_token)
        self.generate = self.slept = self.charged = 0.0
        return out


def calibrate(engine, count: int, n: int, timed: bool = True):
    """A round of `count` prompts x n on `engine` (searcher.Engine), to warm it up, or (`timed`) to set the
    seconds a generated token costs it, warm and (the caller sees to it) alone. Prompts and seeds of their
    own: the run's samples do not change; the prefix cache is emptied around them."""
    cfg, clock = engine.cfg, engine.clock
    rng = np.random.default_rng([cfg.seed, seeds.CALIBRATION])
    ids = rng.choice(len(engine.prompts), min(count, len(engine.prompts)), replace=False)
    engine.llm.reset_prefix_cache()
    clock.account()
    done = engine.generate(ids, n, (cfg.seed, seeds.CALIBRATION, seeds.CALIBRATION, int(timed)))
    seconds = clock.account()["generate"]
    engine.llm.reset_prefix_cache()
    if timed:
        clock.seconds_per_token = seconds / max(1, sum(len(c.token_ids) for _, cs in done for c in cs))


def calibrate_alone(engine, calibration, cfg, alive):
    """--generation-slowdown (else nothing): `calibrate`: a warm-up round, then, once every engine of this node has
    started and warmed up (or --timeout has passed), the timed round one engine at a time: each is timed alone, as
    on a device of its own, not sharing the cores with the others' start-up or calibration. `started` counts this
    node's warm engines, `lock` lets one time itself (`calibration`: the two); `alive()` raises if the trainer is
    gone."""
    from runtime.weights import acquire
    if not engine.clock.emulated:
        return
    started, lock = calibration
    calibrate(engine, cfg.round_prompts, cfg.search_samples_per_prompt, timed=False)
    with started.get_lock():
        started.value += 1
    deadline = time.time() + cfg.timeout
    while started.value < cfg.searchers and time.time() < deadline:
        time.sleep(0.05)
        alive()
    acquire(lock, alive, cfg.timeout)
    try:
        calibrate(engine, cfg.round_prompts, cfg.search_samples_per_prompt)
    finally:
        lock.release()
