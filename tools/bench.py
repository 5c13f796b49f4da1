"""What asynchrony buys, measured on the machine at hand: one script for a CPU laptop or a GPU node.

    python tools/bench.py                        # parts 1-5 (about 10 min on 2 CPU cores)
    python tools/bench.py --seeds 0 --cap 120    # a smaller budget
    python tools/bench.py --quick                # a tiny budget: checks that it runs, numbers mean little
    python tools/bench.py --parts 9 --out runs/b9                 # part 9's plan (hours: it says how many first)
    python tools/bench.py --table runs/b9/part9.json              # its table again, from the seeds' figures alone
    python tools/bench.py --full --out runs/bench                # whole runs (docs/performance.md's figures) ...
    python tools/plot.py runs/bench/seed0-searchers1 runs/bench/seed0-searchers0 runs/bench/seed0-trl   # ... as curves
    python tools/plot.py --study runs/bench/bench.json           # part 7's study as a picture

It prints a table and writes OUT/bench.json (default OUT: runs/bench-<time>):
1. time to target: the embedded default (`tba.py`, the toy task) with --searchers 1 (TBA) and
   --searchers 0 --lag 0 ("sync": one process, the on-policy synchronous baseline, each step's batch searched
   by its own weights; the flags after `--` that act only streaming are left out of it), same seed, flags and
   cores, each until held-out greedy accuracy first reaches its start + 0.15 or the time cap; both times and
   sync / async per seed, and the median ratio over the seeds with its 90% interval (a bootstrap of the seeds).
   Time counts from the launch of the process, minus the time the trainer spent evaluating (the
   baseline evaluates inside the trainer, TBA in searcher 0) and checkpointing; it is also given
   from the start of the first training step (start-up, mostly importing vLLM and starting its
   engine, left out), with the seconds per step of each mode.
2. trainer utilisation of the TBA runs: the fraction of the trainer's wall time, from its first step
   to its last, less evaluations and checkpoints, spent in its steps but not waiting for data or a weight sync.
3. weight-sync cost: seconds per sync (publish on the trainer, reload into vLLM, prefix-cache reset)
   against one plain `copy_` of the same bytes, for the tiny model and a ~100M-parameter Llama.
4. searcher overhead: trajectories/s and tokens/s of a search round (vLLM sampling, rewards, pi_ref's
   log-probs) against the same vLLM engine generating the same prompts with nothing around it.
5. trainer overhead: training tokens/s of a TB update (collate, log-probs, TB loss, backward, clip,
   optimizer) against a bare forward+backward of the same model on the same batch.
6. (only with --parts 6) memory: resident memory summed over all processes of a TBA run of
   --minutes (20), sampled every 10 s: growth after the first 5 minutes.
7. (only with --parts 7) off-policy robustness, the paper's Table 1 in miniature: for each loss
   (tb, rloo, grpo) and staleness (0, 4, 15 steps), one-process runs (--searchers 0) that sync
   every step and train on each step's own rounds only, each trajectory once (--lag L), generated with the
   weights of L steps before, so that every batch is exactly that stale (L = 0: the on-policy synchronous run);
   the held-out accuracy at the end (mean of the last 3 evaluations), the best, and whether the run collapsed
   (ended below its start).
   Same learning rate, beta, steps and batch for every loss (tba.py's defaults and --flags).
8. (only with --parts 8) TRL's GRPOTrainer on the same setup (`trl_grpo.py`: the model, prompts,
   held-out problems, B x K, temperature, length, steps and lr decay of tba.py's flags; accuracy
   measured the same way; the arith task only), per seed:
   seconds from launch to start + 0.15 and start + 0.25, and accuracy after all steps. TRL is not a
   dependency: it runs in a virtual environment of its own, --trl-python PATH or one made once in
   $TBA_CACHE/trl-venv (about a minute); the part is skipped, in one line and without tba.py's runs
   for it, when that cannot be done.
9. (only with --parts 9; hours on 2 CPU cores) asynchrony on equal hardware, emulated: the regime TBA is for, both
   phases on devices of their own, made on any machine (runtime/slowdown.py): each decoding step of a searcher takes
   X times its cost alone (--generation-slowdown), each training step Y times its own (--train-slowdown), sleeping
   the rest, from costs measured once on one idle core (`calibrate_costs`, handed to every run: --calibration).
   The plan (`part9_plan`, its estimated time said first): for the most of --searchers N, the main point G_N / T = 2
   (the first of --ratios; the paper's balance for rho-math-1b on GSM8K on an H100), GPU-shaped decoding with GSM8K's
   long tail (--decoding), on every seed (--seeds, 0-9), then the other --ratios (1, 4) on the first --few-seeds (3),
   and the fewest searchers streaming at the main point's X and Y (the scaling, paired by seed). Every mode of
   --modes (MODES) per seed: --lag 0 on the N searchers first (the synchronous baseline with rollout workers of
   their own), the colocated run (--searchers 0 --lag 0 on N + 1 emulated devices: each generates its share of the
   batch, then each trains its share, data-parallel, the gradients' all-reduce charged (`all_reduce_share`), the
   new weights reloaded into the engine after each step), one-step off-policy (--lag 1) and streaming (the default).
   Per run: throughput (steps a second) apart from learning (steps to start + --gain, 0.15, evaluations every
   --eval-every 2), seconds to it from launch and from the first step, interpolated between the two evaluations
   around the crossing, the mean held-out accuracy from the first step to the same seed's --lag 0 run's end (or
   --horizon seconds), accuracy at the --lag 0 run's time, G, T, the publish, a searcher's own cycle and the bound
   (G + T) / max(cycle, T + publish) on throughput, the work no device pays for (reloads, scoring, pi_ref) a round,
   the CPU used, and each process's real compute over its own charge with that work (a mode with one over by 10% is
   CPU-bound: no speed-up given). Per cell, each mode's speed-up over the colocated run and over --lag 0 (the median
   of the seeds' paired ratios) and gain in mean accuracy, each with a 90% bootstrap interval over the seeds; which
   pairs of modes the seeds resolve, each interval at a level corrected for the cell's pairs (Bonferroni); the
   scaling with its interval. The trainer keeps each evaluation's weights and evaluates them after the last step
   (--evaluator after; the colocated run evaluates in its one process, its time left out), so that no evaluation
   disturbs a mode. Written: OUT/bench.json, OUT/part9.json (each run's figures the table is computed from:
   `python tools/bench.py --table OUT/part9.json` prints it again, `--doc docs/performance.md` puts it there) and
   OUT/equal_hardware.png (`python tools/plot.py --slowdown OUT/bench.json`). --slowdowns X adds points of X alone,
   each run calibrating itself (CPU packing, as measured before). The measured task is tba.py's: `-- --task
   countdown --steps 120 --decay-steps 20` with --gain 0.1 measures a longer, slower curve than arith's (start + 0.1
   near step 70, at the learning rate of its 200-step default).
10. (only with --parts 10) fresher data per step, in that regime (X = 10) with 1, 2 and 4 searchers:
   time to start + 0.15 with the defaults and with one lever changed at a time (a round of B prompts
   or of half the default B / N, k = 2, m = 0.5, R = 2), against the one-process run (--searchers 0, which
   replays the buffer as the searchers' runs do: m = 0.95).
11. (only with --parts 11) a search round's cost against its size: one searcher's engine in this process,
   generating and searching rounds of 1 to 64 prompts x K, warm; a fixed cost and a cost per prompt.
12. (only with --parts 12) TBA′ against Dr. GRPO as staleness grows, the paper's MATH comparison in
   miniature on the toy: --loss tbprime (beta 0.005, pi_ref reset every 50 steps) and --loss drgrpo, one
   searcher, at the exact --lag L for L in --lags (0, 2, 10), per seed, each to its end.
Parts 3-5 and 11 run in this process with the thread count a process gets in a TBA run with one searcher,
on the devices a run would use: on a GPU node the trainer's GPU 0 and the first searcher's GPU 1.

Each run starts in a session of its own; Ctrl-C, SIGTERM (`timeout`) or SIGHUP kills the whole process group of
every run bench.py started, then it exits 128 + the signal in one line (a second signal: at once). --costs is
checked before anything starts (one line, status 2); calibration.json and bench.json are written whole or not at all.
Earlier results are never replaced unasked: an --out that holds anything is refused in one line (status 2) unless
--overwrite, and so is an unknown part.
"""

import argparse
import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root, above tools/
sys.path.insert(0, ROOT)  # for tba, searcher, ... when run as `python tools/bench.py`

from runtime import vllm_env

vllm_env.set_up()  # before torch and vLLM are imported: they read it at import

import numpy as np
import torch

import plot  # reads run folders (matplotlib only when drawing)
from runtime import checks
from runtime import ranks
from runtime import policy
import tba
from runtime.config import Config
from runtime import weights
from buffer import Trajectory
from loss import LOSSES, collate
from searcher import Engine


def read_text(path: str) -> str:
    with open(path) as f:
        return f.read()


def write_json(path: str, value):
    """Write `value` to `path` whole or not at all (a temporary file beside it, then os.replace): a bench stopped
    or failing mid-write leaves no empty or half file that a later --costs or plot.py would read."""
    fd, part = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=os.path.basename(path) + ".")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(value, f, indent=1)
        os.replace(part, path)
    finally:
        if os.path.exists(part):
            os.remove(part)


class BadInput(Exception):
    """A flag or file bench.py refuses before it starts anything: one line, status 2."""


PARTS = range(1, 13)


def check_out(out: str, overwrite: bool):
    """Earlier results are never replaced unasked: an --out that holds anything (a bench.json, a part's runs) is
    refused unless --overwrite (then each run folder goes just before its run again: `vacated`)."""
    if os.path.lexists(out) and not os.path.isdir(out):
        raise BadInput(f"--out {out} is a file: pass a folder")
    held = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if held and not overwrite:
        raise BadInput(f"--out {out} already holds results ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}): "
                       f"pass a new folder, or --overwrite to replace them")
    try:  # (an empty folder on a read-only disk: its first write would fail after the runs)
        os.makedirs(out, exist_ok=True)
        os.close(os.open(os.path.join(out, ".write-test"), os.O_CREAT | os.O_WRONLY))
        os.remove(os.path.join(out, ".write-test"))
    except OSError as e:
        raise BadInput(f"--out {out}: cannot be written ({e.strerror})") from None


def vacated(run: str) -> str:
    """A run's folder, emptied of an earlier bench's run there (--overwrite: tba.py refuses an --out that holds one)."""
    shutil.rmtree(run, ignore_errors=True)
    return run


# --- stopping: every run bench.py started stops with it ----------------------------------------------------
class Stopped(KeyboardInterrupt):
    """SIGTERM, SIGHUP or SIGINT, raised wherever bench.py is (as Ctrl-C's KeyboardInterrupt), so that the `finally:`
    blocks stop the runs it started; a KeyboardInterrupt, so that no `except Exception` swallows it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


RUNNING: dict[int, subprocess.Popen] = {}  # pid -> a process started by `start` (a session of its own), not yet stopped
SIGNALLED = dict(signum=None, spawning=False)  # the first signal; whether `start` is between fork and RUNNING


def on_signal(signum, frame):
    """The first signal raises Stopped (held back while `start` registers a process it has just forked, so that no
    run escapes RUNNING); a second kills every run at once and exits."""
    if SIGNALLED["signum"] is not None:
        kill_all()
        os._exit(128 + signum)
    SIGNALLED["signum"] = signum
    if not SIGNALLED["spawning"]:
        raise Stopped(signum)


def start(cmd: list[str], log) -> subprocess.Popen:
    """Start `cmd` in a session of its own (its trainer, searchers and fork server are one process group, which a
    signal to bench.py alone does not reach) with its output to `log`; `stop` ends it."""
    SIGNALLED["spawning"] = True
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        RUNNING[proc.pid] = proc
    finally:
        SIGNALLED["spawning"] = False
    if SIGNALLED["signum"] is not None:  # it came while forking: raised now, the process registered
        raise Stopped(SIGNALLED["signum"])
    return proc


def stop(proc: subprocess.Popen, grace: float = 0.0):
    """Kill the whole process group `start` made for `proc` (whatever of it is left, even after the leader's own
    exit) and reap the leader. `grace`: a run still going is first asked to stop (SIGTERM: tba.py writes a checkpoint
    and makes the evaluations it kept, --evaluator after's, whose rows part 9 reads) and given that many seconds."""
    if grace and proc.poll() is None and SIGNALLED["signum"] is None:  # (a signal to bench.py: no grace)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # every process of it has exited already
        pass
    proc.wait()
    RUNNING.pop(proc.pid, None)


def kill_all():
    """SIGKILL to every process group still in RUNNING, without waiting (a second signal: at once)."""
    for pid in list(RUNNING):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_to_end(cmd: list[str], log_path: str, timeout: float | None = None, mode: str = "w") -> int:
    """`cmd` (`start`ed, its output written or, `mode` "a", added to `log_path`) to its end; its exit status. Its
    whole process group is killed on the way out, however bench.py leaves (a signal, subprocess.TimeoutExpired
    after `timeout`)."""
    with open(log_path, mode) as log:
        proc = start(cmd, log)
    try:
        return proc.wait(timeout=timeout)
    finally:
        stop(proc)


def picture(bench_json: str, png: str):
    """Part 9's picture, or one line saying why there is none: the numbers are complete in bench.json
    without it, and `python tools/plot.py --slowdown BENCH_JSON` draws it later."""
    try:
        plot.equal_hardware([bench_json], png)
    except plot.NoMatplotlib as e:
        print(f"9. picture skipped: {e}; `python tools/plot.py --slowdown {bench_json}` draws it later", flush=True)
    except plot.BadRun as e:  # nothing to draw (only --slowdowns points): the table says it all
        print(f"9. picture skipped: {e}", flush=True)


def curves_picture(eh: dict, png: str):
    """Part 9's main cell from part9.json's rows (`--table FILE --picture PNG`): left, each run's held-out accuracy
    against seconds from its first round (thin), each mode's mean over its seeds (thick), the target and the horizon
    dashed; right, each seed's speed-up over the colocated run to the target (dots) and the geometric mean with its
    t interval (`t_interval`). One line instead where matplotlib is missing."""
    try:
        plt = plot.pyplot()
    except plot.NoMatplotlib as e:
        print(f"9. picture skipped: {e}", flush=True)
        return
    rows = [r for r in eh["rows"] if r["ratio"] and r.get("evals")]
    main = (rows[0]["searchers"], rows[0]["ratio"]) if rows else None
    rows = [r for r in rows if (r["searchers"], r["ratio"]) == main]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, (acc, up) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw=dict(width_ratios=[2, 1]))
    grid = np.linspace(0, eh["horizon"], 200)
    for i, mode in enumerate(modes):
        mine = [r for r in rows if r["mode"] == mode]
        curves = [np.interp(grid, *zip(*[(t - r["first_round"], a) for t, _, a in r["evals"]])) for r in mine]
        for c in curves:
            acc.plot(grid, c, color=f"C{i}", alpha=0.2, linewidth=0.8)
        acc.plot(grid, np.mean(curves, axis=0), color=f"C{i}", linewidth=2, label=f"{mode} ({len(mine)} seeds)")
        if mode != "colocated" and "colocated" in modes:
            ups = paired([r for r in rows if r["mode"] == "colocated"], mine)[0]
            mid, ci = t_interval(ups, log=True)
            up.plot([i] * len(ups), ups, "o", color=f"C{i}", alpha=0.4)
            if ci:
                up.errorbar([i], [mid], yerr=[[mid - ci[0]], [ci[1] - mid]], fmt="s", color=f"C{i}", capsize=4)
    start = np.median([r["evals"][0][2] for r in rows]) if rows else 0
    acc.axhline(start + eh["gain"], color="gray", linestyle="--", linewidth=0.8, label=f"start + {eh['gain']:g}")
    acc.set(xlabel="seconds from the run's first generation round", ylabel="held-out accuracy",
            title=f"N {main and main[0]} searchers, G/T {main and main[1]:g}: every run {eh['horizon']:g} s")
    acc.legend(fontsize=8)
    up.axhline(1, color="gray", linewidth=0.8, linestyle=":")
    up.set_xticks(range(len(modes)), modes)
    up.set(ylabel=f"speed-up over colocated to start + {eh['gain']:g} (x)", title="seeds; geometric mean, 90% t interval")
    for ax in (acc, up):
        ax.grid(alpha=0.3)
    plot.save(fig, png)


def timed(fn, repeat: int) -> float:
    """Median seconds of fn() over `repeat` runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


# --- 1 and 2: time to target, trainer utilisation ---------------------------------------------
def at_least(accuracy: float, level: float) -> bool:
    """accuracy >= level, where accuracies are fractions of a count of problems: a tolerance keeps
    0.24 + 0.15 from missing 0.39 by float rounding."""
    return accuracy >= level - 1e-9


def run_until_target(searchers: int, seed: int, cap: float, out: str, flags: list[str], full: bool,
                     gain: float = 0.15, until: float = 0.0, horizon: float | None = None) -> dict:
    """Launch tba.py; stop it when an evaluation reaches start + `gain` (unless `full`) and `until` seconds have
    passed (from launch, less the trainer's overhead), or with a `horizon`, when that many seconds have passed from
    its first generation round (`first_round`), whatever its accuracy; or at the time cap. Its processes' CPU
    seconds are summed."""
    cmd = [sys.executable, os.path.join(ROOT, "tba.py"), "--searchers", str(searchers), "--seed", str(seed),
           "--out", vacated(out), *flags]
    launched = time.time()
    with open(out + ".log", "w") as log:  # the run's console, beside its folder (the run keeps its own copy)
        proc = start(cmd, log)
    metrics = os.path.join(out, "metrics.jsonl")

    def read():
        text = read_text(metrics) if os.path.exists(metrics) else ""
        # complete lines only: the run may be writing its last line while we read
        rows = plot.latest([json.loads(line) for line in text.split("\n")[:-1]])  # a resumed run: its latest branch
        evals = [r for r in rows if r["kind"] == "eval"]
        return rows, next((e for e in evals[1:] if at_least(e["accuracy"], evals[0]["accuracy"] + gain)), None)

    rows, hit, cpu = [], None, {}
    offset_of = lambda: json.loads(read_text(os.path.join(out, "config.json")))["started"] - launched
    late = lambda: rows and offset_of() + rows[-1]["time"] - rows[-1]["overhead"] < until
    going = lambda: hit is None or full or late()
    if horizon is not None:  # the same window for every mode, from its first round: no run stops at its target
        going = lambda: first_round(rows) is None or rows[-1]["time"] - rows[-1]["overhead"] < first_round(rows) + horizon
    try:
        while going() and time.time() - launched < cap and proc.poll() is None:
            time.sleep(0.5)
            if SIGNALLED["signum"] is not None:  # its Stopped raised inside a finalizer, which swallowed it
                raise Stopped(SIGNALLED["signum"])
            rows, hit = read()
            cpu.update(cpu_seconds(proc.pid))
    finally:
        stop(proc, grace=GRACE)  # the whole run: trainer and searchers, its kept evaluations made first
    rows, hit = read()
    if not rows:
        raise RuntimeError(f"tba.py produced no metrics: {read_text(out + '.log')[-2000:]}")
    if horizon is not None and first_round(rows) is not None:  # what the horizon holds: a step past it, no more
        end = first_round(rows) + horizon
        rows = [r for r in rows if r["kind"] != "eval" or r["time"] - r["overhead"] <= end]
        hit = next((e for e in [r for r in rows if r["kind"] == "eval"][1:]
                    if at_least(e["accuracy"], [r for r in rows if r["kind"] == "eval"][0]["accuracy"] + gain)), None)
    started = json.loads(read_text(os.path.join(out, "config.json")))["started"]
    offset = started - launched  # imports, flag checks, tiny-model cache lookup

    def clock(row):  # seconds since launch, without the trainer's evaluation and checkpoint time
        return offset + row["time"] - row["overhead"]

    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    work = [r["seconds"] - r["wait"] - r["sync"] for r in train[1:]]  # (an evaluation's hold is wait and overhead)
    span = train[-1]["time"] - train[0]["time"] - (train[-1]["overhead"] - train[0]["overhead"]) if len(train) > 1 else 0
    return dict(
        searchers=searchers, seed=seed, reached=hit is not None,
        seconds=clock(hit) if hit else None, step=hit["step"] if hit else None,
        start_accuracy=evals[0]["accuracy"], target=evals[0]["accuracy"] + gain,
        first_step_seconds=clock(train[0]) - train[0]["seconds"] + train[0]["wait"] if train else None,
        last_step_seconds=clock(train[-1]) if train else None,
        seconds_per_step=span / (len(train) - 1) if len(train) > 1 else None,
        utilisation=sum(work) / span if span > 0 else None,
        curve=[(clock(e), e["step"], e["accuracy"]) for e in evals], cpu=sum(cpu.values()),
        first_round=offset + first_round(rows) if first_round(rows) is not None else None,
    )


def first_round(rows: list[dict]) -> float | None:
    """When a run's first generation round began, seconds in the run's time less the trainer's overhead (its train
    rows' `rounds`: each round's start, a searcher's or the one process's own; the overhead, the colocated run's
    evaluation of step 0 in its process, is the first train row's), or None before any: every mode's time counts from
    it (before, the colocated run's clock counted its first round and the others' did not)."""
    train = [row for row in rows if row["kind"] == "train"]
    starts = [r[2] for row in train for r in row.get("rounds") or []]
    return min(starts) - train[0]["overhead"] if starts else None


def cpu_seconds(pid: int) -> dict:
    """{pid: CPU seconds so far} of a process and its descendants (those gone keep their last reading)."""
    import psutil
    out = {}
    try:
        tree = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return out
    for p in tree:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system + t.children_user + t.children_system
        except psutil.NoSuchProcess:
            pass
    return out


# --- 6: memory of a long TBA run ----------------------------------------------------------------------
def memory_growth(minutes: float, out: str, flags: list[str]) -> dict:
    """Resident memory summed over every process of an async run, sampled every 10 s."""
    import psutil
    cmd = [sys.executable, os.path.join(ROOT, "tba.py"), "--steps", str(10**9), "--eval-every", "0", "--out",
           vacated(out), *flags]
    with open(out + ".log", "w") as log:
        proc = start(cmd, log)
    t0, samples = time.time(), []
    try:
        while time.time() - t0 < minutes * 60 and proc.poll() is None:
            time.sleep(10)
            tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
            rss = 0
            for p in tree:
                try:
                    rss += p.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
            samples.append((time.time() - t0, rss / 2**20, len(tree)))
    finally:
        stop(proc)
    at5 = next(m for t, m, _ in samples if t >= min(300, minutes * 60 / 4))
    steps = max((json.loads(line)["step"] for line in read_text(os.path.join(out, "metrics.jsonl")).splitlines()
                 if '"train"' in line), default=0)
    return dict(minutes=minutes, mib_at_5_min=at5, mib_at_end=samples[-1][1], mib_peak=max(m for _, m, _ in samples),
                growth_after_5_min=samples[-1][1] / at5 - 1, steps=steps, samples=samples)


# --- 7: off-policy robustness ---------------------------------------------------------------------
STUDY = ["--searchers", "0", "--sync-every", "1", "--eval-every", "10"]  # --lag: each batch its step's rounds


def lagged_run(part: int, run: str, loss: str, args: list[str], lag: int, seed: int, tail: list[str]) -> tuple[dict, dict]:
    """Parts 7 and 12: one tba.py run of `loss` to its end with `args`, --lag `lag`, --seed `seed` and then `tail` (the
    user's flags, which come last) into `run` (its output in run.log): its held-out accuracy at the start, at the end (mean of the last 3 evaluations) and
    best, whether it collapsed (ended below its start), its staleness and curve; and its config."""
    cmd = [sys.executable, os.path.join(ROOT, "tba.py"), *args, "--lag", str(lag), "--seed", str(seed), "--out",
           vacated(run), *tail]
    t0 = time.time()
    code = run_to_end(cmd, run + ".log")
    if code != 0:
        raise RuntimeError(f"tba.py {' '.join(cmd[2:])} failed: {read_text(run + '.log')[-2000:]}")
    train, evals, config = plot.read(run)
    accuracy = [e["accuracy"] for e in evals]
    final = float(np.mean(accuracy[-3:]))
    row = dict(loss=loss, lag=lag, seed=seed, start=accuracy[0], final=final, best=max(accuracy[1:]), collapsed=final < accuracy[0],
               staleness=float(np.mean([r["staleness"] for r in train])), seconds=time.time() - t0,
               curve=[(e["step"], e["accuracy"]) for e in evals])
    print(f"{part}. {loss} lag {lag} seed {seed}: {accuracy[0]:.3f} -> {final:.3f} (best {row['best']:.3f})", flush=True)
    return row, config


def off_policy(seeds: list[int], out: str, flags: list[str], quick: bool) -> dict:
    """tba.py runs for each loss of loss.LOSSES x staleness x seed (synchronous, --lag L: every batch L steps stale)."""
    losses, lags = list(LOSSES), ([0, 2] if quick else [0, 4, 15])
    extra = ["--steps", "6", "--eval-every", "2"] if quick else []
    rows = []
    for loss in losses:
        for lag in lags:
            for seed in seeds:
                row, config = lagged_run(7, os.path.join(out, f"offpolicy-{loss}-lag{lag}-seed{seed}"), loss,
                                         [*STUDY, "--loss", loss], lag, seed, [*flags, *extra])
                rows.append(row)
    settings = {k: config[k] for k in ("lr", "beta", "steps", "prompts_per_step", "samples_per_prompt", "temperature",
                                       "decay_steps", "clip", "grad_clip")}
    return dict(losses=losses, lags=lags, settings=settings, flags=STUDY + flags + extra, rows=rows)


# --- 9: asynchrony on equal hardware, both phases on devices of their own, emulated --------------------------------
MODES = {"colocated": ["--lag", "0"],  # with --searchers 0 on N + 1 emulated devices: every one generates its share of
         #                             the batch, then every one trains its share (`colocated_costs`)
         "sync": ["--lag", "0"],  # the synchronous baseline on the searchers' hardware: each step waits for its rounds
         "lag1": ["--lag", "1"],  # one-step off-policy: every batch sampled by the weights of the step before
         "stream": ["--no-keep-full"],  # TBA as the paper's: searchers stream rounds, weights load between rounds
         "full": ["--keep-full"]}  # TBA with engines kept full: a slot refilled at once, a prompt sent when done
BASELINES = ("colocated", "sync")  # what each mode's speed-ups are over, paired by seed
DECODINGS = {"gpu+tails": ["--decode-cost", "gpu", "--response-lengths", "gsm8k"],  # a GPU's step, GSM8K's long tail
             "linear": []}  # each running sequence's share alone (the earlier cells')
GRACE = 300.0  # s a run stopped at the cap may take to make its kept evaluations (--evaluator after) and stop
STEP = 0.4  # s: the emulated training step T of part 9's points at least (--train-slowdown Y = T / its cost alone)
PART9_SEEDS = 10  # the main point's seeds by default: with 3-5, time to start + 0.15 (about +-3 steps of noise at about
# 18 steps) told no two modes apart that differed by less than about 20%
FEW_SEEDS = 3  # the other points' seeds by default (the first of the main point's)
PART9_STEPS = 200  # each run's --steps unless given after --: the default run's, its learning rate constant for the
# first 100 steps, past every mode's steps in the horizon (before, 40: the rate decayed along the way, the faster
# modes' further, and a run kept full stopped at its 40th step before the horizon)
MIN_Y = 1.25  # T is at least this times a step alone (a slow or loaded machine's): the trainer's step stays emulated
# The colocated trainer: data-parallel over D = N + 1 devices (DDP, TRL's default under accelerate), its gradients
# summed by a ring all-reduce in which each device sends and receives 2 (D - 1) / D of them:
# t = 2 (D - 1) / D x P x GRAD_BYTES / BUS_BANDWIDTH, against its step on one device T = 6 P x TOKENS_PER_STEP /
# (MFU x PEAK_FLOPS) (forward and backward: 6 FLOPs a parameter a token); P cancels (`all_reduce_share`).
GRAD_BYTES = 2  # bf16 gradients
BUS_BANDWIDTH = 360e9  # B/s: NCCL's all-reduce bus bandwidth taken on one H100 SXM node (NVLink 4: 450 GB/s each way)
PEAK_FLOPS, MFU = 989e12, 0.4  # H100 SXM's dense bf16 peak, and the share of it a 1B model's training step gets
TOKENS_PER_STEP = 7 * 20 * 250  # run_gsm8k.sh's step: B x K = 7 x 20 sequences of about 250 tokens, prompt and answer
STARTUP = (7.0, 1.5)  # s from launch to the first round on 2 idle cores: a run without searchers, and more a searcher
# (docs/performance.md, 7 s for --searchers 0, 13 s with 4); for the plan's estimate only
HORIZON = 100.0  # s from its first round that every run of part 9 runs (the colocated run reaches start + 0.20 at 70 s)
QUICK_HORIZON = 12.0  # s, --quick's
EVAL_SECONDS = 0.3  # s an evaluation of the toy's held-out problems takes (--evaluator after), for the estimate


def all_reduce_share(devices: int) -> float:
    """The colocated trainer's gradient all-reduce over `devices`, as a share of its training step on one device (the
    constants above): 1.7% over 5 H100s, 1.1% over 2; none on one device."""
    if devices < 2:
        return 0.0
    return 2 * (devices - 1) / devices * GRAD_BYTES * MFU * PEAK_FLOPS / (6 * TOKENS_PER_STEP * BUS_BANDWIDTH)


def calibrate_costs(out: str, flags: list[str]) -> dict:
    """The emulated costs alone, measured once on this (idle) machine and handed to every run of part 9
    (--calibration): a one-process run pinned to one core (the thread a searcher or the trainer gets in a run with
    searchers on 2 cores) times one engine's generated token and a training step, each alone (runtime/slowdown.py);
    its rounds give the tokens a round of B prompts makes. Returns {seconds_per_token, train_step, tokens_per_batch,
    file}."""
    run = vacated(os.path.join(out, "calibration"))
    core = str(min(os.sched_getaffinity(0)))  # the first core this process may use (core 0 may not be one)
    # the user's flags first, so that its own come after them and win: a `-- --steps 200` of a longer task would
    # otherwise make the calibration run 200 steps on one core for the 3 it times
    cmd = ["taskset", "-c", core, sys.executable, os.path.join(ROOT, "tba.py"), *flags, "--searchers", "0", "--steps",
           "8", "--eval-every", "0", "--generation-slowdown", "1.01", "--train-slowdown", "1.01", "--out", run]
    if run_to_end(cmd, run + ".log"):
        raise RuntimeError(f"the calibration run failed: {read_text(run + '.log')[-2000:]}")
    config = json.loads(read_text(os.path.join(run, "config.json")))
    train, _, _ = plot.read(run)
    per_token = config["seconds_per_token"]["trainer"]
    tokens = train[-1]["charged"] / 1.01 / per_token / train[-1]["step"]  # a round of B prompts a step
    costs = dict(seconds_per_token=per_token, train_step=config["train_step"], tokens_per_batch=tokens,
                 file=os.path.join(out, "calibration.json"))
    write_json(costs["file"], {k: costs[k] for k in COSTS})  # tba.py reads the first two (--calibration); --costs, all three
    print(f"9. calibration (one core, alone): {per_token * 1e3:.3f} ms a generated token, a training step "
          f"{costs['train_step']:.3f} s, {tokens:.0f} tokens a batch of prompts", flush=True)
    return costs


def round_alone(costs: dict, n: int, shape: str = "linear", cfg=None, devices: int = 1, draws: int = 200) -> float:
    """The synchronous round's emulated cost alone (X = 1, the calibration's costs): N searchers' rounds of B / N
    prompts each, the slowest of them; or with `devices` D (the colocated run) one round of B prompts spread over D.
    Linear decoding: the batch's tokens over N (or D). GPU-shaped with GSM8K's tail (`cfg`: B, n and the model's
    shape): each response's emulated steps from `tail_steps`, each step costing runtime.slowdown.Clock.alone
    of those still running; the mean over `draws` seeded rounds."""
    if shape == "linear":
        return costs["tokens_per_batch"] / (devices if devices > 1 else n) * costs["seconds_per_token"]
    from runtime import seeds, slowdown
    B, samples = cfg.prompts_per_step, cfg.search_samples_per_prompt
    clock = slowdown.Clock(1.0, costs["seconds_per_token"], "gpu", B * samples, model=cfg.decode_shape, devices=devices)
    rng = np.random.default_rng([0, seeds.TAILS])
    size = [B * samples] if devices > 1 else [-(-B // n) * samples] * n  # a round each engine
    return float(np.mean([max(clock.round_alone(tail_steps(costs, cfg, rng.random(k))) for k in size)
                          for _ in range(draws)]))


def tail_steps(costs: dict, cfg, draws) -> np.ndarray:
    """Each response's emulated decoding steps for uniform `draws`: the calibration's mean length, stretched
    by a draw from GSM8K's tail as runtime.slowdown.Tails stretches them (never below the mean)."""
    from runtime import slowdown
    mean = max(1, round(costs["tokens_per_batch"] / (cfg.prompts_per_step * cfg.search_samples_per_prompt)))
    tail = np.interp(draws, np.linspace(0, 1, len(slowdown.GSM8K_TAIL)), slowdown.GSM8K_TAIL)
    return np.maximum(mean, np.round(mean * tail))


def point(costs: dict, ratio: float, n: int, shape: str = "linear", cfg=None) -> tuple:
    """(X, Y) where the synchronous round of N searchers takes `ratio` x the training step: T = STEP (or MIN_Y x
    a step alone, where that is longer; with the colocated run, MIN_Y x D x a step alone, so that its trainer's share
    of a step, T / D, stays emulated too), and G_N = X x `round_alone`."""
    y = max(MIN_Y * (n + 1), STEP / costs["train_step"])  # the same machine whether the colocated run is run or not
    x = ratio * y * costs["train_step"] / round_alone(costs, n, shape, cfg)
    if x < 1:  # X clamped at 1 would run another G/T than the point's label (issue 67 item 14)
        raise BadInput(f"--ratios {ratio:g}: at no slowdown (X 1) a round of {n} searcher(s) is already "
                       f"{ratio / x:.2f} x the step here: give ratios of at least {ratio / x:.2f}")
    return round(x, 2), round(y, 2)


def ceiling(costs: dict, ratio: float, n: int, cfg) -> dict:
    """What the emulated machine allows at a point, in throughput (steps a second) over the colocated run's: its period
    (the round over D = N + 1 devices, then T / D and the all-reduce) against streaming's, whole rounds overlapped with
    the step (max(G_N, T): overlap alone), and the engines kept full's (max(G_full, T)), where a searcher's slots never
    wait for a round's slowest response: B x K responses of the mean emulated length at a full engine's step each,
    over N searchers. A bound on time to a target only where a step teaches as much in every mode."""
    from runtime import seeds, slowdown
    x, y = point(costs, ratio, n, "gpu+tails", cfg)
    T = y * costs["train_step"]
    B, K = cfg.prompts_per_step, cfg.search_samples_per_prompt
    colocated = x * round_alone(costs, n, "gpu+tails", cfg, n + 1) + T / (n + 1) + all_reduce_share(n + 1) * T
    length = float(np.mean(tail_steps(costs, cfg, np.random.default_rng([0, seeds.TAILS]).random(20000))))
    clock = slowdown.Clock(1.0, costs["seconds_per_token"], "gpu", B * K, model=cfg.decode_shape)
    G, G_full = x * round_alone(costs, n, "gpu+tails", cfg), x * length * clock.alone(-(-B // n) * K)
    return dict(ratio=ratio, x=x, y=y, T=T, G=G, G_full=G_full, colocated=colocated, stream=colocated / max(G, T),
                full=colocated / max(G_full, T))


def colocated_costs(costs: dict, out: str, n: int, y: float) -> str:
    """The colocated run's --calibration for N searchers' hardware: the same costs alone on D = N + 1 devices
    (runtime/slowdown.py: each generates its share of the round's sequences, then trains its share of the batch),
    and the gradients' all-reduce a step in emulated seconds (`all_reduce_share` of the emulated step Y x a step
    alone). The reload of new weights into the engine after each step is real, and unslowed: the same work each
    searcher of the other modes does, counted as work no device pays for. Returns the file."""
    devices = n + 1
    path = os.path.join(out, f"calibration-colocated-{devices}.json")
    write_json(path, dict(seconds_per_token=costs["seconds_per_token"], train_step=costs["train_step"], devices=devices,
                          all_reduce=all_reduce_share(devices) * y * costs["train_step"]))
    return path


COSTS = ("seconds_per_token", "train_step", "tokens_per_batch")  # calibration.json: what part 9's points are made of


def read_costs(path: str) -> dict:
    """--costs FILE: an earlier part 9's calibration.json, its three costs each a positive finite number; BadInput in
    one line naming the file and what is wrong. A tba.py --calibration file (seconds_per_token and train_step only)
    is refused: tokens_per_batch, the tokens a round of B prompts makes under these flags, is measured by the
    calibration run, not derived from the other two, and every point's X rests on it."""
    what = f"--costs: {path}"
    try:
        text = read_text(path)
    except FileNotFoundError:
        raise BadInput(f"{what} does not exist") from None
    except IsADirectoryError:
        raise BadInput(f"{what} is a folder, not a calibration.json") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{what} cannot be read ({getattr(e, 'strerror', None) or type(e).__name__})") from None
    try:
        costs = json.loads(text)
    except ValueError:
        raise BadInput(f"{what} is {'empty' if not text.strip() else 'not JSON'}, not a calibration.json") from None
    if not isinstance(costs, dict):
        raise BadInput(f"{what} holds a JSON {type(costs).__name__}, not an object with {', '.join(COSTS)}")
    for k in COSTS:
        if k not in costs:
            why = (" (a tba.py --calibration file: give the calibration.json of an earlier bench.py --parts 9, "
                   "which adds the tokens a batch of prompts makes)" if k == "tokens_per_batch" else "")
            raise BadInput(f"{what} has no {k}{why}")
        v = costs[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)):  # JSON true is a Python int
            raise BadInput(f"{what}: {k} is {json.dumps(v)}, not a number")
        if not 0 < v <= sys.float_info.max or v != v:  # NaN and Infinity parse as floats
            raise BadInput(f"{what}: {k} is {v}, not a positive finite number")
    return {k: float(costs[k]) for k in COSTS}


def reuse_costs(given: str, out: str) -> dict:
    """--costs: an earlier part 9's calibration.json (its three costs, read_costs), copied in, so that two
    comparisons run on the same emulated hardware."""
    costs = dict(read_costs(given), file=os.path.join(out, "calibration.json"))
    write_json(costs["file"], {k: costs[k] for k in COSTS})
    return costs


def part9_plan(costs: dict | None, cfg, counts: list[int], ratios: list[float], slowdowns: list[float],
               modes: list[str], seeds: list[int], few: int, decoding: str) -> list[dict]:
    """Part 9's cells: the main point (the first of `ratios`, the most searchers) on every seed; the other ratios on
    the first `few` seeds; the fewest searchers streaming at the main point's X and Y on every seed (the scaling,
    paired by seed with the most's); --slowdowns' points of X alone (CPU packing, no colocated run)."""
    n = max(counts)
    cells = []
    for i, r in enumerate(ratios):
        x, y = point(costs, r, n, decoding, cfg)
        cells.append(dict(n=n, ratio=r, x=x, y=y, shape=decoding, modes=modes, seeds=seeds if i == 0 else seeds[:few]))
    if len(counts) > 1 and ratios:
        cells.append(dict(cells[0], n=min(counts), modes=["stream"], baseline=False))  # against the most's stream
    cells += [dict(n=n, ratio=None, x=x, y=1.0, shape="linear", modes=[m for m in modes if m != "colocated"],
                   seeds=seeds) for x in slowdowns]
    return cells


def plan_seconds(cell: dict, costs: dict | None, cfg, eval_every: int, horizon: float = HORIZON) -> float | None:
    """About how long a cell's runs take on idle cores (None: a point of X alone, whose costs are not known before):
    each run its start-up, the `horizon` from its first round, and its evaluations (made after the last step, or in
    the colocated run's process) of the steps its mode's emulated period makes in the horizon: --lag 0 G + T, the
    colocated run its round over D devices + T / D + the all-reduce, the others the slower of G and T (--keep-full:
    at most T, its engines fuller)."""
    if not cell["ratio"]:
        return None
    T = cell["y"] * costs["train_step"]
    G = lambda n, devices=1: cell["x"] * round_alone(costs, n, cell["shape"], cfg, devices)
    n, d = cell["n"], cell["n"] + 1
    period = dict(sync=G(n) + T, colocated=G(n, d) + T / d + all_reduce_share(d) * T, lag1=max(G(n), T),
                  stream=max(G(n), T), full=T)
    run = lambda m: (STARTUP[0] + STARTUP[1] * (0 if m == "colocated" else n) + horizon
                     + (horizon / period[m] // eval_every + 1) * EVAL_SECONDS)
    return len(cell["seeds"]) * sum(run(m) for m in cell["modes"])


def minutes(seconds: float) -> str:
    return f"{seconds // 3600:.0f} h {seconds % 3600 / 60:02.0f} min" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def equal_hardware(seeds: list[int], out: str, flags: list[str], cap: float, counts: list[int], ratios: list[float],
                   slowdowns: list[float], modes: list[str], gain: float, eval_every: int, decoding: str, cfg,
                   few: int = FEW_SEEDS, run_one=None, given: str | None = None, horizon: float = None) -> dict:
    """Part 9: its cells (`part9_plan`: a point G_N / T with both phases emulated from one shared calibration, or a
    --generation-slowdown X alone, each run calibrating itself) x mode x seed, their estimated time said first; every
    run the same `horizon` seconds from its first round (no run stops at its target); time to start + `gain`,
    throughput and the mean accuracy over the horizon against the colocated run on N + 1 devices and the synchronous
    baseline on the same N searchers (--lag 0). The plan's estimate and the time taken are both said, and kept."""
    horizon = horizon or HORIZON
    began = time.time()
    costs = (reuse_costs(given, out) if given else calibrate_costs(out, flags)) if ratios else None
    cells = part9_plan(costs, cfg, counts, ratios, slowdowns, modes, seeds, few, decoding)
    estimates = [plan_seconds(c, costs, cfg, eval_every, horizon) for c in cells]
    runs = sum(len(c["seeds"]) * len(c["modes"]) for c in cells)
    print(f"9. plan: {runs} runs, about {minutes(sum(e for e in estimates if e))} on idle cores"
          + (" and the points of X alone" if None in estimates else "") + f" (each run its start-up, {horizon:g} s "
          f"from its first round, and its evaluations)", flush=True)
    for c, e in zip(cells, estimates):
        where = f"G/T {c['ratio']:g}, X {c['x']:g}, Y {c['y']:g}" if c["ratio"] else f"X {c['x']:g} alone"
        print(f"   N {c['n']} {where} {c['shape']}: {' '.join(c['modes'])}, {len(c['seeds'])} seed(s)"
              + (f", about {minutes(e)}" if e else ""), flush=True)
        if c["ratio"] and c["shape"] == "gpu+tails" and c.get("baseline", True):
            top = ceiling(costs, c["ratio"], c["n"], cfg)
            print(f"   its ceiling in throughput over the colocated run: streaming whole rounds {top['stream']:.2f}x "
                  f"(overlap alone), engines kept full {top['full']:.2f}x (G {top['G']:.2f} s, kept full "
                  f"{top['G_full']:.2f} s, T {top['T']:.2f} s)", flush=True)
    rows, began_runs = [], time.time()
    for cell in cells:
        for seed in cell["seeds"]:
            sync = None
            for mode in sorted(cell["modes"], key=lambda m: m != "sync"):  # the baseline first: the others' gain
                name = (f"hardware-n{cell['n']}-{'r%g' % cell['ratio'] if cell['ratio'] else 'x%g' % cell['x']}-"
                        f"{cell['shape'].replace('+', '')}-{mode}-seed{seed}")
                run = os.path.join(out, name)
                calibration = colocated_costs(costs, out, cell["n"], cell["y"]) if mode == "colocated" else \
                    costs and costs["file"]
                extra = ["--steps", str(PART9_STEPS), "--eval-every", str(eval_every),
                         *(["--evaluator", "after"] if mode != "colocated" else []),  # (the one process evaluates)
                         "--generation-slowdown", f"{cell['x']:g}",
                         *(["--train-slowdown", f"{cell['y']:g}", "--calibration", calibration] if cell["ratio"] else []),
                         *DECODINGS[cell["shape"]], *MODES[mode]]
                searchers = 0 if mode == "colocated" else cell["n"]
                theirs = acting(flags, extra, searchers)
                extra += theirs
                r = (run_one or (lambda f: f()))(lambda: run_until_target(searchers, seed, cap, run, extra, False, gain,
                                                                          horizon=horizon))
                rows.append(dict(hardware_row(run, r, sync, baseline=mode == "sync", horizon=horizon),
                                 searchers=cell["n"], ratio=cell["ratio"], x=cell["x"],
                                 y=cell["y"], shape=cell["shape"], mode=mode_label(mode, theirs), seed=seed))
                sync = rows[-1] if mode == "sync" else sync
                h = rows[-1]
                print(f"9. N {cell['n']} {'G/T %g' % cell['ratio'] if cell['ratio'] else 'X %g' % cell['x']} "
                      f"{cell['shape']} {h['mode']} seed {seed}: start + {gain:g} "
                      + (f"at {h['seconds_interp']:.1f} s interpolated ({h['from_first_round']:.1f} s from the first "
                         f"round, step {h['step_interp']:.1f}; first evaluation past it {r['seconds']:.1f} s, step "
                         f"{r['step']})" if h["seconds_interp"] is not None else "not reached")
                      + (f", mean accuracy {h['mean_accuracy']:.3f} over {h['horizon']:.1f} s" if h["mean_accuracy"]
                         is not None else "")
                      + f", {h['steps_per_s']:.2f} steps/s, over its charge with uncharged work {h['over']:.0%} "
                        f"({h['over_process']})", flush=True)
    took = dict(planned=sum(e for e in estimates if e), runs=time.time() - began_runs, all=time.time() - began)
    print(f"9. took {minutes(took['all'])} ({minutes(took['runs'])} of runs; planned {minutes(took['planned'])})",
          flush=True)
    return dict(searchers=counts, seeds=seeds, gain=gain, cap=cap, costs=costs, horizon=horizon, rows=rows,
                took=took, summary=hardware_summary(rows))


def without_streaming(flags: list[str]) -> list[str]:
    """The user's flags for a --lag run (`acting`): those that act only streaming left out."""
    return acting(flags, ["--lag", "0"], 1)


def acting(flags: list[str], mode: list[str], searchers: int) -> list[str]:
    """The user's flags (after --) that act in a mode's run (its flags `mode`, its searchers), the others left out
    (tba.py refuses a flag where it cannot act: its field's `acts`, runtime.checks.acts_only), so that one study of a
    streaming flag (`-- --max-reuse 1.5`, `-- --recency 1`) keeps its baselines; a flag and its value, or a --flag /
    --no-flag."""
    cfg = Config(lag=int(mode[mode.index("--lag") + 1]) if "--lag" in mode else None, searchers=searchers,
                 keep_full="--keep-full" in mode)
    idle = {flag for flag, acts in mode_flags() if not acts(cfg)}
    return [w for name, words in flag_items(flags) if name not in idle for w in words]


def mode_flags() -> list[tuple[str, object]]:
    """(--flag, where it acts) of each flag that acts in some modes only (runtime.checks.acts_only)."""
    from runtime.checks import acts_only
    return [("--" + name.replace("_", "-"), acts) for name, acts, _ in acts_only()]


def flag_items(flags: list[str]):
    """(--name, its words) for each flag of `flags`: a flag and its value, or a --flag / --no-flag (as --flag)."""
    i = 0
    while i < len(flags):
        has_value = "=" not in flags[i] and i + 1 < len(flags) and not flags[i + 1].startswith("--")
        yield flags[i].split("=")[0].replace("--no-", "--"), flags[i:i + 1 + has_value]
        i += 1 + has_value


def mode_label(mode: str, theirs: list[str]) -> str:
    """A run's mode as the rows name it: with those of its flags after -- that act in some modes only (acts_only:
    `stream --max-reuse 2`), so that the runs of one study made one after another stay apart in one table."""
    some = {flag for flag, _ in mode_flags()}
    return " ".join([mode, *(w for name, words in flag_items(theirs) if name in some for w in words)])


def crossing(curve: list, level: float) -> tuple[float, float] | None:
    """Where held-out accuracy first reaches `level` on a curve [(seconds, step, accuracy)], in order, the first
    point the start: (seconds, step), linear between the last evaluation below it and the first at or above it; None
    where it never does. The first evaluation past the level alone jumps by a whole evaluation interval with one
    evaluation's sampling noise; between the two, the noise moves the crossing only by its share of the rise."""
    for (t0, s0, a0), (t1, s1, a1) in zip(curve, curve[1:]):
        if at_least(a1, level):
            share = min(1.0, max(0.0, (level - a0) / (a1 - a0))) if a1 > a0 else 1.0
            return t0 + share * (t1 - t0), s0 + share * (s1 - s0)
    return None


def accuracy_at(points: list, t: float) -> float:
    """Held-out accuracy at `t` seconds on [(seconds, accuracy)] in time order: linear between evaluations, the first
    one's before it (the start's weights), the last one's after it (the run's final weights, held)."""
    return float(np.interp(t, [p[0] for p in points], [p[1] for p in points]))


def mean_accuracy(points: list, horizon: float | None) -> float | None:
    """The area under held-out accuracy against time over [0, horizon] seconds from the first step, over the horizon
    (the mean accuracy in that window), from [(seconds from the first step, accuracy)] as `accuracy_at` reads them;
    None without points or a horizon. Every evaluation counts, not only the two around one crossing."""
    if not points or not horizon or horizon <= 0:
        return None
    points = sorted(points)
    grid = [0.0, *(t for t, _ in points if 0 < t < horizon), horizon]
    values = [accuracy_at(points, t) for t in grid]
    return sum((a + b) / 2 * (t1 - t0) for t0, t1, a, b in zip(grid, grid[1:], values, values[1:])) / horizon


def over_share(last: dict) -> tuple[float, str]:
    """(the largest share of any one process's real compute over its own charge, with its work no device pays for,
    that process) from a run's last train row: the trainer's `over_trainer` and `uncharged_trainer`, each searcher's
    `over_searchers` and `uncharged_searchers` (rows before those: without them); a row written before the
    per-process shares has only the pooled `over_budget` seconds, whose share of all the charges is taken
    ("pooled")."""
    if "over_trainer" in last:
        uncharged = last.get("uncharged_searchers") or {}
        shares = {"the trainer": last["over_trainer"] + last.get("uncharged_trainer", 0.0),
                  **{f"searcher {k}": v + uncharged.get(k, 0.0) for k, v in (last.get("over_searchers") or {}).items()}}
        who = max(shares, key=shares.get)
        return float(shares[who]), who
    charged = last.get("charged", 0.0) + last.get("train_charged", 0.0)
    return (last.get("over_budget", 0.0) / charged if charged else 0.0), "pooled"


def cycle_of(train: list[dict]) -> float | None:
    """A searcher's own cycle in a run (train rows' `rounds`, the first row's left out: start-up): the median of each
    searcher's rounds, its reload and the round, their mean over the searchers (a step needs B prompts, whichever
    searchers made them); None without them (older rows)."""
    by = {}
    for r in train[1:]:
        for searcher, _, _, cycle in r.get("rounds") or []:
            by.setdefault(searcher, []).append(cycle)
    return float(np.mean([np.median(c) for c in by.values()])) if by else None


def bound(G: float | None, T: float | None, cycle: float | None, publish: float | None) -> float | None:
    """The throughput any asynchronous mode on the same searchers can reach over the synchronous one, from its rows:
    (G + T) / max(a searcher's own cycle, T + publish). Each step needs every searcher's round (B prompts, each used
    once) and the trainer's step and publish, whatever overlaps; the synchronous period G + T has the barrier's costs
    too (the poll, the slowest searcher, the publish), which (G + T) / max(G, T) counts as generation."""
    if None in (G, T, cycle, publish):
        return None
    return (G + T) / max(cycle, T + publish)


def hardware_row(run: str, r: dict, sync: dict | None, baseline: bool = False, horizon: float | None = None) -> dict:
    """Part 9's figures of one run: its folder, run_until_target's dict `r` and the synchronous run of its cell and
    seed (`baseline`: this is it; None: the cell has none). G and T: the median round (the wait for it, or the
    one process's own rounds) and the median step without it, the first step left out; publish: the median publish;
    cycle (`cycle_of`); the synchronous run's `bound`. Throughput (steps a second, from the first step) apart from
    learning (steps to the target); time to the target from launch and from the first step, at the first evaluation
    past it and interpolated between the two around it (`crossing`); the mean held-out accuracy from the first step to
    `horizon` seconds (default: the synchronous run's end, or this run's where there is none: `mean_accuracy`) and its
    gain over the synchronous run's; the accuracy at the synchronous run's interpolated time to the target (equal
    wall time, from the first step); each process's real compute over its own charge with its uncharged work
    (`over_share`; the pooled share too: over_budget) and that work per round; the CPU the run's processes used."""
    train, evals, config = plot.read(run)
    later = train[1:] or train
    med = lambda f: float(np.median([f(t) for t in later])) if later else None
    G = med(lambda t: t["wait"] + t["sync"] + t["search"])
    T = med(lambda t: t["seconds"] - t["wait"] - t["sync"] - t["search"])
    publish, cycle = med(lambda t: t["sync"]), cycle_of(train)
    last = train[-1] if train else {}
    charged = last.get("charged", 0.0) + last.get("train_charged", 0.0)
    first = r["first_round"] if r.get("first_round") is not None else r["first_step_seconds"] or 0.0
    points = [(t - first, acc) for t, _, acc in r["curve"]]  # seconds from the first round
    cross = crossing(r["curve"], r["target"])
    end = r["last_step_seconds"] - first if r.get("last_step_seconds") is not None else None
    horizon = horizon or (sync["end"] if sync else end)
    at = None
    if sync and sync["from_first_round"] is not None:
        at = accuracy_at(points, sync["from_first_round"])
    over, who = over_share(last)
    span = later[-1]["time"] - train[0]["time"] - (later[-1]["overhead"] - train[0]["overhead"]) if len(train) > 1 else 0
    row = dict(reached=r["reached"], start=r["start_accuracy"], seconds=r["seconds"], step=r["step"],
               from_first_step=r["seconds"] - r["first_step_seconds"] if r["reached"] else None,
               seconds_interp=cross[0] if cross else None, from_first_round=cross[0] - first if cross else None,
               first_round=r.get("first_round"), evals=[[round(t, 3), s, a] for t, s, a in r["curve"]],
               step_interp=cross[1] if cross else None, end=end, horizon=horizon,
               mean_accuracy=mean_accuracy(points, horizon), times=[t for t, _ in points],
               first_step=r["first_step_seconds"], G=G, T=T, publish=publish, cycle=cycle,
               bound=bound(G, T, cycle, publish) if baseline else None, steps=last.get("step", 0),
               steps_per_s=(len(train) - 1) / span if span > 0 else 0.0,
               staleness=float(np.mean([t["staleness"] for t in train])) if train else None,
               over_budget=last.get("over_budget", 0.0) / charged if charged else 0.0, over=over, over_process=who,
               over_trainer=last.get("over_trainer"), over_searchers=last.get("over_searchers"),
               uncharged_trainer=last.get("uncharged_trainer"), uncharged_searchers=last.get("uncharged_searchers"),
               uncharged=last.get("uncharged"), cpu=r["cpu"], accuracy_at_sync=at,
               curve=[(e["step"], e["accuracy"]) for e in evals])
    if baseline:
        row.update(speedup_interp=1.0, speedup_interp_first_step=1.0, accuracy_gain=0.0)
    elif sync is None:  # a cell without its baseline (the scaling's): no speed-up over one
        row.update(speedup_interp=None, speedup_interp_first_step=None, accuracy_gain=None)
    else:
        gain = (row["mean_accuracy"] - sync["mean_accuracy"] if None not in (row["mean_accuracy"], sync["mean_accuracy"])
                else None)
        row.update(bound=sync["bound"], speedup_interp=speedup(sync, row, "seconds_interp"),
                   speedup_interp_first_step=speedup(sync, row), accuracy_gain=gain)
    return row


CPU_BOUND = 0.10  # a process more than this over its own charge, with its uncharged work: the CPU set the run's pace
# what part9.json keeps of each row (`per_seed`): the summary's inputs, each seed's, anyone can recompute the table from
PER_SEED = ("searchers", "ratio", "x", "y", "shape", "mode", "seed", "reached", "seconds_interp", "from_first_round",
            "step_interp", "first_step", "first_round", "horizon", "mean_accuracy", "accuracy_at_sync", "steps_per_s",
            "staleness", "G", "T", "publish", "cycle", "bound", "over", "over_process", "uncharged", "cpu", "evals")


def reached_by(r: dict, field: str = "from_first_round") -> float:
    """A run's interpolated time to the target (`field`: from its first round, or `seconds_interp` from launch); one
    that never reached it within its horizon, its horizon's end: a bound, which understates the other's speed-up."""
    if r[field] is not None:
        return r[field]
    return r["horizon"] + (0.0 if field == "from_first_round" else r["first_round"] or r["first_step"] or 0.0)


def speedup(a: dict, b: dict, field: str = "from_first_round") -> float:
    """How many times sooner b reached the target than a, each at `reached_by` (never: its horizon)."""
    return reached_by(a, field) / reached_by(b, field)


def paired(a: list[dict], b: list[dict], field: str = "from_first_round") -> tuple[list, list]:
    """Two modes' rows, by seed (the seeds both ran): b's speed-ups over a in interpolated time to the target (`field`:
    from the first round, or `seconds_interp` from launch; `reached_by`) and b's mean accuracy less a's (the same
    horizon)."""
    by = {r["seed"]: r for r in b}
    both = [(r, by[r["seed"]]) for r in a if r["seed"] in by]
    ups = [speedup(x, y, field) for x, y in both]
    gains = [y["mean_accuracy"] - x["mean_accuracy"] for x, y in both
             if x["mean_accuracy"] is not None and y["mean_accuracy"] is not None]
    return ups, gains


def corrected(pairs: int) -> float:
    """The level of each interval of a cell's pairs (Bonferroni): with P pairs of modes, 2 P claims (time and mean
    accuracy each), each interval at 1 - (1 - 90%) / 2P, so that all of a cell's "resolved" hold together at 90%."""
    return 1 - (1 - LEVEL) / max(1, 2 * pairs)


LEVEL = 0.90  # the intervals' level (a cell's pairs: corrected)


@functools.lru_cache(maxsize=None)
def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (p > 0.5): the density integrated on a fine grid, the bisection of its CDF (no SciPy)."""
    import math
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    cdf = lambda x: 0.5 + np.trapezoid(c * (1 + (g := np.linspace(0, x, 20001)) ** 2 / df) ** (-(df + 1) / 2), g)
    lo, hi = 0.0, 1e3
    for _ in range(60):
        lo, hi = ((lo + hi) / 2, hi) if cdf((lo + hi) / 2) < p else (lo, (lo + hi) / 2)
    return (lo + hi) / 2


def t_interval(values, level: float = LEVEL, log: bool = False) -> tuple[float | None, list[float] | None]:
    """(the mean, [lo, hi]): Student's t interval of the mean of paired values over seeds, its coverage exact where
    they are normal (a percentile bootstrap of 5 seeds' median gives their min and max, about 94% for "99%"); `log`:
    of paired ratios' logs, exponentiated (their geometric mean). No interval below 2 values, (None, None) with none."""
    v = np.asarray([x for x in values if x == x], dtype=float)
    if not len(v):
        return None, None
    v, back = (np.log(v), np.exp) if log else (v, lambda x: x)
    m = float(v.mean())
    if len(v) < 2:
        return float(back(m)), None
    h = t_quantile((1 + level) / 2, len(v) - 1) * float(v.std(ddof=1)) / np.sqrt(len(v))
    return float(back(m)), [float(back(m - h)), float(back(m + h))]


def hardware_summary(rows: list[dict]) -> dict:
    """Part 9's table from the seeds' rows (a run's, or part9.json's `per_seed` ones: the same result). Per cell (N,
    point, shape) and mode: medians over seeds, and over each baseline (`BASELINES`) the speed-up in interpolated time
    to the target from the first round (the headline) and from launch, each the geometric mean of the seeds' paired
    ratios with a 90% t interval of their logs (`t_interval`); the gain in mean accuracy over --lag 0 (the mean of the
    paired differences, its t interval); the synchronous run's bound. CPU-bound where any process of any seed ran over its own
    charge, with its uncharged work, by more than CPU_BOUND: no speed-up nor gain over a baseline is claimed where
    either side is. Then each pair of modes of a cell not CPU-bound, the later's over the earlier, with intervals at
    the `corrected` level: resolved where one excludes no difference; and the searchers' scaling (`scaling`)."""
    med = lambda v: float(np.median(v)) if v else None
    # Speed-ups: paired ratios by seed (the two runs of a pair share their seed, so that what it makes easy for both
    # cancels), their logs' mean and t interval: a crossing off the plateau (start + 0.20) and a common horizon keep
    # the ratios without the 6.7x jumps that once made a median the safer centre.
    cell_of = lambda r: (r["searchers"], r["ratio"], r["x"], r["y"], r["shape"])
    out, pairs = {}, []
    for cell in sorted({cell_of(r) for r in rows}, key=str):
        mine = [r for r in rows if cell_of(r) == cell]
        modes = list(dict.fromkeys(r["mode"] for r in sorted(mine, key=lambda r: list(MODES).index(r["mode"])
                                                                 if r["mode"] in MODES else len(MODES))))
        of = lambda mode: [r for r in mine if r["mode"] == mode]
        bound_cpu = {m: max(r["over"] for r in of(m)) > CPU_BOUND for m in modes}
        sync_bound = med([r["bound"] for r in of("sync") if r.get("bound")])
        for mode in modes:
            these = of(mode)
            worst = max(these, key=lambda r: r["over"])
            c = dict(searchers=cell[0], ratio=cell[1], x=cell[2], y=cell[3], shape=cell[4], mode=mode, runs=len(these),
                     reached=sum(r["reached"] for r in these), cpu_bound=bound_cpu[mode], bound=sync_bound,
                     seconds=med([r["seconds_interp"] for r in these if r["seconds_interp"] is not None]),
                     from_first_round=med([r["from_first_round"] for r in these if r["from_first_round"] is not None]),
                     mean_accuracy=med([r["mean_accuracy"] for r in these if r["mean_accuracy"] is not None]),
                     steps=med([r["step_interp"] for r in these if r["step_interp"] is not None]),
                     steps_per_s=med([r["steps_per_s"] for r in these]), staleness=med([r["staleness"] for r in these]),
                     G=med([r["G"] for r in these if r["G"]]), T=med([r["T"] for r in these if r["T"]]),
                     publish=med([r["publish"] for r in these if r.get("publish") is not None]),
                     cycle=med([r["cycle"] for r in these if r.get("cycle")]),
                     uncharged={part: med([(r.get("uncharged") or {}).get(part, 0.0) for r in these])
                                for part in sorted({p for r in these for p in r.get("uncharged") or {}})},
                     over=worst["over"], over_process=f"{worst['over_process']}, seed {worst['seed']}",
                     cpu=med([r["cpu"] for r in these]))
            for base in BASELINES:
                if base not in modes or base == mode:
                    continue
                withheld = bound_cpu[mode] or bound_cpu[base]
                first, first_ci = t_interval(paired(of(base), these)[0], log=True)
                launch, launch_ci = t_interval(paired(of(base), these, "seconds_interp")[0], log=True)
                c[f"over_{base}"] = dict(withheld=withheld, seeds=len(paired(of(base), these)[0]),
                                         **({} if withheld else dict(first_round=first, first_round_ci=first_ci,
                                                                     launch=launch, launch_ci=launch_ci)))
            if "sync" in modes and mode != "sync":
                gain, gain_ci = t_interval(paired(of("sync"), these)[1])
                c["accuracy_gain"], c["accuracy_gain_ci"] = (None, None) if bound_cpu[mode] or bound_cpu["sync"] \
                    else (gain, gain_ci)
            out[" ".join(map(str, (*cell, mode)))] = c
        compared = [(a, b) for i, a in enumerate(modes) for b in modes[i + 1:]]
        level = corrected(len(compared))
        for a, b in compared:
            p = dict(searchers=cell[0], ratio=cell[1], x=cell[2], y=cell[3], shape=cell[4], a=a, b=b, level=level,
                     family=2 * len(compared))
            if bound_cpu[a] or bound_cpu[b]:
                pairs.append(dict(p, cpu_bound=True))
                continue
            ups, gains = paired(of(a), of(b))
            up, up_ci = t_interval(ups, level, log=True)
            gain, gain_ci = t_interval(gains, level)
            pairs.append(dict(p, cpu_bound=False, seeds=len(ups), speedup=up,
                              speedup_ci=up_ci, resolved=bool(up_ci and (up_ci[0] > 1 or up_ci[1] < 1)),
                              accuracy_gain=gain, accuracy_gain_ci=gain_ci,
                              gain_resolved=bool(gain_ci and (gain_ci[0] > 0 or gain_ci[1] < 0))))
    return dict(cells=out, pairs=pairs, scaling=scaling(rows), intervals=dict(
        level=LEVEL, speedup="the geometric mean of the seeds' paired ratios of interpolated time from the first round, "
        "a t interval of their logs", accuracy_gain="the mean of the seeds' paired differences in mean accuracy over "
        "the horizon, a t interval", pairs="Bonferroni: each interval of a cell's P pairs at 1 - 10% / 2P"))


def scaling(rows: list[dict]) -> list[dict]:
    """The searchers' scaling: streaming with the most searchers against the fewest at the same X, Y and shape (the
    plan's scaling cell), paired by seed: how many times sooner the most reach the target from the first step (the
    median of the seeds' ratios, with its 90% interval), their throughput over the fewest's, and their round G
    (the synchronous one's) over the fewest's own cycle: what falls short of N / n where it does."""
    stream = [r for r in rows if r["mode"] == "stream" and r["ratio"]]
    out = []
    for point in sorted({(r["ratio"], r["x"], r["y"], r["shape"]) for r in stream}, key=str):
        mine = [r for r in stream if (r["ratio"], r["x"], r["y"], r["shape"]) == point]
        counts = sorted({r["searchers"] for r in mine})
        if len(counts) < 2:
            continue
        few, many = ([r for r in mine if r["searchers"] == n] for n in (counts[0], counts[-1]))
        ups, _ = paired(few, many)
        ratio, ci = t_interval(ups, log=True)
        med = lambda rs, k: float(np.median([r[k] for r in rs if r.get(k)])) if any(r.get(k) for r in rs) else None
        throughput = med(many, "steps_per_s") / med(few, "steps_per_s") if med(few, "steps_per_s") else None
        out.append(dict(ratio=point[0], x=point[1], y=point[2], shape=point[3], few=counts[0], many=counts[-1],
                        speedup=ratio, speedup_ci=ci, seeds=len(ups),
                        throughput=throughput, cycle_few=med(few, "cycle"), cycle_many=med(many, "cycle")))
    return out


def round_cost(cfg, prompts, answers, sizes: list[int], repeat: int) -> dict:
    """One searcher's engine in this process: the seconds of a search round (vLLM's generation, then the
    whole round: rewards and pi_ref's log-probs) of p prompts x K, for each p, warm; its fixed part and its
    cost per prompt, by least squares."""
    engine = Engine(cfg, devices(cfg)[1], 0.2, prompts, answers)
    rows = []
    for p in sizes:
        ids = np.arange(p) % len(prompts)
        engine.search(ids, cfg.search_samples_per_prompt, (0, 0, 0))  # warm up this size
        generate = timed(lambda: engine.generate(ids, cfg.search_samples_per_prompt, (0, 0, 1)), repeat)
        whole = timed(lambda: engine.search(ids, cfg.search_samples_per_prompt, (0, 0, 2)), repeat)
        rows.append(dict(prompts=p, generate=generate, round=whole))
    engine.close()
    fit = lambda key: np.polyfit([r["prompts"] for r in rows], [r[key] for r in rows], 1).tolist()  # [per prompt, fixed]
    return dict(rows=rows, generate_fit=fit("generate"), round_fit=fit("round"), K=cfg.search_samples_per_prompt)


# --- 12: TBA′ against Dr. GRPO as staleness grows, in miniature --------------------------------------
MINIATURE = ["--searchers", "1", "--eval-every", "10"]


def miniature(seeds: list[int], out: str, flags: list[str], quick: bool, lags: list[int]) -> dict:
    """The paper's MATH comparison on the toy: TBA′ (--loss tbprime, beta 0.005 fixed, pi_ref reset every 50
    steps, importance weights on) and Dr. GRPO (--loss drgrpo) with one searcher at the exact --lag L, each
    to its end: the held-out accuracy at the end (mean of the last 3 evaluations), the best, and whether it
    collapsed (ended below its start)."""
    losses = {"tbprime": ["--loss", "tbprime", "--beta", "0.005", "--ref-reset-every", "50"],
              "drgrpo": ["--loss", "drgrpo"]}
    extra = ["--steps", "6", "--eval-every", "2"] if quick else []
    rows = []
    for loss, loss_flags in losses.items():
        for lag in lags:
            for seed in seeds:
                row, _ = lagged_run(12, os.path.join(out, f"miniature-{loss}-lag{lag}-seed{seed}"), loss,
                                    [*MINIATURE, *loss_flags], lag, seed, [*flags, *extra])
                rows.append(row)
    return dict(losses=list(losses), lags=lags, flags=MINIATURE + flags + extra, rows=rows)


# --- 10: fresher data per step ------------------------------------------------------------------------
FRESHER = [("default", []), ("round B", ["--round-prompts", "whole"]), ("round B/2N", ["--round-prompts", "half"]),
           ("k 2", ["--sync-every", "2"]), ("m 0.5", ["--recency", "0.5"]), ("R 2", ["--max-reuse", "2"])]


def fresher(seeds: list[int], out: str, flags: list[str], cap: float, quick: bool, cfg, run_one=None,
            x: float = 10, counts: list[int] | None = None) -> dict:
    """At --generation-slowdown X (10), for N searchers: time to start + 0.15 (each run stops there) with the
    defaults and with one lever changed (FRESHER: a searcher round of B prompts, or of half the default
    B / N; k; m; R), against the one-process run (--searchers 0) of the same seed."""
    counts = counts or ([1] if quick else [1, 2, 4])
    variants = FRESHER[:2] if quick else FRESHER
    rows = []
    for n in [0] + counts:
        size = {"whole": cfg.prompts_per_step, "half": max(1, -(-cfg.prompts_per_step // max(1, n)) // 2)}
        for name, extra in variants if n else [("one process", [])]:
            for seed in seeds:
                run = os.path.join(out, f"fresher-searchers{n}-{name.replace(' ', '').replace('/', '')}-seed{seed}")
                these = [str(size.get(e, e)) for e in extra] + ["--eval-every", "2" if quick else "5",
                                                                "--generation-slowdown", f"{x:g}", *flags]
                r = (run_one or (lambda f: f()))(lambda: run_until_target(n, seed, cap, run, these, False))
                train, _, _ = plot.read(run)
                rows.append(dict(searchers=n, variant=name, flags=these, seed=seed, reached=r["reached"],
                                 seconds=r["seconds"], step=r["step"], first_step=r["first_step_seconds"],
                                 from_first_step=r["seconds"] - r["first_step_seconds"] if r["reached"] else None,
                                 staleness=float(np.mean([t["staleness"] for t in train])) if train else None))
                print(f"10. searchers {n} {name} seed {seed}: +0.15 "
                      f"{'at %.1f s (step %d)' % (r['seconds'], r['step']) if r['reached'] else 'not reached'}", flush=True)
    for r in rows:
        sync = next(s for s in rows if s["searchers"] == 0 and s["seed"] == r["seed"])
        both = r["reached"] and sync["reached"]
        r["speedup"] = sync["seconds"] / r["seconds"] if both else None
        r["speedup_first_step"] = sync["from_first_step"] / r["from_first_step"] if both else None
    return dict(x=x, searchers=counts, variants=[v for v, _ in variants], cap=cap, rows=rows)


# --- 8: TRL's GRPOTrainer on the same setup -----------------------------------------------------------
TRL = ["trl==1.13.0", "requests"]  # TRL 1.13's GRPOTrainer imports requests without declaring it
TRL_CHECK = ("import torch, transformers, trl; from trl import GRPOTrainer; "
             "print(trl.__version__, transformers.__version__, torch.__version__)")


def trl_python(given: str | None, log: str) -> tuple[str | None, str]:
    """The python of a virtual environment that holds TRL: `given` (--trl-python), or one made once in
    $TBA_CACHE/trl-venv (default ~/.cache/tba) with TRL and this process's torch and transformers releases,
    so that both sides run the same kernels and model code. Returns (python or None, a line saying which
    one, or why there is none); pip's output goes to `log`."""
    def check(python):  # the versions it holds, or None
        try:
            p = subprocess.run([python, "-c", TRL_CHECK], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        except OSError:
            return None
        return p.stdout.split() if p.returncode == 0 else None

    if given:
        if check(given) is None:
            return None, f"--trl-python {given}: not a python that imports trl's GRPOTrainer"
        return given, f"TRL from --trl-python {given}"
    import fcntl
    import transformers
    root = os.environ.get("TBA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tba")
    venv, python = os.path.join(root, "trl-venv"), os.path.join(root, "trl-venv", "bin", "python")
    pins = [f"torch=={torch.__version__}", f"transformers=={transformers.__version__}", *TRL]
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, ".trl-lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one installer at a time
        ready = os.path.join(venv, "tba-ready.json")
        if os.path.isfile(ready) and json.loads(read_text(ready)) == pins and check(python):
            return python, f"TRL from {venv} (made earlier)"
        print(f"8. installing TRL into {venv} (once): pip install {' '.join(pins)} ...", flush=True)
        t0 = time.time()
        try:
            ok = run_to_end([sys.executable, "-m", "venv", "--clear", venv], log) == 0
            ok = ok and run_to_end([python, "-m", "pip", "install", "--disable-pip-version-check", *pins], log,
                                   timeout=3600, mode="a") == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if not ok or check(python) is None:
            return None, f"could not install {' '.join(pins)} into {venv} (see {log})"
        with open(ready, "w") as f:
            json.dump(pins, f)
        return python, f"TRL installed into {venv} in {time.time() - t0:.0f} s"


def reached(curve, level: float):
    """(seconds, step) of the first evaluation after the start at or above `level`, or (None, None)."""
    return next(((t, step) for t, step, acc in curve[1:] if at_least(acc, level)), (None, None))


def run_trl(python: str, seed: int, cap: float, out: str, model: str, extra: list[str]) -> dict:
    """Run trl_grpo.py to its end (or the time cap); times count from its launch, without evaluations."""
    cmd = [python, os.path.join(ROOT, "tools", "trl_grpo.py"), "--seed", str(seed), "--out", vacated(out), "--model",
           model, *extra]
    launched = time.time()
    with open(out + ".log", "w") as log:
        proc = start(cmd, log)
    try:
        proc.wait(timeout=cap)
    except subprocess.TimeoutExpired:
        pass  # stopped at the cap: what it wrote so far is read
    finally:
        stop(proc)
    train, evals, config = plot.read(out) if os.path.exists(os.path.join(out, "metrics.jsonl")) else ([], [], {})
    if not evals:
        raise RuntimeError(f"trl_grpo.py produced no evaluation: {read_text(out + '.log')[-2000:]}")
    offset = config["started"] - launched  # interpreter start before trl_grpo.py's first line
    curve = [(offset + e["time"], e["step"], e["accuracy"]) for e in evals]
    first = curve[0][2]
    (t15, s15), (t25, s25) = reached(curve, first + 0.15), reached(curve, first + 0.25)
    later = train[1:]  # the first step may hold one-time warm-up
    return dict(
        seed=seed, start_accuracy=first, seconds_to_015=t15, step_015=s15, seconds_to_025=t25, step_025=s25,
        final_accuracy=curve[-1][2] if curve[-1][1] == config["steps"] else None, steps=config["steps"],
        seconds=offset + train[-1]["time"] if train else None, exit_code=proc.returncode,
        first_step_seconds=offset + train[0]["time"] - train[0]["seconds"] if train else None,
        seconds_per_step=float(np.median([r["seconds"] for r in later])) if later else None,
        generate_per_step=float(np.median([r["generate"] for r in later])) if later else None,
        eval_seconds=evals[-1]["overhead"] + evals[-1]["seconds"], curve=curve, versions=config["versions"],
    )


def trl_ready(given: str | None, out: str, cfg) -> tuple[str | None, str]:
    """Part 8's TRL python and its note (trl_python), or (None, why the part is skipped). Asked before
    tba.py's side of part 8 runs, so that a skipped part costs no runs."""
    if cfg.task != "arith":
        return None, f"trl_grpo.py runs the arith task only, not {cfg.task}"
    python, note = trl_python(given, os.path.join(out, "trl-install.log"))
    print(f"8. {note}", flush=True)
    return python, note


def trl_part(seeds: list[int], python: str, note: str, cap: float, out: str, cfg, quick: bool) -> dict:
    """Part 8, TRL's side, on tba.py's setup `cfg` (model, B, K, temperature, length, steps, evaluation),
    with trl_ready's python and note: {"note", "python", "version", "runs": [run_trl's dict per seed]}."""
    setup = ["--steps", str(min(cfg.steps, 10) if quick else cfg.steps), "--prompts-per-step", str(cfg.prompts_per_step),
             "--samples-per-prompt", str(cfg.samples_per_prompt), "--temperature", str(cfg.temperature),
             "--max-new-tokens", str(cfg.max_new_tokens), "--decay-steps", str(cfg.decay_steps),
             "--eval-every", "2" if quick else str(cfg.eval_every), *(["--eval-limit", str(cfg.eval_limit)] if cfg.eval_limit else [])]
    runs = [run_trl(python, seed, cap, os.path.join(out, f"seed{seed}-trl"), cfg.model_path, setup) for seed in seeds]
    return dict(note=note, python=python, version=runs[0]["versions"]["trl"], runs=runs)


# --- 3: weight-sync cost ------------------------------------------------------------------------
def make_llama_100m(folder: str):
    """A ~100M-parameter Llama with random weights (GPT-2-small-like shape, 32k vocabulary)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from runtime import tiny
    config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=10,
                         num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=256,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tiny.make_tokenizer().save_pretrained(folder)  # a tokenizer is needed to start vLLM; never used here
    return folder


def devices(cfg) -> tuple[str, str]:
    """Where a run puts trainer rank 0 and searcher 0 (tba.py: trainer rank r on GPU r, searcher i on
    GPU ranks + i); one GPU serves both here if there is only one."""
    if cfg.device != "cuda":
        return "cpu", "cpu"
    return "cuda:0", f"cuda:{min(1, torch.cuda.device_count() - 1)}"


def sync_cost(model_path: str, cfg, repeat: int) -> dict:
    from transformers import AutoModelForCausalLM
    trainer, searcher_device = devices(cfg)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(trainer)
    shared = weights.create(torch.multiprocessing.get_context("spawn"))
    weights.allocate(shared, weights.gather(model), weights.aliases(model), trainer, getattr(torch, cfg.dtype))
    engine = Engine(dataclasses.replace(cfg, model_path=model_path), searcher_device, 0.2, [[1, 2, 3]], ["0"])
    version, inbox = [0], weights.Inbox(shared, 0, None, lambda: None, 60)

    def publish_once():  # the trainer's side: gather (a no-op on one rank) and copy into the shared tensors
        version[0] += 1
        weights.write(shared, weights.gather(model), version[0], lambda: None, 60)

    def reload_once():
        shared.version.value += 1
        engine.sync(inbox)  # reload into vLLM + prefix-cache reset, synchronised

    unique = {t.data_ptr(): t for t in shared.tensors.values()}.values()
    nbytes = sum(t.numel() * t.element_size() for t in unique)
    src, dst = (torch.empty(nbytes, dtype=torch.uint8, device=searcher_device) for _ in range(2))
    src.fill_(1)

    def plain_copy():
        dst.copy_(src)
        weights.synchronize([dst])

    out = dict(parameters=sum(p.numel() for p in model.parameters()), bytes=nbytes,
               publish=timed(publish_once, repeat), reload=timed(reload_once, repeat),
               plain_copy=timed(plain_copy, repeat))
    out["ratio"] = (out["publish"] + out["reload"]) / out["plain_copy"]
    engine.close()
    return out


# --- 4: searcher overhead -------------------------------------------------------------------------
def searcher_overhead(cfg, prompts, answers, repeat: int) -> dict:
    from runtime.decoding import sampling_params
    engine = Engine(cfg, devices(cfg)[1], 0.2, prompts, answers)
    ids = np.arange(cfg.prompts_per_step)
    n = cfg.search_samples_per_prompt

    def bare():  # the same requests, seeds and engine, nothing around them
        params = [sampling_params(cfg.temperature, cfg.max_new_tokens, (0, 0, 0, int(p)), n=n) for p in ids]
        outs = engine.llm.generate([{"prompt_token_ids": prompts[p]} for p in ids], params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    def loop():
        trajectories, stats = engine.search(ids, n, (0, 0, 0))
        return stats["tokens"]

    tokens = bare()
    assert tokens == loop()  # same seeds: the very same samples
    t_bare, t_loop = timed(bare, repeat), timed(loop, repeat)
    engine.close()
    count = len(ids) * n
    return dict(trajectories_per_s=count / t_loop, tokens_per_s=tokens / t_loop,
                bare_trajectories_per_s=count / t_bare, bare_tokens_per_s=tokens / t_bare, ratio=t_bare / t_loop)


# --- 5: trainer overhead ----------------------------------------------------------------------------
def trainer_overhead(cfg, prompts, repeat: int) -> dict:
    device = devices(cfg)[0]
    model = policy.load_policy(cfg.model_path, device, cfg.dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    rng = np.random.default_rng(0)
    B, K = cfg.prompts_per_step, cfg.samples_per_prompt
    batch = [[Trajectory(int(p), rng.integers(3, 60, size=4).astype(np.int32), float(rng.integers(2)), -5.0, -5.0, 0)
              for _ in range(K)] for p in rng.choice(len(prompts), B, replace=False)]  # all responses distinct
    ids, attention, _ = collate([(prompts[t.prompt_id], t.response) for g in batch for t in g], 0, device)

    def bare():
        model(input_ids=ids, attention_mask=attention).logits.sum().backward()
        model.zero_grad(set_to_none=True)
        weights.synchronize([ids])

    def tb_update():  # the trainer's step on one rank: tba.py's own code
        tba.gradient(cfg)(model, batch, 0, 1, prompts, 0, device, cfg, beta=cfg.beta)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        weights.synchronize([ids])

    tokens = int(attention.sum())
    t_bare, t_tb = timed(bare, repeat), timed(tb_update, repeat)
    return dict(tokens=tokens, tokens_per_s=tokens / t_tb, bare_tokens_per_s=tokens / t_bare, ratio=t_bare / t_tb)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help=f"seeds of the time-to-target runs (default: 0 1; part 9: 0-{PART9_SEEDS - 1})")
    p.add_argument("--cap", type=float, default=600, help="time cap of each run, seconds")
    p.add_argument("--out", default=None, help="output folder (default: runs/bench-<time>); one that holds anything is "
                   "refused, unless --overwrite")
    p.add_argument("--overwrite", action="store_true", help="replace the results an --out holds (bench.json, and each "
                   "run folder as its run starts again)")
    p.add_argument("--quick", action="store_true", help="a tiny budget (for the tests)")
    p.add_argument("--full", action="store_true", help="run tba.py to its end (whole accuracy curves for plot.py)")
    p.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3, 4, 5],
                   help="which measurements (2 comes with 1); 6: memory of a long TBA run (--minutes); "
                        "7: off-policy robustness of the losses; 8: TRL's GRPOTrainer on the same setup "
                        "(with tba.py and the synchronous baseline run to their end); 9: asynchrony on equal "
                        "hardware, emulated with --generation-slowdown; 10: fresher data per step (a searcher round's "
                        "size, k, m) in that regime; 11: a search round's cost against its size; 12: TBA' against "
                        "Dr. GRPO as staleness grows, in miniature")
    p.add_argument("--minutes", type=float, default=20, help="length of the run of part 6")
    p.add_argument("--searchers", type=int, nargs="+", default=[1, 4],
                   help="parts 9 and 10: the searcher counts N (each beside the synchronous run on N searchers)")
    p.add_argument("--ratios", type=float, nargs="*", default=[2, 1, 4],
                   help="part 9: the points G_N / T, both phases emulated from one calibration (--train-slowdown too); "
                        "the first is the main point, on every seed (the paper's balance for rho-math-1b on GSM8K on "
                        "an H100: about 2), the others on --few-seeds")
    p.add_argument("--slowdowns", type=float, nargs="*", default=[],
                   help="part 9: points of --generation-slowdown X alone, each run calibrating itself (CPU packing)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                   help="part 9: the modes at each point (MODES; --lag 0 first where named)")
    p.add_argument("--decoding", default="gpu+tails", choices=list(DECODINGS),
                   help="part 9: the points' emulated decoding: as on a GPU with GSM8K's long tail of answer lengths "
                        "(gpu+tails), or each running sequence's share (linear, the earlier cells')")
    p.add_argument("--few-seeds", type=int, default=FEW_SEEDS,
                   help="part 9: the seeds of the points after the main one (the first of --seeds)")
    p.add_argument("--gain", type=float, default=0.20, help="part 9: the target, held-out accuracy >= start + GAIN "
                   "(0.20: above the toy's plateau at 0.48-0.55; a task with a slower curve, `-- --task countdown`, "
                   "may want less: 0.1)")
    p.add_argument("--horizon", type=float, default=HORIZON, help="part 9: seconds every run runs from its first "
                   "round, whatever its accuracy: the window of the mean accuracy")
    p.add_argument("--eval-every", type=int, default=2, help="part 9: steps between evaluations")
    p.add_argument("--costs", default=None, help="part 9: an earlier run's OUT/calibration.json instead of a new one")
    p.add_argument("--lags", type=int, nargs="+", default=[0, 2, 10], help="part 12: the exact lags L")
    p.add_argument("--table", default=None, nargs="+", metavar="PART9_JSON",
                   help="print part 9's table recomputed from part9.json files (or bench.json) and run nothing: "
                   "several, the same gain and horizon, join their rows (a mode is named with its flags after --)")
    p.add_argument("--doc", default=None, help="with --table: write it into this file between its markers "
                   "(docs/performance.md)")
    p.add_argument("--picture", default=None, help="with --table: draw the main cell's curves and speed-ups into this "
                   "PNG (docs/part9.png; pip install matplotlib)")
    p.add_argument("--trl-python", default=None,
                   help="part 8: the python of a virtual environment holding TRL (default: make one in $TBA_CACHE/trl-venv)")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="after --: extra flags for tba.py (both modes)")
    args = p.parse_args(argv)
    if args.table:  # the table from the seeds' figures: nothing runs
        if args.doc and not (os.path.isfile(args.doc) and os.access(args.doc, os.R_OK | os.W_OK)):
            raise BadInput(f"--doc: {args.doc} is not a file this process can read and write")
        eh = read_per_seeds(args.table)
        lines = part9_table(eh)
        if args.doc:
            into_doc(args.doc, lines)
        if args.picture:
            curves_picture(eh, args.picture)
        print("\n".join(lines))
        return
    if args.doc or args.picture:
        raise BadInput(f"{'--doc' if args.doc else '--picture'} acts only with --table")
    flags = [f for f in args.flags if f != "--"]
    unknown = [n for n in args.parts if n not in PARTS]
    if unknown:
        raise BadInput(f"--parts {' '.join(map(str, unknown))}: no such part (they are {PARTS[0]}-{PARTS[-1]}: "
                       f"tools/bench.py --help)")
    for flag, value in (("--gain", args.gain), ("--horizon", args.horizon)):
        if value is not None and not 0 < value < float("inf"):  # NaN too
            raise BadInput(f"{flag} {value:g}: give a positive number")
    if args.few_seeds < 1:
        raise BadInput(f"--few-seeds {args.few_seeds}: give 1 or more")
    for flag, values, low in (("--ratios", args.ratios, 0), ("--slowdowns", args.slowdowns, 1), ("--cap", [args.cap], 0),
                              ("--minutes", [args.minutes], 0)):
        bad = next((v for v in values if not low <= v < float("inf") or v == 0), None)  # NaN too
        if bad is not None:
            raise BadInput(f"{flag} {bad:g}: give {'positive numbers' if low == 0 else 'numbers of at least 1'}")
    for flag, values, low in (("--searchers", args.searchers, 1), ("--eval-every", [args.eval_every], 1),
                              ("--seeds", args.seeds or [], 0), ("--lags", args.lags, 0)):
        bad = next((v for v in values if not low <= v < 2**32), None)  # (a seed: numpy's and tba.py's range)
        if bad is not None:
            raise BadInput(f"{flag} {bad}: give {'whole numbers of at least 1' if low else 'whole numbers of at least 0'}")
    for flag, values in (("--seeds", args.seeds or []), ("--modes", args.modes), ("--searchers", args.searchers),
                         ("--ratios", args.ratios)):
        if len(set(values)) < len(values):  # one run counted twice in the intervals
            raise BadInput(f"{flag} {' '.join(map(str, values))}: each at most once")
    if args.costs is not None:  # checked before anything is made or started
        if 9 not in args.parts:
            raise BadInput("--costs acts only with --parts 9")
        read_costs(args.costs)
    out = args.out or os.path.join("runs", time.strftime("bench-%Y%m%d-%H%M%S"))
    check_out(out, args.overwrite)
    os.makedirs(out, exist_ok=True)
    seeds9 = args.seeds or list(range(PART9_SEEDS))
    args.seeds = args.seeds or [0, 1]
    if args.quick:
        args.seeds, seeds9, args.cap = args.seeds[:1], seeds9[:1], min(args.cap, 90)
    repeat = 3 if args.quick else 10

    # the embedded default's config, as tba.py resolves it (this builds the tiny model if needed)
    cfg, data = checked(flags, args.parts)
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // 2)  # what the trainer and the searcher each get in a run with one searcher
    torch.set_num_threads(threads)  # before any vLLM engine starts in this process
    machine = dict(cores=cores, threads_per_process=threads, device=cfg.device, torch=torch.__version__,
                   cpu=next((line.split(":")[1].strip() for line in read_text("/proc/cpuinfo").splitlines()
                             if "model name" in line), "?"))
    result = dict(machine=machine, flags=flags, seeds=args.seeds, cap=args.cap)

    trl_py, trl_note = trl_ready(args.trl_python, out, cfg) if 8 in args.parts else (None, "")
    if 8 in args.parts and trl_py is None:
        result["trl"] = dict(note=trl_note)  # skipped: tba.py's side of 8 is not run either

    # 1, 2 (and tba.py's side of 8: whole runs)
    runs = []
    for seed in args.seeds if {1, 2} & set(args.parts) or trl_py else []:
        for searchers in (1, 0):  # 0: on-policy, as the README's synchronous baseline
            run_out = os.path.join(out, f"seed{seed}-searchers{searchers}")
            own = [*flags] if searchers else ["--lag", "0", *acting(flags, ["--lag", "0"], 0)]
            runs.append(run_until_target(searchers, seed, args.cap, run_out,
                                         ["--eval-every", "2" if args.quick else "10", *own],
                                         args.full or trl_py is not None))
    result["time_to_target"] = runs
    if trl_py:
        result["trl"] = trl_part(args.seeds, trl_py, trl_note, args.cap, out, cfg, args.quick)
    if 7 in args.parts:
        result["off_policy"] = off_policy(args.seeds, out, flags, args.quick)
    if 9 in args.parts:
        result["equal_hardware"] = eh = equal_hardware(
            seeds9, out, flags, args.cap, [1] if args.quick else args.searchers, [1.0] if args.quick else args.ratios,
            args.slowdowns, ["colocated", "sync", "stream", "full"] if args.quick else args.modes, 0.05 if args.quick
            else args.gain, args.eval_every, args.decoding, cfg, few=args.few_seeds, given=args.costs,
            horizon=QUICK_HORIZON if args.quick else args.horizon)
        write_json(os.path.join(out, "part9.json"), per_seed(eh, machine, sys.argv))  # beside docs/performance.md
    if 12 in args.parts:
        result["miniature"] = miniature(args.seeds, out, flags, args.quick, args.lags)
    if 10 in args.parts:
        result["fresher"] = fresher(args.seeds, out, flags, min(args.cap, 300), args.quick, cfg,
                                    counts=None if args.quick else args.searchers)
    if 6 in args.parts:
        result["memory"] = memory_growth(args.minutes, os.path.join(out, "memory-run"), flags)
    # 5, then 3 and 4 (they start vLLM engines, which share this process group)
    ranks.init_distributed(cfg.timeout, cfg.device)
    if 11 in args.parts:
        result["round_cost"] = round_cost(cfg, data.prompts, data.answers, [1, 2, 4] if args.quick else
                                          [1, 2, 4, 8, 16, 32, 64], repeat)
    if 5 in args.parts:
        result["trainer_overhead"] = trainer_overhead(cfg, data.prompts, repeat)
    if 4 in args.parts:
        result["searcher_overhead"] = searcher_overhead(cfg, data.prompts, data.answers, repeat)
    if 3 in args.parts:
        result["sync_cost"] = {"tiny": sync_cost(cfg.model_path, cfg, repeat)}
        if not args.quick:
            with tempfile.TemporaryDirectory() as folder:
                result["sync_cost"]["llama-100m"] = sync_cost(make_llama_100m(folder), cfg, repeat)
    write_json(os.path.join(out, "bench.json"), result)
    print(table(result))
    if 9 in args.parts:
        picture(os.path.join(out, "bench.json"), os.path.join(out, "equal_hardware.png"))
    print(f"\nwritten: {os.path.join(out, 'bench.json')}")
    os._exit(0)  # the vLLM engines' teardown would try to destroy the process group twice


def checked(flags: list[str], parts: list[int]) -> tuple:
    """The flags after `--` checked as tba.py checks them (a refusal: BadInput, one line): the run's config and data.
    Part 9 adds --generation-slowdown to each run, so its flags are checked beside it (the config returned is the
    flags' own), and it refuses a decoding shape there: each cell sets its own, and its X is chosen for it."""
    from runtime.errors import ConfigError
    shaped = [f for f in flags if f.split("=")[0] in ("--decode-cost", "--response-lengths")]
    if 9 in parts and shaped:  # X is chosen for the cell's shape (point): another shape would run at another G/T
        raise BadInput(f"{shaped[0].split('=')[0]} after --: part 9 sets the decoding's shape per cell (its X is chosen "
                       f"for it): give --decoding instead")
    emulated = 9 in parts and not any(f.split("=")[0] == "--generation-slowdown" for f in flags)
    try:
        cfg, data, _ = checks.check(checks.parse(Config, ["--generation-slowdown", "2"] * emulated + flags), world=1)
    except ConfigError as e:
        raise BadInput(f"the flags after --: {e}") from None
    return (dataclasses.replace(cfg, generation_slowdown=1.0) if emulated else cfg), data


def table(r: dict) -> str:
    m = r["machine"]
    lines = [f"machine: {m['cpu']}, {m['cores']} cores ({m['threads_per_process']} thread(s) per process), "
             f"torch {m['torch']}; tba.py flags: {' '.join(r['flags']) or '(the embedded default)'}", ""]
    if r["time_to_target"]:  # parts 1-5: only those that ran
        lines += ["1. time to target (held-out greedy accuracy >= start + 0.15), seconds from launch; sync: "
                  "--searchers 0 --lag 0 (one process, on-policy), async: one searcher",
                  f"   {'seed':>4} {'sync (s)':>9} {'async (s)':>10} {'ratio':>6}  | from the first step: "
                  f"{'sync':>5} {'async':>6} {'ratio':>6} | steps sync/async | s/step sync/async"]
    for seed in r["seeds"] if r["time_to_target"] else []:
        a, s = (next(x for x in r["time_to_target"] if x["seed"] == seed and x["searchers"] == n) for n in (1, 0))
        both = a["reached"] and s["reached"]
        fmt = lambda x, t: f"{t:.1f}" if x["reached"] else f">{r['cap']:.0f}"
        train = lambda x: x["seconds"] - x["first_step_seconds"] if x["reached"] else 0
        lines.append(f"   {seed:>4} {fmt(s, s['seconds'] or 0):>9} {fmt(a, a['seconds'] or 0):>10} "
                     f"{s['seconds'] / a['seconds'] if both else float('nan'):>6.2f}  |                      "
                     f"{fmt(s, train(s)):>5} {fmt(a, train(a)):>6} {train(s) / train(a) if both else float('nan'):>6.2f} | "
                     f"{str(s['step']) + '/' + str(a['step']):<16} | "
                     f"{s['seconds_per_step'] or 0:.3f}/{a['seconds_per_step'] or 0:.3f}")
    if r["time_to_target"]:  # the seeds' ratios: their median and its bootstrap interval
        by = {n: [next(x for x in r["time_to_target"] if x["seed"] == s and x["searchers"] == n)
                  for s in r["seeds"]] for n in (0, 1)}
        at = lambda x: x["seconds"] if x["reached"] else r["cap"]  # never: at the cap, a bound (`reached_by`)
        train = lambda x: at(x) - (x["first_step_seconds"] or 0)
        said = []
        for what, of in (("from launch", at), ("from the first step", train)):
            ratio, ends = plot.interval([of(s) / of(a) for s, a in zip(by[0], by[1])])
            said.append(f"{what} {'-' if ratio is None else f'{ratio:.2f}'}"
                        f" {f'[{ends[0]:.2f}, {ends[1]:.2f}]' if ends else '(no interval below 2 seeds)'}")
        lines.append(f"   sync / async, the median over {len(r['seeds'])} seed(s) with its "
                     f"{plot.BOOTSTRAP['level']:.0%} interval: {'; '.join(said)}")
    util = [x["utilisation"] for x in r["time_to_target"] if x["searchers"] == 1 and x["utilisation"] is not None]
    if r["time_to_target"]:
        lines.append(f"2. trainer utilisation (TBA runs): {', '.join(f'{u:.3f}' for u in util)}")
    if r.get("sync_cost"):
        lines.append("3. weight sync: publish + reload + prefix reset vs plain copy_ of the same bytes")
    for name, c in r.get("sync_cost", {}).items():
        lines.append(f"   {name:>10}: {c['parameters'] / 1e6:.1f}M params, publish {c['publish'] * 1e3:.2f} ms + "
                     f"reload {c['reload'] * 1e3:.2f} ms vs copy {c['plain_copy'] * 1e3:.2f} ms: {c['ratio']:.1f}x")
    s = r.get("searcher_overhead")
    if s is not None:
        lines.append(f"4. searcher: {s['trajectories_per_s']:.0f} trajectories/s, {s['tokens_per_s']:.0f} tokens/s vs "
                     f"bare vLLM {s['bare_trajectories_per_s']:.0f}/s, {s['bare_tokens_per_s']:.0f} tokens/s: {s['ratio']:.2f}")
    t = r.get("trainer_overhead")
    if t is not None:
        lines.append(f"5. trainer: {t['tokens_per_s']:.0f} tokens/s per TB update vs bare forward+backward "
                     f"{t['bare_tokens_per_s']:.0f}: {t['ratio']:.2f}")
    mem = r.get("memory")
    if mem:
        lines.append(f"6. memory of a {mem['minutes']:.0f}-minute TBA run ({mem['steps']} steps), all processes: "
                     f"{mem['mib_at_5_min']:.0f} MiB at 5 min, {mem['mib_at_end']:.0f} MiB at the end "
                     f"({100 * mem['growth_after_5_min']:+.1f}%), peak {mem['mib_peak']:.0f} MiB")
    study = r.get("off_policy")
    if study:
        st = study["settings"]
        lines += [f"7. off-policy robustness: one process, sync every step, --lag L (every batch its step's rounds, "
                  f"L steps stale); "
                  f"lr {st['lr']:g}, beta {st['beta']:g}, {st['steps']} steps of {st['prompts_per_step']} x "
                  f"{st['samples_per_prompt']}, temperature {st['temperature']:g}, grpo clip {st['clip']:g}; "
                  f"end = mean of the last 3 evaluations",
                  f"   {'loss':>5} {'lag':>4} {'staleness':>9} {'start':>6} | {'end, per seed':>18} | {'best, per seed':>18} "
                  f"| collapsed"]
        for loss in study["losses"]:
            for lag in study["lags"]:
                mine = [x for x in study["rows"] if x["loss"] == loss and x["lag"] == lag]
                per = lambda k: " / ".join(f"{x[k]:.3f}" for x in mine)
                lines.append(f"   {loss:>5} {lag:>4} {np.mean([x['staleness'] for x in mine]):>9.1f} {mine[0]['start']:>6.3f} | "
                             f"{per('final'):>18} | {per('best'):>18} | "
                             f"{sum(x['collapsed'] for x in mine)} of {len(mine)}")
    trl = r.get("trl")
    if trl and "runs" not in trl:
        lines.append(f"8. TRL GRPOTrainer: skipped: {trl['note']}")
    elif trl:
        v = trl["runs"][0]["versions"]
        secs = lambda t: f"{t:.1f}" if t is not None else "-"
        lines += [f"8. TRL GRPOTrainer (trl {v['trl']}, transformers {v['transformers']}, torch {v['torch']}) against "
                  f"tba.py on the same setup; seconds from launch, evaluation time left out where it is the trainer's",
                  f"   {'seed':>4} {'run':<22} {'start':>6} {'+0.15 (s)':>10} {'+0.25 (s)':>10} {'final':>6} "
                  f"{'total (s)':>10} {'first step (s)':>15} {'s/step':>7}"]
        for x in trl["runs"]:
            ours = [y for y in r["time_to_target"] if y["seed"] == x["seed"]]
            rows = [("TRL GRPO", x["start_accuracy"], x["seconds_to_015"], x["seconds_to_025"], x["final_accuracy"],
                     x["seconds"], x["first_step_seconds"], x["seconds_per_step"])]
            for y in sorted(ours, key=lambda y: -y["searchers"]):
                start = y["start_accuracy"]
                done = y["curve"][-1][2] if y["curve"][-1][1] == trl["runs"][0]["steps"] else None
                rows.append(("tba.py, 1 searcher" if y["searchers"] else "tba.py, sync (--lag 0)", start,
                             reached(y["curve"], start + 0.15)[0], reached(y["curve"], start + 0.25)[0], done,
                             y["curve"][-1][0], y["first_step_seconds"], y["seconds_per_step"]))
            for name, start, t15, t25, final, total, first, per_step in rows:
                lines.append(f"   {x['seed']:>4} {name:<22} {start:>6.3f} {secs(t15):>10} {secs(t25):>10} "
                             f"{final if final is not None else float('nan'):>6.3f} {secs(total):>10} {secs(first):>15} "
                             f"{per_step or 0:>7.3f}")
    eh = r.get("equal_hardware")
    if eh:
        lines += part9_table(eh)
    rc = r.get("round_cost")
    if rc:
        lines += [f"11. a search round's cost against its size (one engine, warm; K = {rc['K']}): generation, and the "
                  f"whole round (rewards, pi_ref's log-probs)",
                  f"   {'prompts':>7} | {'generate (s)':>12} {'per prompt':>10} | {'round (s)':>9} {'per prompt':>10}"]
        for x in rc["rows"]:
            lines.append(f"   {x['prompts']:>7} | {x['generate']:>12.4f} {x['generate'] / x['prompts']:>10.4f} | "
                         f"{x['round']:>9.4f} {x['round'] / x['prompts']:>10.4f}")
        (g1, g0), (r1, r0) = rc["generate_fit"], rc["round_fit"]
        lines.append(f"   fit: generate = {g0:.4f} s + {g1:.4f} s a prompt; round = {r0:.4f} s + {r1:.4f} s a prompt")
    mi = r.get("miniature")
    if mi:
        lines += ["12. TBA' (tbprime, beta 0.005, pi_ref reset every 50) against Dr. GRPO (drgrpo), one searcher, "
                  "every batch exactly L steps stale: held-out accuracy at the end (mean of the last 3) / best",
                  f"   {'loss':<8} " + " ".join(f"{'L ' + str(lag):>23}" for lag in mi["lags"])]
        for loss in mi["losses"]:
            cells = []
            for lag in mi["lags"]:
                mine = [x for x in mi["rows"] if x["loss"] == loss and x["lag"] == lag]
                cells.append(" ".join(f"{x['final']:.3f}/{x['best']:.3f}" for x in mine))
            lines.append(f"   {loss:<8} " + " ".join(f"{c:>23}" for c in cells))
    fr = r.get("fresher")
    if fr:
        per = lambda rows, f: " / ".join(f(x) for x in rows)
        secs = lambda t: f"{t:.1f}" if t is not None else "-"
        times = lambda t: f"{t:.2f}x" if t is not None else "-"
        lines += [f"10. fresher data per step at --generation-slowdown {fr['x']:g}: one lever changed at a time; seconds "
                  f"to start + 0.15 from launch and from the first step (per seed), the step it was reached at, "
                  f"speed-ups over the one-process run (--searchers 0, replaying: m = 0.95) of the same seed",
                  f"   {'N':>2} {'variant':<11} | {'+0.15 (s)':>13} | {'1st step':>13} | {'step':>9} | {'stale':>5} | "
                  f"{'speed-up':>13} | {'1st step':>13}"]
        for n in [0] + fr["searchers"]:
            for v in fr["variants"] if n else ["one process"]:
                mine = [x for x in fr["rows"] if x["searchers"] == n and x["variant"] == v]
                stale = [x["staleness"] for x in mine if x["staleness"] is not None]
                lines.append(f"   {n:>2} {v:<11} | {per(mine, lambda x: secs(x['seconds'])):>13} | "
                             f"{per(mine, lambda x: secs(x['from_first_step'])):>13} | "
                             f"{per(mine, lambda x: str(x['step'] or '-')):>9} | "
                             f"{np.mean(stale) if stale else float('nan'):>5.1f} | "
                             f"{per(mine, lambda x: times(x['speedup'])):>13} | "
                             f"{per(mine, lambda x: times(x['speedup_first_step'])):>13}")
    return "\n".join(lines)


def times_ci(point, ci) -> str:
    """A speed-up and its interval: "1.62x [1.41, 1.80]" ("-" without one)."""
    x = lambda v: "inf" if v == float("inf") else f"{v:.2f}"
    return "-" if point is None else f"{x(point)}x" + (f" [{x(ci[0])}, {x(ci[1])}]" if ci else "")


def plus_ci(point, ci) -> str:
    """A gain in mean accuracy and its interval: "+0.021 [+0.010, +0.033]" ("-" without one)."""
    return "-" if point is None else f"{point:+.3f}" + (f" [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "")


TABLE_START = "<!-- part 9's table: python tools/bench.py --table docs/performance-part9.json --doc docs/performance.md -->"
TABLE_END = "<!-- end of part 9's table -->"
PLACEHOLDER = "(Placeholder: the figures come from the runs of part 9's plan; docs/performance-part9.json is not in the tree yet.)"


def part9_table(eh: dict) -> list[str]:
    """Part 9's table in Markdown (the console prints it, docs/performance.md holds it between TABLE_START and TABLE_END,
    recomputed from part9.json), from a bench.json's part 9 or a part9.json (`per_seed` rows): a row per cell and
    mode, then which pairs of modes of a cell the seeds resolve, with the correction said, then the scaling."""
    summary = eh.get("summary") or hardware_summary(eh["rows"])
    fmt = lambda t, f="{:.2f}": f.format(t) if t is not None else "-"
    c0, level = eh.get("costs"), summary["intervals"]["level"]
    lines = [f"Time to held-out accuracy >= start + {eh['gain']:g}, interpolated between the two evaluations around "
             f"it, every run {eh['horizon']:g} s from its first round (one that never reached it: its horizon, a bound "
             f"that understates the other's speed-up); speed-ups over the colocated run (N + 1 devices) and over --lag "
             f"0 (the same N searchers), each the geometric mean of the seeds' paired ratios with a {level:.0%} t "
             f"interval of their logs: from the first round (every mode's clock) and from launch (start-up counted); "
             f"bound: (G + T) / max(a searcher's mean cycle, T + publish) from the --lag 0 rows, on throughput; gain: "
             f"the mean accuracy over the {eh['horizon']:g} s over --lag 0's; steps and steps a second: learning "
             f"and throughput apart (medians); G, T, publish: the round, the step and the publish (medians, s); "
             f"uncharged: the work no emulated device pays for, a round (reload / the rest: scoring, pi_ref); over: "
             f"the most any process ran above its own charge, that work counted (CPU-bound above {CPU_BOUND:.0%}: no "
             f"speed-up given)" + (f". Emulated costs alone: {c0['seconds_per_token'] * 1e3:.3f} ms a token, a step "
                                   f"{c0['train_step']:.3f} s" if c0 else "") + ".", "",
             "| N | G/T | X | Y | decoding | mode | reached | 1st round: over colocated | over --lag 0 | launch: over "
             "colocated | over --lag 0 | bound | gain over --lag 0 | steps | step/s | stale | G | T | publish | "
             "uncharged | over |",
             "|" + "---|" * 21]
    for c in summary["cells"].values():
        said = lambda base, key: ("CPU-bound" if c[f"over_{base}"]["withheld"] else
                                  times_ci(c[f"over_{base}"][key], c[f"over_{base}"][key + "_ci"])) \
            if f"over_{base}" in c else "1x" if c["mode"] == base else "-"
        gain = ("CPU-bound" if c.get("accuracy_gain") is None and c["cpu_bound"] else
                plus_ci(c.get("accuracy_gain"), c.get("accuracy_gain_ci")) if c["mode"] != "sync" else "+0")
        unch = " / ".join(f"{c['uncharged'].get(p, 0.0):.3f}" for p in ("reload", "score")) if c["uncharged"] else "-"
        lines.append(f"| {c['searchers']} | {fmt(c['ratio'], '{:g}')} | {c['x']:g} | {c['y']:g} | {c['shape']} | "
                     f"{c['mode']} | {c['reached']}/{c['runs']} | {said('colocated', 'first_round')} | "
                     f"{said('sync', 'first_round')} | {said('colocated', 'launch')} | {said('sync', 'launch')} | "
                     f"{fmt(c['bound'])} | {gain} | {fmt(c['steps'], '{:.1f}')} | {fmt(c['steps_per_s'])} | "
                     f"{fmt(c['staleness'])} | {fmt(c['G'], '{:.3f}')} | {fmt(c['T'], '{:.3f}')} | "
                     f"{fmt(c['publish'], '{:.3f}')} | {unch} | {c['over']:.0%} |")
    if summary["pairs"]:
        lines += ["", f"Pairs of modes, the later's speed-up over the earlier from the first round and its gain in mean "
                      f"accuracy, paired by seed; resolved where the t interval excludes no difference, each interval "
                      f"at its cell's corrected level (Bonferroni: a cell's P pairs make 2P claims, each interval at "
                      f"1 - {1 - level:.0%} / 2P), so that all of a cell's \"resolved\" hold together at "
                      f"{level:.0%}:", ""]
    for p in summary["pairs"]:
        where = f"N {p['searchers']} {'G/T %g' % p['ratio'] if p['ratio'] else 'X %g' % p['x']} {p['shape']}"
        head = f"- {where}, {p['b']} over {p['a']}"
        if p["cpu_bound"]:
            lines.append(f"{head}: not compared (CPU-bound)")
            continue
        said = lambda ok, ci: "resolved" if ok else "not resolved" if ci else "no interval (under 2 seeds)"
        lines.append(f"{head} ({p['level']:.2%} intervals, {p['seeds']} seeds): {times_ci(p['speedup'], p['speedup_ci'])} "
                     f"{said(p['resolved'], p['speedup_ci'])}; gain {plus_ci(p['accuracy_gain'], p['accuracy_gain_ci'])} "
                     f"{said(p['gain_resolved'], p['accuracy_gain_ci'])}")
    for s in summary["scaling"]:
        lines += ["", f"Scaling at G/T {s['ratio']:g} ({s['shape']}, the same X and Y): streaming with {s['many']} "
                      f"searchers reaches the target {times_ci(s['speedup'], s['speedup_ci'])} sooner than with "
                      f"{s['few']} from the first round ({s['seeds']} seeds, {level:.0%} interval; "
                      f"{s['many'] / s['few']:g}x is the number of searchers); throughput "
                      f"{fmt(s['throughput'])}x; a searcher's own cycle {fmt(s['cycle_many'], '{:.3f}')} s against "
                      f"{fmt(s['cycle_few'], '{:.3f}')} s."]
    return lines


def per_seed(eh: dict, machine: dict, command: list[str]) -> dict:
    """part9.json: what the table is computed from, small enough to commit beside docs/performance.md (`--table`
    recomputes the table, docs/performance.md's too): the target, the costs, the machine, the command, and each run's
    PER_SEED figures."""
    return dict(gain=eh["gain"], horizon=eh["horizon"], costs=eh["costs"] and {k: eh["costs"][k] for k in COSTS},
                machine=machine, command=command, took=eh.get("took"),
                rows=[{k: r.get(k) for k in PER_SEED} for r in eh["rows"]])


def read_per_seed(path: str) -> dict:
    """--table FILE: a part9.json (`per_seed`) or a bench.json with part 9; BadInput in one line if it is neither."""
    try:
        data = json.loads(read_text(path))
    except (OSError, ValueError) as e:
        raise BadInput(f"--table: {path} does not read as JSON ({type(e).__name__})") from None
    data = data.get("equal_hardware", data) if isinstance(data, dict) else None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list) or "gain" not in data:
        raise BadInput(f"--table: {path} is not a part9.json nor a bench.json with part 9")
    if not data["rows"]:  # (with --doc an empty table would replace the document's)
        raise BadInput(f"--table: {path} holds no rows")
    missing = next((k for r in data["rows"] for k in PER_SEED if not isinstance(r, dict) or k not in r), None)
    if missing:
        raise BadInput(f"--table: {path}: a row has no {missing}")
    words = ("shape", "mode", "over_process", "uncharged", "reached", "evals")  # every other figure a number, or none
    odd = next(((k, r[k]) for r in data["rows"] for k in PER_SEED if k not in words and r[k] is not None
                and (isinstance(r[k], bool) or not isinstance(r[k], (int, float)))), None)
    if odd:
        raise BadInput(f"--table: {path}: a row's {odd[0]} is {odd[1]!r}, not a number")
    return dict(data, summary=None)


def read_per_seeds(paths: list[str]) -> dict:
    """--table FILE...: their rows joined (`read_per_seed` each), so that runs made one after another (one mode with
    `-- --max-reuse 2`, another with none) make one table; BadInput in one line where their gain or horizon differ."""
    parts = [read_per_seed(p) for p in paths]
    same = lambda d: (d["gain"], d.get("horizon"), d.get("costs"))  # one target, horizon and emulated machine
    for p, d in zip(paths[1:], parts[1:]):
        if same(d) != same(parts[0]):
            raise BadInput(f"--table: {p} and {paths[0]} differ in gain, horizon or calibration (pass --costs with "
                           f"the first run's calibration.json): one table needs one target, horizon and machine")
    return dict(parts[0], rows=[r for d in parts for r in d["rows"]])


def into_doc(doc: str, lines: list[str]):
    """Replace docs/performance.md's table (between TABLE_START and TABLE_END) with `lines`, the rest as it was."""
    text = read_text(doc)
    if TABLE_START not in text or TABLE_END not in text:
        raise BadInput(f"--doc: {doc} has no part 9 table's markers ({TABLE_START} ... {TABLE_END})")
    head, rest = text.split(TABLE_START, 1)
    with open(doc, "w") as f:
        f.write(head + TABLE_START + "\n" + "\n".join(lines) + "\n" + TABLE_END + rest.split(TABLE_END, 1)[1])


def cli():
    """main() with its refusals in one line (status 2) and a signal's stop in one line (128 + the signal), after
    every run bench.py started is killed."""
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, on_signal)
    try:
        main()
    except BadInput as e:
        print(f"bench.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:  # Stopped, or a KeyboardInterrupt raised by a library
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        SIGNALLED["signum"] = signum  # a signal from here on: at once
        for proc in list(RUNNING.values()):  # those `finally:` blocks have not reached (a signal inside `start`)
            stop(proc)
        print(f"bench.py: stopped by {signal.Signals(signum).name}; every run it started is stopped", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + signum)  # as main's end: no vLLM engine teardown


if __name__ == "__main__":
    cli()
