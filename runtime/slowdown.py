"""Device time, emulated: the regime TBA is for (generation and training each on devices of their own,
generation dominating), made on a machine that is not in it (tools/bench.py part 9). docs/performance.md says
what each knob does: `--generation-slowdown` (`Clock.step`), `--train-slowdown` (`TrainClock.charge`),
`--calibration` (`read_calibration`; a colocated run's `devices` and `all_reduce`: no factor says a GPU-shaped
step over D devices, a + b x r / D), `--decode-cost` and `--decode-shape` (`per_sequence`),
`--response-lengths` (`Tails`). Work no device pays for (pi_ref's log-probs, the rewards, the weights' reload)
is not slowed (`Clock.apart`, the rows' `uncharged`); real compute longer than its charge is over budget
(`over`): a comparison of such runs measures the CPU, not the schedule.
"""

import contextlib
import json
import math
import os
import time

import numpy as np

from runtime import seeds
from runtime.errors import ConfigError

# `--decode-cost gpu`: a decoding step costs a + b x its running sequences. Fitted: b / a = 0.016 for Llama-2-7B on an
# H100 with vLLM, median inter-token latency 10.8 ms at 1 sequence to 51.9 ms at 239 (Recasens et al., "Mind the
# Memory Gap", arXiv 2503.08311; their results in github.com/FerranAgulloLopez/vLLMBatchingMemoryGap, fitted within
# 3%; OPT-1.3B 0.024, Llama-2-13B 0.013).
GPU_PER_SEQUENCE = 0.016
# A memory-bound decoding step reads the weights once (a) and each sequence's KV cache (b): `per_sequence` scales
# the fit by the KV cache's bytes a token over the weights' bytes. Shapes from each model's config.json.
GPU_SHAPES = {
    "llama-2-7b": dict(layers=32, kv_heads=32, head_dim=128, params=6.74e9),  # full multi-head attention: the fit's
    "rho-math-1b": dict(layers=22, kv_heads=4, head_dim=64, params=1.10e9),   # the paper's GSM8K model (GQA)
    "qwen2.5-7b": dict(layers=28, kv_heads=4, head_dim=128, params=7.62e9),   # run_math.sh's (GQA)
}


def per_sequence(shape: str) -> float:
    """b / a of a decoding step of the model `shape` (GPU_SHAPES): the fit for Llama-2-7B, times the KV
    cache's bytes a token over the weights' bytes against Llama-2-7B's (rho-math-1b: 0.0042, a step 3.8x
    flatter; Qwen2.5-7B: 0.0015). Both in the same dtype: it cancels."""
    kv_per_weight = lambda m: 2 * m["layers"] * m["kv_heads"] * m["head_dim"] / m["params"]  # K and V, a token
    return GPU_PER_SEQUENCE * kv_per_weight(GPU_SHAPES[shape]) / kv_per_weight(GPU_SHAPES["llama-2-7b"])
# `--response-lengths gsm8k`: quantiles (0, 5, ..., 100%) of a real model's GSM8K answer lengths over their median:
# the 1,319 test answers of OpenAI's fine-tuned 6B model (github.com/openai/grade-school-math,
# grade_school_math/data/example_model_solutions.jsonl, "6b_finetuning"), in words and punctuation (median 89)
GSM8K_TAIL = (0.281, 0.506, 0.573, 0.64, 0.708, 0.753, 0.798, 0.843, 0.899, 0.944, 1.0, 1.056, 1.124, 1.199, 1.27,
              1.36, 1.449, 1.562, 1.708, 1.989, 4.135)


def slow_down(generate: float, alone: float, factor: float, limit: float = math.inf) -> float:
    """After a generation that took `generate` s and would have taken `alone` s on an engine of its own, sleep
    until `factor` x `alone` has passed. Charging the cost alone, not the time taken, keeps searchers that
    share a few CPU cores from multiplying that contention by `factor`: on a GPU node they share nothing. A
    sleep longer than `limit` (--timeout) is a fault, not a wait: TimeoutError. Returns the seconds slept."""
    seconds = factor * alone - generate if factor != 1 else 0.0
    if seconds > limit:
        raise TimeoutError(f"an emulated step of {factor * alone:.3g} s ({factor:g} x its cost alone, {alone:.3g} s) "
                           f"is longer than --timeout {limit:g}: lower the slowdown")
    if seconds > 0:
        time.sleep(seconds)
    return max(0.0, seconds)


class Clock:
    """The emulated device time of one process's engine (--generation-slowdown X; docs/performance.md): each
    decoding step (`step`) lasts X times its cost alone (`alone`; over a colocated run's `devices`), sleeping
    the rest; a generation in vLLM's own loop (`took`) is only counted (`account`)."""

    def __init__(self, factor: float, seconds_per_token: float | None = None, shape: str = "linear", full: int = 1,
                 limit: float = math.inf, model: str = "rho-math-1b", devices: int = 1):
        self.factor, self.seconds_per_token, self.shape, self.limit = factor, seconds_per_token, shape, limit
        self.full, self.devices, self.emulated = max(1, full), devices, factor != 1
        self.b = per_sequence(model)  # b / a of a decoding step, with --decode-cost gpu
        self.generate = self.slept = self.charged = self.over = 0.0
        self.uncharged = {}  # part -> seconds of work no device pays for (`apart`)
        if not self.emulated:  # no device pays for anything: no work is timed apart
            self.apart = contextlib.nullcontext

    def alone(self, running: int) -> float:
        """A decoding step's cost alone: each of its sequences' share (linear), or as on a GPU a fixed part
        and a small part a sequence, equal to linear's at a whole batch of `full` sequences (gpu: B x n, the
        same for every number of searchers, so that a searcher running N times the sequences is not charged N
        times for them). Over `devices`, the slowest device's: a share of ceil(running / D) sequences each, as
        evenly as they can be spread (a colocated run's best case), the fixed part each device's."""
        running = -(-running // self.devices)
        if self.shape == "gpu":
            return self.seconds_per_token * self.full * (1 + self.b * running) / (1 + self.b * self.full)
        return self.seconds_per_token * running

    def round_alone(self, lengths) -> float:
        """A round's cost alone: responses of these decoding steps, all begun together, each step costing
        `alone` of the responses still running (a round waits for its longest, as with --response-lengths)."""
        lengths = np.sort(np.asarray(lengths, dtype=int))
        steps = np.arange(lengths[-1]) if len(lengths) else np.arange(0)
        return float(sum(self.alone(int(len(lengths) - np.searchsorted(lengths, t, side="right"))) for t in steps))

    @contextlib.contextmanager
    def apart(self, part: str):
        """Time a block of work that no emulated device pays for (a weight reload and its check, ...): counted
        in `account()`'s `uncharged`, never slept."""
        t0 = time.time()
        try:
            yield
        finally:
            self.uncharged[part] = self.uncharged.get(part, 0.0) + time.time() - t0

    def step(self, seconds: float, running: int):
        """One decoding step took `seconds` and ran `running` sequences (emulated ones too)."""
        self.generate += seconds
        if not (self.emulated and self.seconds_per_token):  # off, or calibrating
            self.charged += seconds
            return
        alone = self.alone(running)
        self.charged += self.factor * alone
        self.over += max(0.0, seconds - self.factor * alone)
        self.slept += slow_down(seconds, alone, self.factor, self.limit)

    def took(self, seconds: float):
        """A generation in vLLM's own loop took `seconds` (not emulated)."""
        self.generate, self.charged = self.generate + seconds, self.charged + seconds

    def account(self) -> dict:
        """The seconds since the last call, and the calibration; then from zero again."""
        out = dict(generate=self.generate, slept=self.slept, charged=self.charged, over=self.over,
                   seconds_per_token=self.seconds_per_token, uncharged=self.uncharged)
        self.generate, self.slept, self.charged, self.over, self.uncharged = 0.0, 0.0, 0.0, 0.0, {}
        return out


def tail(seed: tuple) -> float:
    """--response-lengths gsm8k: a response's emulated decoding steps over its real ones, a draw from
    GSM8K_TAIL (interpolated between its quantiles), reproducible from the response's seed."""
    u = np.random.default_rng([*seed, seeds.TAILS]).random()
    return float(np.interp(u, np.linspace(0, 1, len(GSM8K_TAIL)), GSM8K_TAIL))


class Tails:
    """--response-lengths gsm8k: runtime/decoding.Stepped's slots, each response a request of its own, held in
    its slot after vLLM finished it until its emulated decoding steps have passed (its real ones x `tail`), so
    that a round waits for its slowest response as on a GPU. The emulated steps change no token."""
    single = True

    def __init__(self, engine):
        self.engine, self.steps = engine, 0
        self.added = {}  # request id -> (its first step, its emulated length over its real one)
        self.held = {}   # request id -> (its output, the step it leaves its slot at)

    def admit(self, request_id: str, seed: tuple):
        self.added[request_id] = (self.steps, tail(seed))

    def leave(self, finished: list) -> list:
        """After a decoding step: the requests whose emulated steps have passed."""
        self.steps += 1
        for out in finished:
            start, stretch = self.added.pop(out.request_id)
            length = len(out.outputs[0].token_ids)
            self.held[out.request_id] = (out, start + max(length, round(length * stretch)))
        return [self.held.pop(k)[0] for k, (_, end) in list(self.held.items()) if end <= self.steps]

    def running(self) -> int:
        return self.engine.get_num_unfinished_requests() + len(self.held)

    def busy(self) -> bool:
        return self.engine.has_unfinished_requests() or bool(self.held)


class TrainClock:
    """--train-slowdown Y: a training step lasts Y times its cost alone (the calibration's, or the median of
    the run's first CALIBRATION_STEPS steps, run unslowed; a colocated one's / D, plus the all-reduce),
    sleeping the rest (`charge`). `ended`: when the last charge ended (its weights leave after it)."""
    CALIBRATION_STEPS = 3

    def __init__(self, factor: float, seconds: float | None = None, limit: float = math.inf, devices: int = 1,
                 all_reduce: float = 0.0):
        self.factor, self.seconds, self.limit = factor, seconds, limit
        self.devices, self.all_reduce = devices, all_reduce  # a colocated run's (`read_calibration`)
        self.first = []  # the first steps' seconds, while calibrating
        self.slept = self.charged = self.over = 0.0
        self.ended = None

    def charge(self, seconds: float) -> float:
        """A training step took `seconds` of compute: sleep until Y x its cost alone has passed. Returns the
        seconds slept."""
        if self.factor == 1:
            self.ended = time.time()  # (read by the timeline of an emulated generation alone)
            return 0.0
        try:
            if self.seconds is None:
                self.first.append(seconds)
                if len(self.first) == self.CALIBRATION_STEPS:
                    self.seconds = float(np.median(self.first))
                return 0.0
            alone = self.seconds / self.devices + self.all_reduce / self.factor  # charged Y x this
            self.charged += self.factor * alone
            self.over += max(0.0, seconds - self.factor * alone)
            slept = slow_down(seconds, alone, self.factor, self.limit)
            self.slept += slept
            return slept
        finally:
            self.ended = time.time()


MAX_COST = 3600.0  # s: no step of a token or of training is charged an hour


def read_calibration(path: str) -> dict:
    """--calibration: {"seconds_per_token": s a generated token costs one engine alone, "train_step": s a
    training step alone}, plain JSON, and for a colocated run "devices" (a whole number, 1 by default) and
    "all_reduce" (s a step, 0 by default: docs/performance.md); refused in one line if it is not that."""
    if not os.path.isfile(path):
        raise ConfigError(f"--calibration: {path} does not exist")
    try:
        with open(path) as f:
            costs = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--calibration: {path} does not read as JSON ({type(e).__name__})") from None
    for k in ("seconds_per_token", "train_step"):  # (JSON true is an int to Python: not a cost)
        value = costs.get(k) if isinstance(costs, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < MAX_COST:
            raise ConfigError(f"--calibration: {path} must hold positive numbers of seconds below {MAX_COST:g}, "
                              f"seconds_per_token and train_step; {k} is {value!r}")
    devices, all_reduce = costs.get("devices", 1), costs.get("all_reduce", 0.0)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ConfigError(f"--calibration: {path}: devices must be a whole number of devices, 1 or more; it is "
                          f"{devices!r}")
    if isinstance(all_reduce, bool) or not isinstance(all_reduce, (int, float)) or not 0 <= all_reduce < MAX_COST:
        raise ConfigError(f"--calibration: {path}: all_reduce must be seconds, 0 or more and below {MAX_COST:g}; it is "
                          f"{all_reduce!r}")
    return dict({k: float(costs[k]) for k in ("seconds_per_token", "train_step")}, devices=devices,
                all_reduce=float(all_reduce))


def calibrate(engine, count: int, n: int, timed: bool = True):
    """A round of `count` prompts x n on `engine` (searcher.Engine), to warm it up, or (`timed`) to set the
    seconds a generated token costs it warm and (the caller sees to it) alone. Prompts and seeds of their own:
    the run's samples do not change; the prefix cache is emptied around them."""
    cfg, clock = engine.cfg, engine.clock
    rng = np.random.default_rng([cfg.seed, seeds.CALIBRATION])
    ids = rng.choice(len(engine.prompts), min(count, len(engine.prompts)), replace=False)
    engine.llm.reset_prefix_cache()
    clock.account()  # a plain round, stepped, whatever the run's decoder (--response-lengths: its tails left out)
    done = engine.generate(ids, n, (cfg.seed, seeds.CALIBRATION, seeds.CALIBRATION, int(timed)), plain=True)
    seconds = clock.account()["generate"]
    engine.llm.reset_prefix_cache()
    if timed:
        clock.seconds_per_token = seconds / max(1, sum(len(c.token_ids) for _, cs in done for c in cs))


def calibrate_alone(engine, calibration, cfg, alive):
    """--generation-slowdown without --calibration (else nothing): a warm-up round (`calibrate`), then, once
    every engine of this node has warmed up (or --start-timeout has passed), the timed round one engine at a
    time, each alone as on a device of its own. `calibration`: (this node's warm engines, a lock that lets one
    time itself); `alive()` raises if the trainer is gone."""
    from runtime.weights import acquire
    if not engine.clock.emulated or engine.clock.seconds_per_token:
        return
    started, lock = calibration
    calibrate(engine, cfg.round_prompts, cfg.search_samples_per_prompt, timed=False)
    with started.get_lock():
        started.value += 1
    deadline = time.time() + cfg.start_timeout
    while started.value < cfg.searchers and time.time() < deadline:
        time.sleep(0.05)
        alive()
    acquire(lock, alive, cfg.start_timeout)
    try:
        calibrate(engine, cfg.round_prompts, cfg.search_samples_per_prompt)
    finally:
        lock.release()
