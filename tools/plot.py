"""Pictures of runs, drawn from their metrics.jsonl.

    python tools/plot.py RUN_DIR [RUN_DIR ...] [-o FILE.png]    # one or several runs side by side
    python tools/plot.py --study BENCH_JSON [-o FILE.png]        # bench.py part 7: score against staleness
    python tools/plot.py --slowdown BENCH_JSON... [-o FILE.png]  # bench.py part 9: asynchrony on equal hardware

A run picture has six panels, one line per run: the held-out score (accuracy, or win rate for
tldr) against seconds of training (wall time minus the trainer's evaluation and checkpoint time,
so that runs that evaluate elsewhere compare fairly) and against steps; the training reward; the
loss; the staleness of the batches (mean, and max dotted); the seconds the trainer waited for data.
Red-teaming runs (`--task redteam`) also get the paper's Pareto picture beside it (FILE_pareto.png):
toxicity against diversity, one point per evaluation, each run's points joined in step order and
its last one ringed.
The pictures in docs/ are drawn by this file from `bench.py`'s run folders and bench.json.
matplotlib is imported here only (pip install matplotlib); without it this file says so in one line
(status 2) and bench.py skips its picture. A run still being written is drawn without its half-written
last line (a line says so); a bad line elsewhere, or a run with no rows yet, is refused in one line
(status 2). A bench.json is checked before matplotlib is imported: a file missing or not JSON, or a field
missing or of another type, is refused in one line naming the file and the field (status 2). `-o` makes the
picture's folder if it does not exist.
"""

import argparse
import json
import os
import sys


class BadRun(Exception):
    """A run folder that cannot be drawn, or a picture that cannot be written: one line (status 2)."""


def read(run: str) -> tuple[list[dict], list[dict], dict]:
    """(train rows, eval rows, config) of a run folder: its latest branch's rows (`latest`). A last line
    without its newline that does not parse is left out, with a line saying so: the run may be writing it
    (or died doing so); a bad line anywhere else is BadRun."""
    path = os.path.join(run, "metrics.jsonl")
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")  # a complete file ends with a newline: its last element is ""
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise BadRun(f"{path} line {number}: not valid JSON") from None
            print(f"plot.py: {path}: its last line is incomplete (still being written?); left out", file=sys.stderr)
    rows = latest(rows)
    config = {}
    if os.path.isfile(os.path.join(run, "config.json")):
        with open(os.path.join(run, "config.json")) as f:
            config = json.load(f)
    return [r for r in rows if r["kind"] == "train"], [r for r in rows if r["kind"] == "eval"], config


def latest(rows: list[dict]) -> list[dict]:
    """The rows of a run as its latest process left them. A process that resumed from step s marks its rows
    `resumed: s` and redoes what came after the checkpoint: its rows replace the earlier ones' train rows after
    s and eval rows from s on. A new process is a new `resumed` value, or the same one again (two resumes from
    one checkpoint) once a train step or an evaluated step repeats: within one process both only increase."""
    kept, branch, last, evaluated = [], None, -1, set()
    for r in rows:
        s = r.get("resumed")
        if s is not None and (s != branch or (r["step"] <= last if r["kind"] == "train" else r["step"] in evaluated)):
            kept = [k for k in kept if (k["step"] <= s if k["kind"] == "train" else k["step"] < s)]
            branch, last, evaluated = s, -1, set()
        if r["kind"] == "train":
            last = r["step"]
        else:
            evaluated.add(r["step"])
        kept.append(r)
    return kept


def label(run: str, config: dict) -> str:
    name = os.path.basename(os.path.normpath(run))
    if "trl" in config.get("versions", {}):  # trl_grpo.py's run folder
        return f"{name} (TRL {config['versions']['trl']} GRPOTrainer)"
    mode = f"{config['searchers']} searcher(s)" if config.get("searchers") else "synchronous"
    return f"{name} ({mode}, {config.get('loss', 'tb')})" if config else run


def runs(loaded: dict[str, tuple], out: str, title: str | None = None):
    """The run picture of `loaded`: each run folder's `read`."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    score = "accuracy"
    for i, (run, (train, evals, config)) in enumerate(loaded.items()):
        score = config.get("score", "accuracy")
        color, name = f"C{i % 10}", label(run, config)

        def curve(ax, key, style="-"):  # rows without the key (TRL's have no staleness or wait) are left out
            rows = [r for r in train if key in r]
            ax.plot([r["step"] for r in rows], [r[key] for r in rows], style, color=color, linewidth=0.8)

        if evals:
            axes[0, 0].plot([e["time"] - e["overhead"] for e in evals], [e[score] for e in evals], ".-", color=color, label=name)
            axes[0, 1].plot([e["step"] for e in evals], [e[score] for e in evals], ".-", color=color)
        curve(axes[0, 2], "reward")
        curve(axes[1, 0], "loss")
        curve(axes[1, 1], "staleness")
        curve(axes[1, 1], "staleness_max", ":")
        curve(axes[1, 2], "wait")
    held_out = f"held-out {score.replace('_', ' ')}"
    for ax, x, y in ((axes[0, 0], "seconds of training (evaluation left out)", held_out), (axes[0, 1], "step", held_out),
                     (axes[0, 2], "step", "training reward (batch mean)"), (axes[1, 0], "step", "loss"),
                     (axes[1, 1], "step", "staleness, mean (max dotted)"), (axes[1, 2], "step", "trainer wait (s)")):
        ax.set(xlabel=x, ylabel=y)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7, loc="lower right")
    if title:
        fig.suptitle(title)
    save(fig, out)


def pareto(loaded: dict[str, tuple], out: str):
    """Red-teaming: toxicity against diversity (the paper's Table 6 and Lee et al.'s Pareto picture)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.8))
    for i, (run, (_, evals, config)) in enumerate(loaded.items()):
        evals = sorted(evals, key=lambda e: e["step"])
        x, y = [e["diversity"] for e in evals], [e["toxicity"] for e in evals]
        ax.plot(x, y, ".-", color=f"C{i % 10}", linewidth=0.8, alpha=0.7, label=f"{label(run, config)}, steps "
                f"{evals[0]['step']}-{evals[-1]['step']}" if evals else label(run, config))
        if evals:
            ax.plot(x[-1:], y[-1:], "o", color=f"C{i % 10}", fillstyle="none", markersize=10)
    ax.set(xlabel="diversity (1 - mean cosine similarity of the attacks)", ylabel="toxicity (mean P(unsafe))",
           title="red-teaming: each evaluation of each run (last ringed)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    save(fig, out)


# --- bench.json, checked before matplotlib is imported: a bad or hand-edited file named in one line (status 2) ---
KINDS = {"a number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),  # JSON true is no number
         "a number or null": lambda v: v is None or KINDS["a number"](v),
         "a whole number": lambda v: isinstance(v, int) and not isinstance(v, bool),
         "a string": lambda v: isinstance(v, str), "a list": lambda v: isinstance(v, list),
         "an object": lambda v: isinstance(v, dict), "an object or null": lambda v: v is None or isinstance(v, dict)}


def field(path: str, obj: dict, key: str, kind: str, where: str):
    """obj[key], where it is `kind` (KINDS); else BadRun naming the file and the field (`where`.`key`)."""
    if key not in obj:
        raise BadRun(f"{path}: {where}.{key} is missing")
    if not KINDS[kind](obj[key]):
        shown = json.dumps(obj[key])
        raise BadRun(f"{path}: {where}.{key} is {shown if len(shown) <= 40 else shown[:37] + '...'}, not {kind}")
    return obj[key]


def rows_of(path: str, part: dict, where: str, fields: dict[str, str]) -> list[dict]:
    """part["rows"]: a list of objects, each with `fields` ({name: kind}) checked."""
    rows = field(path, part, "rows", "a list", where)
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise BadRun(f"{path}: {where}.rows[{i}] is not an object")
        for key, kind in fields.items():
            field(path, row, key, kind, f"{where}.rows[{i}]")
    return rows


def read_bench(path: str, part: str, flag: str) -> dict:
    """bench.json's `part` (an object), or BadRun in one line: a file missing or unreadable, not JSON, or without it."""
    try:
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
    except FileNotFoundError:
        raise BadRun(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BadRun(f"{path} cannot be read ({getattr(e, 'strerror', None) or type(e).__name__})") from None
    except ValueError:
        raise BadRun(f"{path} does not read as a bench.json (not JSON)") from None
    if not isinstance(result, dict) or not isinstance(result.get(part), dict):
        raise BadRun(f"{path} holds no {flag}")
    return result[part]


STUDY_ROW = dict(loss="a string", lag="a number", staleness="a number", final="a number", start="a number")


def read_study(bench_json: str) -> dict:
    """bench.py part 7 of a bench.json, each field study() reads checked (BadRun, one line)."""
    part = read_bench(bench_json, "off_policy", "part 7 (bench.py --parts 7)")
    losses = field(bench_json, part, "losses", "a list", "off_policy")
    if not all(isinstance(loss, str) for loss in losses):
        raise BadRun(f"{bench_json}: off_policy.losses is not a list of loss names")
    if not rows_of(bench_json, part, "off_policy", STUDY_ROW):
        raise BadRun(f"{bench_json}: off_policy.rows is empty")
    return part


def study(bench_json: str, out: str):
    """bench.py part 7: final held-out accuracy against staleness, one line per loss, each seed shown."""
    result = {"off_policy": read_study(bench_json)}
    plt = pyplot()
    rows = result["off_policy"]["rows"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, loss in enumerate(result["off_policy"]["losses"]):
        mine = [r for r in rows if r["loss"] == loss]
        lags = sorted({r["lag"] for r in mine})
        mean = lambda lag, key: sum(r[key] for r in mine if r["lag"] == lag) / len([r for r in mine if r["lag"] == lag])
        style, marker = ["-", "--", "-."][i % 3], "osD^v"[i % 5]  # lines that coincide (tb, rloo) stay visible
        ax.plot([mean(lag, "staleness") for lag in lags], [mean(lag, "final") for lag in lags], style, color=f"C{i}", label=f"{loss} (mean of seeds)")
        ax.plot([r["staleness"] for r in mine], [r["final"] for r in mine], marker, color=f"C{i}", alpha=0.5,
                markersize=7 - 2 * (i % 3), fillstyle="none" if i % 2 else "full")
    start = rows[0]["start"]
    ax.axhline(start, color="gray", linewidth=0.8, linestyle=":", label="start (the warm-started model)")
    ax.set(xlabel="staleness of every batch (steps)", ylabel="held-out accuracy at the end (mean of last 3)",
           title="off-policy robustness: same lr, beta, steps and batch for every loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save(fig, out)


# the fields of part 9's rows that equal_hardware reads (bench.py's hardware_row: null where a run has none); those
# of PART9_NEWER only where the row has them (a bench.json written before they were: the first evaluation past the
# target alone, no interval)
PART9_ROW = dict(searchers="a whole number", ratio="a number or null", shape="a string", mode="a string",
                 steps_per_s="a number or null", step="a number or null")
PART9_NEWER = dict(speedup_interp_first_step="a number or null", step_interp="a number or null",
                   speedup_first_step="a number or null", bound="a number or null")

BOOTSTRAP = dict(resamples=2000, level=0.90, seed=0)  # part 9's intervals: bench.py's table and the picture alike


def interval(values, stat=None, resamples: int = BOOTSTRAP["resamples"], level: float = BOOTSTRAP["level"],
             seed: int = BOOTSTRAP["seed"]) -> tuple[float | None, list[float] | None]:
    """(stat of `values`, [lo, hi]): a percentile bootstrap of `stat` (default the median) over `values`, one per
    seed, resampled `resamples` times with replacement by a fixed RNG, so that the same runs give the same interval;
    NaN values are left out; no interval below 2 values, (None, None) with none. The ends are order statistics of the
    resampled statistics (the 5th and 95th percentiles at 90%), not interpolated between them."""
    import numpy as np
    stat = stat or np.median
    v = np.asarray([x for x in values if x == x], dtype=float)
    if not len(v):
        return None, None
    point = float(stat(v))
    if len(v) < 2:
        return point, None
    draws = np.sort(stat(v[np.random.default_rng(seed).integers(0, len(v), (resamples, len(v)))], axis=1))
    lo, hi = (1 - level) / 2 * (resamples - 1), (1 + level) / 2 * (resamples - 1)
    return point, [float(draws[int(np.floor(lo))]), float(draws[int(np.ceil(hi))])]


def read_part9(bench_jsons: list[str]) -> dict:
    """Part 9 of one or more bench.json as one (a sweep run in parts): every file's rows and searcher counts, each
    field equal_hardware reads checked (BadRun in one line naming the file and the field). Files of another target
    or other emulated costs (bench.py --costs shares them) are refused, not drawn together."""
    parts = []
    for bench_json in bench_jsons:
        part = read_bench(bench_json, "equal_hardware", "part 9 (bench.py --parts 9)")
        field(bench_json, part, "gain", "a number", "equal_hardware")
        counts = field(bench_json, part, "searchers", "a list", "equal_hardware")
        if not counts or not all(KINDS["a whole number"](n) and n > 0 for n in counts):
            raise BadRun(f"{bench_json}: equal_hardware.searchers is {json.dumps(counts)[:40]}, not a list of searcher counts")
        if "costs" in part:
            field(bench_json, part, "costs", "an object or null", "equal_hardware")
        for i, row in enumerate(rows_of(bench_json, part, "equal_hardware", PART9_ROW)):
            for key, kind in PART9_NEWER.items():
                if key in row:
                    field(bench_json, row, key, kind, f"equal_hardware.rows[{i}]")
        same = lambda p: (p["gain"], {k: v for k, v in (p.get("costs") or {}).items() if k != "file"})
        if parts and same(part) != same(parts[0]):
            raise BadRun(f"{bench_json}: another target or other emulated costs than {bench_jsons[0]}")
        parts.append(part)
    return dict(parts[0], searchers=sorted({n for part in parts for n in part["searchers"]}),
                rows=[r for part in parts for r in part["rows"]])


def equal_hardware(bench_jsons: list[str], out: str):
    """bench.py part 9 (read_part9: one or more bench.json) along G_N / T (both phases emulated, the most searchers,
    the first point's decoding): left, each mode's speed-up over the synchronous baseline on the same searchers (--lag
    0) in time to the target from the first step, interpolated between evaluations where the rows have it (else the
    first evaluation past it), with the bound on throughput (G + T) / max(a searcher's cycle, T + publish) dashed
    where the rows have it (dots: seeds; squares: the median of the seeds' ratios, with its 90% bootstrap interval,
    `interval`); middle, its throughput in steps a second; right, the steps it needed (learning). Each mode's points
    sit a little apart along G / T, so that the bars do not hide each other."""
    eh = read_part9(bench_jsons)  # the files first: a bad one is named even where matplotlib is missing
    rows = [r for r in eh["rows"] if r["ratio"] and r["searchers"] == max(eh["searchers"])]
    rows = [r for r in rows if r["shape"] == rows[0]["shape"]] if rows else []
    if not rows:
        raise BadRun(f"{' '.join(bench_jsons)}: no point of part 9 with both phases emulated")
    plt = pyplot()
    newer = all("speedup_interp_first_step" in r for r in rows)  # one measure for all, never two mixed
    speedup, steps_key = ("speedup_interp_first_step", "step_interp") if newer else ("speedup_first_step", "step")
    ratios = sorted({r["ratio"] for r in rows})
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    median = lambda v: sorted(v)[len(v) // 2] if v else float("nan")
    fig, (speed, rate, steps) = plt.subplots(1, 3, figsize=(16, 4.8))
    bound = [median([r["bound"] for r in rows if r["ratio"] == x and r["mode"] == "sync" and r.get("bound")])
             for x in ratios]
    if any(b == b for b in bound):  # (NaN where a point has none: an older file's)
        speed.plot(ratios, bound, "--", color="gray", label="bound, throughput")
    for i, mode in enumerate(modes):
        mine = [r for r in rows if r["mode"] == mode]
        apart = [x * 1.04 ** (i - (len(modes) - 1) / 2) for x in ratios]  # log axis: the same gap at every point
        for ax, key in ((speed, speedup), (rate, "steps_per_s"), (steps, steps_key)):
            # a speed-up of 0 is a seed that never reached the target: kept (it counts in the median), drawn at 0
            got = [[r[key] for r in mine if r["ratio"] == x and r[key] is not None and (r[key] or key == speedup)]
                   for x in ratios]
            for x, g in zip(apart, got):
                ax.plot([x] * len(g), g, "o", color=f"C{i}", alpha=0.35, markersize=4)
            if ax is speed:
                both = [interval(g) for g in got]
                mid = [m if m is not None else float("nan") for m, _ in both]
                bars = [[max(0.0, m - ci[0]) if ci else 0 for m, (_, ci) in zip(mid, both)],  # (an end may be the
                        [max(0.0, ci[1] - m) if ci else 0 for m, (_, ci) in zip(mid, both)]]   # median itself)
                finite = all(b == b and b != float("inf") for side in bars for b in side)
                ax.errorbar(apart, mid, yerr=bars if finite else None, fmt="-s", color=f"C{i}", capsize=3, markersize=5,
                            label=f"{mode} (90% interval)" if finite else mode)
            else:
                ax.plot(apart, [median(g) for g in got], "-s", color=f"C{i}", label=mode, markersize=5)  # one point too
    speed.axhline(1, color="gray", linewidth=0.8, linestyle=":")
    how = "interpolated between evaluations" if newer else "first evaluation past it"
    speed.set(ylabel=f"speed-up over --lag 0 to start + {eh['gain']:g}, from the first step (x)", title=how)
    rate.set(ylabel="throughput (steps a second)")
    steps.set(ylabel=f"learning: steps to start + {eh['gain']:g}", title=how)
    for ax in (speed, rate, steps):
        ax.set(xscale="log", xlabel="G / T (the synchronous round over the training step)")
        ax.set_xticks(ratios, [f"{x:g}" for x in ratios])
        ax.minorticks_off()  # the log axis's own labels would print over the points
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"asynchrony on equal hardware, emulated ({rows[0]['shape']} decoding): {max(eh['searchers'])} "
                 f"searchers and the trainer on devices of their own; colocated: all of them generating, then all "
                 f"training", fontsize=9)
    save(fig, out)


class NoMatplotlib(Exception):
    """matplotlib, optional, is not installed: no picture (bench.py goes on without it)."""


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise NoMatplotlib("matplotlib is not installed (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, out: str):
    """Write the picture, making its folder if need be (as tba.py makes its --out)."""
    fig.tight_layout()
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        fig.savefig(out, dpi=110)
    except OSError as e:
        raise BadRun(f"cannot write {out} ({e.strerror or type(e).__name__})") from None
    print(out)


def main(argv=None):
    try:
        draw(argv)
    except NoMatplotlib as e:  # a refusal: one line, status 2
        print(f"plot.py: {e}; no picture drawn", file=sys.stderr)
        sys.exit(2)
    except BadRun as e:
        print(f"plot.py: {e}", file=sys.stderr)
        sys.exit(2)


def draw(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="*", help="run folders (each with metrics.jsonl)")
    p.add_argument("--study", help="bench.json of bench.py part 7 (off-policy robustness)")
    p.add_argument("--slowdown", nargs="+", help="bench.json of bench.py part 9 (the generation-bound regime, "
                   "emulated); several: their rows together")
    p.add_argument("-o", "--out", default=None, help="the PNG to write, its folder made if need be "
                   "(default: plot.png, off_policy.png or equal_hardware.png)")
    p.add_argument("--title", default=None, help="a title above a run picture")
    args = p.parse_args(argv)
    if args.study:
        return study(args.study, args.out or "off_policy.png")
    if args.slowdown:
        return equal_hardware(args.slowdown, args.out or "equal_hardware.png")
    if not args.runs:
        p.error("give run folders, or --study BENCH_JSON, or --slowdown BENCH_JSON")
    for run in args.runs:
        if not os.path.isfile(os.path.join(run, "metrics.jsonl")):
            raise BadRun(f"{run} has no metrics.jsonl (not a run folder)")
    loaded = {run: read(run) for run in args.runs}
    for run, (train, evals, _) in loaded.items():
        if not train and not evals:  # a run still starting: nothing to draw (an empty picture would say nothing)
            raise BadRun(f"{run} has no rows yet (its metrics.jsonl is empty)")
    runs(loaded, args.out or "plot.png", args.title)
    red = {run: got for run, got in loaded.items() if got[2].get("task") == "redteam"}
    if red:
        pareto(red, os.path.splitext(args.out or "plot.png")[0] + "_pareto.png")


if __name__ == "__main__":
    main()
