"""bench.py on a tiny budget: it runs end to end, its bench.json is well formed, and it leaves no file
open (Python's ResourceWarning, shown with -W); without matplotlib it skips its picture, saying so; a signal
stops every run it started; --costs and plot.py's files are checked before anything starts."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, env

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
BENCH = [sys.executable, "-W", "always::ResourceWarning", os.path.join(ROOT, "tools", "bench.py")]


@pytest.mark.engine
def test_bench_quick(tiny_model, tmp_path):
    out = tmp_path / "bench"
    p = subprocess.run([*BENCH, "--quick", "--out", str(out), "--",
                        "--model", tiny_model, "--steps", "6", "--prompts-per-step", "4", "--samples-per-prompt", "4",
                        "--max-new-tokens", "6"],
                       cwd=tmp_path, env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:]
    assert "unclosed file" not in p.stdout, p.stdout[-3000:]
    with open(out / "bench.json") as f:
        r = json.load(f)
    assert r["machine"]["cores"] >= 1 and r["seeds"] == [0]
    runs = r["time_to_target"]
    assert sorted(x["searchers"] for x in runs) == [0, 1]
    for x in runs:
        assert isinstance(x["reached"], bool) and (x["seconds"] is None) == (not x["reached"])
        assert x["target"] == x["start_accuracy"] + 0.15
        assert x["seconds_per_step"] > 0 and x["first_step_seconds"] > 0
        assert x["curve"][0][1] == 0 and all(0 <= acc <= 1 for _, _, acc in x["curve"])
    (async_run,) = [x for x in runs if x["searchers"] == 1]
    assert 0 < async_run["utilisation"] <= 1
    assert json.load(open(out / "seed0-searchers0" / "config.json"))["lag"] == 0  # sync: on-policy
    tiny = r["sync_cost"]["tiny"]
    assert tiny["publish"] > 0 and tiny["reload"] > 0 and tiny["plain_copy"] > 0 and tiny["ratio"] > 0
    assert r["searcher_overhead"]["ratio"] > 0 and r["trainer_overhead"]["ratio"] > 0
    for line in ("1. time to target", "2. trainer utilisation", "3. weight sync", "4. searcher", "5. trainer"):
        assert line in p.stdout


@pytest.mark.engine
def test_bench_equal_hardware_quick(tiny_model, tmp_path):
    """Part 9 on a tiny budget (one searcher, G_1 / T = 1 with both phases emulated, GPU-shaped decoding with GSM8K's
    tail: the synchronous baseline on the searcher, then the colocated run on 2 emulated devices, streaming and
    streaming with the engine kept full, each the same horizon from its first round): its plan and estimate said
    first, the time it took said last; one calibration handed to every run, the colocated run's with
    its devices and all-reduce; rows with G, T, publish, a searcher's cycle and the bound, throughput apart from
    learning, the accuracy at the synchronous run's time, the CPU used and the share over budget with the uncharged
    work; part9.json, from which --table recomputes the table printed; the picture."""
    out = tmp_path / "bench"
    p = subprocess.run([*BENCH, "--quick", "--parts", "9", "--out", str(out),
                        "--", "--model", tiny_model, "--steps", "6", "--prompts-per-step", "4",
                        "--samples-per-prompt", "4", "--max-new-tokens", "6"],
                       cwd=tmp_path, env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:]
    assert "unclosed file" not in p.stdout, p.stdout[-3000:]
    assert p.stdout.index("9. plan: 4 runs, about ") < p.stdout.index("9. N 1 G/T 1 gpu+tails sync seed 0")
    assert p.stdout.index("9. N 1 G/T 1 gpu+tails full seed 0") < p.stdout.index("9. took ")
    with open(out / "bench.json") as f:
        eh = json.load(f)["equal_hardware"]
    costs = json.loads((out / "calibration.json").read_text())
    three = ("seconds_per_token", "train_step", "tokens_per_batch")  # tba.py reads the first two, --costs all three
    assert costs == {k: eh["costs"][k] for k in three} and all(v > 0 for v in costs.values())
    assert sorted((r["ratio"], r["mode"]) for r in eh["rows"]) == [(1.0, m) for m in ("colocated", "full", "stream",
                                                                                        "sync")]
    assert eh["took"]["planned"] > 0 and eh["took"]["all"] >= eh["took"]["runs"] > 0
    rows = {r["mode"]: r for r in eh["rows"]}
    for mode, r in rows.items():
        assert r["G"] > 0 and r["T"] > 0 and r["publish"] >= 0 and r["steps_per_s"] > 0 and r["cpu"] > 0
        assert 0 <= r["over_budget"] and r["curve"][0][0] == 0
        config = json.loads((out / f"hardware-n1-r1-gputails-{mode}-seed0" / "config.json").read_text())
        assert (config["generation_slowdown"], config["train_slowdown"]) == (r["x"], r["y"]) and r["y"] > 1
        assert (config["decode_cost"], config["response_lengths"]) == ("gpu", "gsm8k")
        assert config["searchers"] == (0 if mode == "colocated" else 1) and config["keep_full"] == (mode == "full")
        if mode == "colocated":  # N + 1 = 2 devices, its all-reduce stated
            colocated = json.loads((out / "calibration-colocated-2.json").read_text())
            assert config["calibration"] == str(out / "calibration-colocated-2.json") and colocated["devices"] == 2
            assert colocated["all_reduce"] > 0 and r["over_searchers"] == {} and r["cycle"] > 0  # its own rounds
        else:
            assert config["calibration"] == str(out / "calibration.json")  # the same costs for both modes
            assert set(r["over_searchers"]) == set(r["uncharged_searchers"]) == {"0"} and r["cycle"] > 0
        # per process over its own charge with its uncharged work, the largest of them the run's
        both = [r["over_trainer"] + r["uncharged_trainer"],
                *(v + r["uncharged_searchers"][k] for k, v in r["over_searchers"].items())]
        assert r["over"] == pytest.approx(max(both)) and r["uncharged"]["score"] > 0
        # interpolated between the evaluations around the crossing: by the first evaluation past it, after the one before
        assert (r["seconds_interp"] is None) == (not r["reached"])
        if r["reached"]:
            before = max(t for t, _, _ in r["evals"] if t < r["seconds"] - 1e-9)  # the evaluation before it
            assert before <= r["seconds_interp"] <= r["seconds"]
            assert r["seconds_interp"] - r["from_first_round"] == pytest.approx(r["first_round"])
        # every mode's clock from its first round, which comes before its first step; the same horizon for all
        assert 0 < r["first_round"] <= r["first_step"] + 0.01 and r["horizon"] == bench_module().QUICK_HORIZON
        assert r["end"] > 0 and len(r["evals"]) == len(r["curve"]) and 0 <= r["mean_accuracy"] <= 1  # (6 steps)
    sync, stream = rows["sync"], rows["stream"]
    assert sync["staleness"] == 0 and sync["bound"] == pytest.approx(
        (sync["G"] + sync["T"]) / max(sync["cycle"], sync["T"] + sync["publish"])) and stream["bound"] == sync["bound"]
    assert stream["accuracy_gain"] == pytest.approx(stream["mean_accuracy"] - sync["mean_accuracy"])
    if sync["reached"]:  # streaming ran at least as long as the synchronous run took: its accuracy at that time
        assert stream["accuracy_at_sync"] is not None
    assert set(eh["summary"]["cells"]) == {f"1 1.0 {sync['x']} {sync['y']} gpu+tails {m}"
                                           for m in ("colocated", "sync", "stream", "full")}
    assert eh["seeds"] == [0] and eh["summary"]["intervals"]["level"] == 0.9
    assert len(eh["summary"]["pairs"]) == 6
    if HAS_MATPLOTLIB:
        assert (out / "equal_hardware.png").stat().st_size > 0
    else:  # the README's test line installs no matplotlib: the numbers are complete, the picture skipped
        assert not (out / "equal_hardware.png").exists() and "9. picture skipped: matplotlib is not installed" in p.stdout
    # the table printed is the one part9.json gives (the seeds' figures alone)
    import bench
    table = bench.part9_table(bench.read_per_seed(str(out / "part9.json")))
    assert "\n".join(table) in p.stdout and "| 1 | 1 |" in p.stdout and "Bonferroni" in p.stdout


def bench_module():
    import bench
    return bench


def test_a_point_gives_its_ratio_of_round_to_step():
    """Part 9's point: Y makes the training step STEP seconds, or MIN_Y x D x a step alone where that is longer (the
    colocated run's share of a step on D = N + 1 devices, T / D, stays emulated), X makes N searchers' synchronous
    round `ratio` x that, from the calibration's costs (a batch's tokens over N searchers). The machine is the same
    whether the colocated run is among the modes or not (before, leaving it out changed Y)."""
    import bench
    costs = dict(seconds_per_token=2e-4, train_step=0.05, tokens_per_batch=1000)
    for ratio, n in ((0.5, 4), (2, 4), (4, 1)):
        x, y = bench.point(costs, ratio, n)
        T, G = y * costs["train_step"], x * costs["tokens_per_batch"] / n * costs["seconds_per_token"]
        assert T == pytest.approx(max(bench.STEP, bench.MIN_Y * (n + 1) * 0.05), rel=0.01)
        assert G / T == pytest.approx(ratio, rel=0.01)
    slow = dict(costs, train_step=0.5)  # a busy machine's calibration: T = MIN_Y x D x a step alone
    x, y = bench.point(slow, 1.0, 4)
    assert y == pytest.approx(bench.MIN_Y * 5) and x * 1000 / 4 * 2e-4 == pytest.approx(y * 0.5, rel=0.01)
    import types
    cfg = types.SimpleNamespace(prompts_per_step=32, search_samples_per_prompt=8, decode_shape="rho-math-1b")
    plans = [bench.part9_plan(slow, cfg, [4], [2.0], [], modes, [0], 1, "linear")
             for modes in (["colocated", "stream"], ["stream"])]
    assert [(c["x"], c["y"]) for c in plans[0]] == [(c["x"], c["y"]) for c in plans[1]]


def test_a_gpu_shaped_point_with_tails_is_chosen_from_the_rounds_it_emulates():
    """--decoding gpu+tails: G_N is X x the expected slowest round alone of N searchers (each response the calibration's
    mean length, stretched by GSM8K's tail, every step a fixed part and a part a running sequence), not linear's
    tokens / N: a round of a quarter of the sequences costs more than a quarter (the fixed part), the colocated run's
    round over D = 5 devices more than a fifth; the same costs give the same point (seeded draws)."""
    import types
    import bench
    cfg = types.SimpleNamespace(prompts_per_step=32, search_samples_per_prompt=8, decode_shape="rho-math-1b")
    costs = dict(seconds_per_token=1e-4, train_step=0.1, tokens_per_batch=4 * 32 * 8)  # 4 tokens a response
    four, one = (bench.round_alone(costs, n, "gpu+tails", cfg) for n in (4, 1))
    colocated = bench.round_alone(costs, 4, "gpu+tails", cfg, devices=5)
    linear = bench.round_alone(costs, 4)
    assert linear == pytest.approx(4 * 32 * 8 / 4 * 1e-4) and one > four > one / 4 and colocated > one / 5
    assert four == bench.round_alone(costs, 4, "gpu+tails", cfg)
    x, y = bench.point(costs, 2.0, 4, "gpu+tails", cfg)
    assert x * four == pytest.approx(2.0 * y * 0.1, rel=0.01)


def test_the_colocated_all_reduce_is_stated_not_free():
    """The colocated trainer's ring all-reduce of bf16 gradients over D devices, against its step on one device: 2 (D -
    1) / D x 2 bytes x MFU x peak / (6 x tokens a step x bus bandwidth): 1.7% over 5 H100s, none on one device; written
    into the colocated run's calibration in emulated seconds, with its devices."""
    import bench
    assert bench.all_reduce_share(5) == pytest.approx(1.6 * 2 * 0.4 * 989e12 / (6 * 35000 * 360e9))
    assert 0.016 < bench.all_reduce_share(5) < 0.018 and bench.all_reduce_share(1) == 0.0
    assert bench.all_reduce_share(2) < bench.all_reduce_share(5)


def test_the_crossing_is_interpolated_between_the_evaluations_around_it():
    """Part 9's time to the target: linear between the last evaluation below the level and the first at or above it
    (seconds and step alike), the first crossing only (a later dip and rise is not another), an evaluation exactly at
    the level its own time (0.24 + 0.15 reaches 0.39 despite float rounding), None where it is never reached."""
    import bench
    curve = [(10.0, 0, 0.20), (12.0, 2, 0.25), (14.0, 4, 0.40), (16.0, 6, 0.30), (18.0, 8, 0.50)]
    assert bench.crossing(curve, 0.35) == pytest.approx((12 + 2 * 2 / 3, 2 + 2 * 2 / 3))
    assert bench.crossing(curve, 0.25) == pytest.approx((12.0, 2.0))
    assert bench.crossing(curve, 0.45) == pytest.approx((17.5, 7.5))  # past the dip: the first crossing of 0.45
    assert bench.crossing(curve, 0.6) is None and bench.crossing(curve[:1], 0.1) is None
    assert bench.crossing([(0.0, 0, 0.24), (5.0, 2, 0.39)], 0.24 + 0.15) == pytest.approx((5.0, 2.0))
    # the first evaluation past the level moves by a whole interval as its sampling noise crosses the level;
    # interpolated, the time moves by the noise's share of the rise
    noisy = [(0.0, 0, 0.20), (10.0, 2, 0.34), (20.0, 4, 0.50)]
    assert bench.crossing(noisy, 0.35)[0] == pytest.approx(10.625)
    assert bench.crossing([(0.0, 0, 0.20), (10.0, 2, 0.36), (20.0, 4, 0.50)], 0.35)[0] == pytest.approx(9.375)


def test_a_row_counts_a_run_that_never_reached_the_target_at_its_horizon(monkeypatch):
    """hardware_row's speed-ups over the synchronous run of its seed take the pairs' convention (`reached_by`): a run
    that never reached the target counts at its horizon's end, a bound (before, its row said 0), and a synchronous
    run that never did is 1x itself (before, it had none)."""
    import bench
    train = [dict(step=s, time=20.0 + s, overhead=0.0, wait=0.5, sync=0.01, search=0.0, seconds=1.0, staleness=1.0)
             for s in range(11)]
    monkeypatch.setattr(bench.plot, "read", lambda run: (train, [], {}))
    run = lambda last: dict(reached=last >= 0.55, start_accuracy=0.4, seconds=25.0, step=5, first_step_seconds=21.0,
                            first_round=20.0, curve=[(20.0, 0, 0.4), (30.0, 10, last)], target=0.55,
                            last_step_seconds=30.0, cpu=50.0)
    sync = bench.hardware_row("sync", run(0.7), None, baseline=True)  # crosses at 25 s: 5 s from its first round
    assert (sync["from_first_round"], sync["horizon"], sync["speedup_interp_first_step"]) == (5.0, 10.0, 1.0)
    never = bench.hardware_row("stream", run(0.5), sync)  # its horizon: the synchronous run's 10 s
    assert never["from_first_round"] is None and never["speedup_interp_first_step"] == pytest.approx(5 / 10)
    assert never["speedup_interp"] == pytest.approx(25 / 30)  # from launch: its horizon after its first round
    assert bench.hardware_row("sync", run(0.5), None, baseline=True)["speedup_interp"] == 1.0


def test_mean_accuracy_is_the_area_under_the_curve_over_its_window():
    """Part 9's area: held-out accuracy against seconds from the first step, linear between evaluations, the start's
    before the first (an evaluation made before the first step counts from 0), the last held after the run's end,
    integrated to the horizon and divided by it; None without points or a horizon."""
    import bench
    assert bench.mean_accuracy([(0.0, 0.3), (10.0, 0.3)], 10.0) == pytest.approx(0.3)
    assert bench.mean_accuracy([(0.0, 0.2), (10.0, 0.4)], 10.0) == pytest.approx(0.3)  # a straight rise: its middle
    assert bench.mean_accuracy([(0.0, 0.2), (10.0, 0.4)], 20.0) == pytest.approx((3 + 4) / 20)  # held after the end
    assert bench.mean_accuracy([(-2.0, 0.2), (2.0, 0.4)], 4.0) == pytest.approx(((0.3 + 0.4) + 0.4 * 2) / 4)
    assert bench.mean_accuracy([(4.0, 0.4), (0.0, 0.2)], 2.0) == pytest.approx(0.25)  # any order; cut at the horizon
    assert bench.mean_accuracy([(0.0, 0.2)], None) is None and bench.mean_accuracy([], 5.0) is None
    # a run that rises sooner has the larger area over the same window
    assert bench.mean_accuracy([(0, 0.2), (5, 0.4), (10, 0.4)], 10) > bench.mean_accuracy([(0, 0.2), (8, 0.4)], 10)
    assert bench.accuracy_at([(0.0, 0.2), (10.0, 0.4)], 2.5) == pytest.approx(0.25)


def test_the_bootstrap_interval_is_fixed_and_honest():
    """plot.interval: the same values give the same interval (a fixed RNG); it holds the point, narrows as seeds are
    added, is one value where all seeds agree; none below 2 values; NaN left out; any statistic (the mean)."""
    import numpy as np
    import plot
    five = [1.2, 1.4, 1.5, 1.6, 1.8]
    twenty = five * 4  # the same spread, four times the seeds
    point, (lo, hi) = plot.interval(five)
    assert plot.interval(five) == (point, [lo, hi]) and lo <= point <= hi and point == pytest.approx(np.median(five))
    _, (lo20, hi20) = plot.interval(twenty)
    assert hi20 - lo20 < hi - lo
    assert plot.interval([1.2] * 7) == (1.2, [1.2, 1.2])
    assert plot.interval([1.3]) == (1.3, None) and plot.interval([]) == (None, None)
    assert plot.interval([1.0, float("nan"), 3.0])[0] == 2.0
    mean, (a, b) = plot.interval([0.0, 0.01, 0.02, 0.03], lambda v, axis=None: np.mean(v, axis=axis))
    assert mean == pytest.approx(0.015) and 0 <= a < mean < b <= 0.03
    assert plot.BOOTSTRAP == dict(resamples=2000, level=0.90, seed=0)


def hw_row(mode, seed, t, gain=0.0, over=0.0, **extra):
    """A part 9 row as hardware_row makes it, for hardware_summary: reached at `t` s from the first step (None:
    never) against a synchronous run at SYNC_T[seed]."""
    sync_t = SYNC_T[seed]
    up = 1.0 if mode == "sync" else sync_t / (30.0 if t is None else t)  # never: at its horizon (bench.reached_by)
    return dict(dict(searchers=4, ratio=2.0, x=10.0, y=1.7, shape="gpu+tails", mode=mode, seed=seed,
                     reached=t is not None, seconds=t and t + 20, step=18, from_first_step=t, seconds_interp=t and t + 20,
                     from_first_round=t, step_interp=t and t * 2, first_step=21.0, first_round=20.0, end=30.0,
                     horizon=30.0, evals=[[20.0, 0, 0.4], [20.0 + (t or 30), 18, 0.6]],
                     mean_accuracy=0.5 + gain, accuracy_gain=gain, speedup_interp=up, speedup_interp_first_step=up,
                     G=0.8, T=0.4, publish=0.01, cycle=0.75 if mode != "colocated" else None,
                     bound=1.5 if mode == "sync" else None, steps_per_s=1.5, staleness=1.0, accuracy_at_sync=0.5,
                     over=over, over_process="the trainer", over_budget=0.0, uncharged={"reload": 0.01, "score": 0.03},
                     cpu=70.0), **extra)


SYNC_T = [16.0, 14.0, 18.0, 15.0, 17.0, 16.5, 13.5, 18.5, 15.5, 16.0]


def part9_rows(cpu_bound=()):
    """Ten seeds of the four modes: lag1 1.6x sooner than --lag 0 on every seed, the colocated run 1.2x, streaming
    1.55x with noise and one seed that never reached the target in its 30 s; `cpu_bound` modes 15% over on seed 4."""
    import numpy as np
    rng = np.random.default_rng(3)
    over = lambda mode, s: 0.15 if mode in cpu_bound and s == 4 else 0.02
    rows = [hw_row("sync", s, SYNC_T[s], over=over("sync", s)) for s in range(10)]
    rows += [hw_row("colocated", s, SYNC_T[s] / 1.2, gain=0.01, over=over("colocated", s)) for s in range(10)]
    rows += [hw_row("lag1", s, SYNC_T[s] / 1.6, gain=0.03 + 0.005 * rng.standard_normal(), over=over("lag1", s))
             for s in range(10)]
    rows += [hw_row("stream", s, SYNC_T[s] / (1.55 * np.exp(0.15 * rng.standard_normal())),
                    gain=0.03 + 0.02 * rng.standard_normal(), over=over("stream", s)) for s in range(9)]
    return rows + [hw_row("stream", 9, None, gain=-0.05, over=over("stream", 9))]


def test_a_speed_up_gets_an_interval_over_both_baselines_and_pairs_a_corrected_one():
    """hardware_summary over 10 seeds: each mode's speed-up over the colocated run and over --lag 0 is the geometric
    mean of the seeds' paired ratios, from the first round and from launch, with a 90% t interval of their logs; a
    seed that never reached the target counts at its horizon's end (a bound), not left out. Pairs of modes: each
    interval at the Bonferroni level of its cell (6 pairs, 12 claims: 1 - 10% / 12), wider than the 90% one of the
    same figures; lag1 1.6x sooner than --lag 0 on every seed is resolved, lag1 and streaming 1.6x and 1.55x apart by
    noise are not. The bound is --lag 0's."""
    import bench
    import numpy as np
    rows = part9_rows()
    summary = bench.hardware_summary(rows)
    cells = {c["mode"]: c for c in summary["cells"].values()}
    lag1 = cells["lag1"]
    assert lag1["over_sync"]["first_round"] == pytest.approx(1.6)
    assert lag1["over_sync"]["first_round_ci"] == pytest.approx([1.6, 1.6])
    assert lag1["over_colocated"]["first_round"] == pytest.approx(1.6 / 1.2) and lag1["over_colocated"]["seeds"] == 10
    launch = np.exp(np.mean(np.log([(t + 20) / (t / 1.6 + 20) for t in SYNC_T])))
    assert lag1["over_sync"]["launch"] == pytest.approx(launch)
    assert cells["colocated"]["over_sync"]["first_round"] == pytest.approx(1.2)
    assert "over_colocated" not in cells["colocated"]
    stream = cells["stream"]
    ups = [SYNC_T[r["seed"]] / (r["from_first_round"] or r["horizon"]) for r in rows if r["mode"] == "stream"]
    assert ups[-1] == pytest.approx(SYNC_T[9] / 30.0)  # never reached: its horizon, 30 s
    assert stream["over_sync"]["first_round"] == pytest.approx(np.exp(np.mean(np.log(ups))))
    lo, hi = stream["over_sync"]["first_round_ci"]
    assert lo < stream["over_sync"]["first_round"] < hi and stream["over_sync"]["seeds"] == 10
    assert all(c["bound"] == 1.5 for c in cells.values())
    assert "accuracy_gain" not in cells["sync"] and cells["lag1"]["accuracy_gain"] > 0
    pairs = {(p["a"], p["b"]): p for p in summary["pairs"]}
    assert set(pairs) == {("colocated", "sync"), ("colocated", "lag1"), ("colocated", "stream"), ("sync", "lag1"),
                          ("sync", "stream"), ("lag1", "stream")}
    assert bench.corrected(6) == pytest.approx(1 - 0.10 / 12) and all(p["level"] == bench.corrected(6) for p in pairs.values())
    assert pairs["sync", "lag1"]["resolved"] and pairs["sync", "lag1"]["gain_resolved"]
    assert not pairs["lag1", "stream"]["resolved"] and pairs["lag1", "stream"]["seeds"] == 10
    wide, narrow = pairs["sync", "stream"]["speedup_ci"], stream["over_sync"]["first_round_ci"]  # the same seeds' ratios
    assert wide[0] < narrow[0] and narrow[1] < wide[1]
    assert wide == pytest.approx(bench.t_interval(ups, bench.corrected(6), log=True)[1])
    text = "\n".join(bench.part9_table(dict(gain=0.15, costs=None, horizon=30.0, summary=summary)))
    assert "| 4 | 2 | 10 | 1.7 | gpu+tails | lag1 | 10/10 | 1.33x [1.33, 1.33] | 1.60x [1.60, 1.60] |" in text
    assert "Bonferroni" in text and "- N 4 G/T 2 gpu+tails, stream over lag1 (99.17% intervals, 10 seeds):" in text
    assert "not resolved" in text and "ideal" not in text


def test_cpu_bound_modes_and_baselines_get_no_speed_up():
    """A CPU-bound mode (one process 15% over its charge, with its uncharged work, on one seed) gets no speed-up and
    no comparison; a CPU-bound baseline, no speed-up over it for any mode (the other baseline's still given)."""
    import bench
    cells = {c["mode"]: c for c in bench.hardware_summary(part9_rows(cpu_bound=("stream",)))["cells"].values()}
    assert cells["stream"]["cpu_bound"] and cells["stream"]["over_sync"]["withheld"]
    assert "first_round" not in cells["stream"]["over_sync"] and cells["stream"]["accuracy_gain"] is None
    summary = bench.hardware_summary(part9_rows(cpu_bound=("colocated",)))
    cells = {c["mode"]: c for c in summary["cells"].values()}
    assert cells["lag1"]["over_colocated"]["withheld"] and not cells["lag1"]["over_sync"]["withheld"]
    pairs = {(p["a"], p["b"]): p for p in summary["pairs"]}
    assert pairs["colocated", "lag1"]["cpu_bound"] and not pairs["sync", "lag1"]["cpu_bound"]
    text = "\n".join(bench.part9_table(dict(gain=0.15, costs=None, horizon=30.0, summary=summary)))
    assert "colocated over sync" not in text and "lag1 over colocated: not compared (CPU-bound)" in text
    assert "| lag1 | 10/10 | CPU-bound | 1.60x [1.60, 1.60] |" in text


def test_the_scaling_is_paired_by_seed_with_its_interval():
    """4 searchers streaming against 1 at the same X, Y and decoding (the plan's scaling cell, no --lag 0 of its own):
    the geometric mean of the seeds' ratios of the time from the first round, its interval, the throughput over the
    fewest's."""
    import bench
    import numpy as np
    rows = part9_rows()
    rows += [hw_row("stream", s, SYNC_T[s] * 2.5 / 1.55, searchers=1, steps_per_s=0.5) for s in range(10)]
    (s,) = bench.hardware_summary(rows)["scaling"]
    many = {r["seed"]: r["from_first_round"] or 30.0 for r in rows if r["mode"] == "stream" and r["searchers"] == 4}
    ratios = [SYNC_T[k] * 2.5 / 1.55 / many[k] for k in range(10)]
    assert (s["few"], s["many"], s["seeds"]) == (1, 4, 10)
    assert s["speedup"] == pytest.approx(np.exp(np.mean(np.log(ratios))))
    assert s["speedup_ci"][0] < s["speedup"] < s["speedup_ci"][1] and s["throughput"] == pytest.approx(3.0)


def test_the_docs_table_is_recomputed_from_the_committed_seeds(tmp_path):
    """part9.json keeps each run's figures that the table needs (PER_SEED); `bench.py --table FILE --doc DOC`
    recomputes the table from them, the same as from the runs' rows, and writes it between DOC's markers, the rest
    of DOC untouched. docs/performance.md's table is its docs/performance-part9.json's, or the placeholder before
    that file is in the tree."""
    import bench
    rows = part9_rows() + [hw_row("stream", s, 30.0, searchers=1, steps_per_s=0.5) for s in range(10)]
    eh = dict(gain=0.15, horizon=30.0, costs=dict(seconds_per_token=1e-4, train_step=0.15, tokens_per_batch=900,
                                                   file="x"), rows=rows, summary=bench.hardware_summary(rows))
    path = tmp_path / "part9.json"
    path.write_text(json.dumps(bench.per_seed(eh, {"cpu": "test"}, ["bench.py", "--parts", "9"])))
    kept = json.loads(path.read_text())
    assert set(kept["rows"][0]) == set(bench.PER_SEED) and "curve" not in kept["rows"][0]
    # each run's evaluations (seconds from launch, step, accuracy) and its first round: the crossing and the area
    # can be recomputed from the tree
    assert kept["rows"][0]["evals"] == [[20.0, 0, 0.4], [36.0, 18, 0.6]] and kept["rows"][0]["first_round"] == 20.0
    assert bench.part9_table(bench.read_per_seed(str(path))) == bench.part9_table(eh)
    doc = tmp_path / "doc.md"
    doc.write_text(f"# before\n\n{bench.TABLE_START}\nTHE OLD TABLE\n{bench.TABLE_END}\n\nafter\n")
    bench.main(["--table", str(path), "--doc", str(doc)])
    text = doc.read_text()
    assert text.startswith(f"# before\n\n{bench.TABLE_START}\n") and text.endswith(f"{bench.TABLE_END}\n\nafter\n")
    assert "\n".join(bench.part9_table(eh)) in text and "THE OLD TABLE" not in text
    # a second run of one mode with a flag after -- (its rows named "stream --max-reuse 2") joins the table
    other = tmp_path / "r2.json"
    r2 = [dict(r, mode="stream --max-reuse 2") for r in rows if r["mode"] == "stream"]
    other.write_text(json.dumps(bench.per_seed(dict(eh, rows=r2, summary=bench.hardware_summary(r2)), {"cpu": "test"},
                                               ["bench.py"])))
    joined = bench.read_per_seeds([str(path), str(other)])
    assert len(joined["rows"]) == len(rows) + len(r2)
    assert any("| stream --max-reuse 2 |" in line for line in bench.part9_table(joined))
    other.write_text(json.dumps(bench.per_seed(dict(eh, rows=r2, horizon=60.0), {"cpu": "test"}, ["bench.py"])))
    with pytest.raises(bench.BadInput, match="one table needs one target, horizon and machine"):
        bench.read_per_seeds([str(path), str(other)])
    costs = dict(eh["costs"], train_step=0.3)  # another calibration: another emulated machine
    other.write_text(json.dumps(bench.per_seed(dict(eh, rows=r2, costs=costs), {"cpu": "test"}, ["bench.py"])))
    with pytest.raises(bench.BadInput, match="differ in gain, horizon or calibration"):
        bench.read_per_seeds([str(path), str(other)])
    path.write_text(json.dumps({"rows": [{"mode": "sync"}], "gain": 0.15}))
    with pytest.raises(bench.BadInput, match="a row has no searchers"):
        bench.read_per_seed(str(path))
    committed, performance = os.path.join(ROOT, "docs", "performance-part9.json"), os.path.join(ROOT, "docs", "performance.md")
    block = open(performance).read().split(bench.TABLE_START + "\n")[1].split("\n" + bench.TABLE_END)[0]
    if os.path.exists(committed):
        assert block.splitlines() == bench.part9_table(bench.read_per_seed(committed))
    else:
        assert block == bench.PLACEHOLDER


def test_the_replay_sweep_in_the_docs_is_recomputed_from_its_committed_seeds():
    """docs/performance.md's replay rows are `--table`'s of the three committed part9.json files joined."""
    import bench
    files = [os.path.join(ROOT, "docs", "part9-replay", f"{r}.json") for r in ("r1", "r2", "r0")]
    rows = [l for l in bench.part9_table(bench.read_per_seeds(files)) if l.startswith("| 4 |")]
    doc = open(os.path.join(ROOT, "docs", "performance.md")).read().split("### Replay: R, measured")[1]
    assert len(rows) == 4 and all(f"\n{row}\n" in doc for row in rows)


def test_over_its_charge_is_per_process_with_the_pooled_share_for_old_rows():
    """The CPU-bound rule reads each process's share over its own charge (the trainer's, each searcher's), the
    largest named; a train row written before them falls back to the pooled seconds over all the charges."""
    import bench
    assert bench.over_share(dict(over_trainer=0.04, over_searchers={"0": 0.02, "3": 0.12}, over_budget=1.0,
                                 charged=100.0)) == (0.12, "searcher 3")
    assert bench.over_share(dict(over_trainer=0.3, over_searchers={})) == (0.3, "the trainer")
    assert bench.over_share(dict(over_budget=5.0, charged=40.0, train_charged=10.0)) == (0.1, "pooled")
    assert bench.over_share({}) == (0.0, "pooled")


def test_bad_gain_or_horizon_is_refused_in_one_line(tmp_path):
    """--gain and --horizon: a positive number, --few-seeds 1 or more, --doc only with --table, a --table file that
    does not read: else one line, status 2, before anything is made."""
    for args, line in ((["--gain", "0"], "--gain 0: give a positive number"),
                       (["--horizon", "-5"], "--horizon -5: give a positive number"),
                       (["--horizon", "nan"], "--horizon nan: give a positive number"),
                       (["--few-seeds", "0"], "--few-seeds 0: give 1 or more"),
                       (["--doc", "x.md"], "--doc acts only with --table"),
                       (["--table", "none.json"], "--table: none.json does not read as JSON (FileNotFoundError)")):
        p = subprocess.run([*BENCH, "--parts", "9", "--out", str(tmp_path / "b"), *args], cwd=tmp_path,
                           env=env(tmp_path), capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and p.stderr == f"bench.py: error: {line}\n", p.stderr
        assert not (tmp_path / "b").exists()


def test_earlier_results_and_unknown_parts_are_refused_in_one_line(tmp_path):
    """bench.py replaces no results unasked: an --out that holds any (a bench.json, a part's run folders) is refused
    before anything runs, and so is a part that does not exist (before, --parts 42 ran nothing, exited 0 and wrote an
    empty bench.json over the one there)."""
    out = tmp_path / "b"
    out.mkdir()
    (out / "bench.json").write_text('{"equal_hardware": "hours of part 9"}')
    (out / "seed0-searchers1").mkdir()
    for args, line in (([], f"--out {out} already holds results (bench.json, seed0-searchers1): pass a new folder, or "
                            f"--overwrite to replace them"),
                       (["--parts", "42"], "--parts 42: no such part (they are 1-12: tools/bench.py --help)"),
                       (["--parts", "9", "0", "--overwrite"], "--parts 0: no such part (they are 1-12: tools/bench.py "
                                                               "--help)")):
        p = subprocess.run([*BENCH, "--parts", "9", "--out", str(out), *args], cwd=tmp_path, env=env(tmp_path),
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and p.stderr == f"bench.py: error: {line}\n", p.stderr
    assert (out / "bench.json").read_text() == '{"equal_hardware": "hours of part 9"}'
    import bench
    bench.check_out(str(out), overwrite=True)  # asked for: taken
    bench.check_out(str(tmp_path / "new"), overwrite=False)
    (out / "seed0-searchers1" / "metrics.jsonl").write_text("{}")
    assert bench.vacated(str(out / "seed0-searchers1")) == str(out / "seed0-searchers1")
    assert sorted(os.listdir(out)) == ["bench.json"]  # the run's folder goes as its run starts again; bench.json is
    # replaced whole when the new one is written (write_json)


def test_part9_checks_its_flags_beside_the_slowdown_it_adds(tiny_model):
    """Part 9 adds --generation-slowdown to each run: its flags after `--` are checked beside it (the config returned
    is the flags' own, not slowed); a decoding shape there is refused (a cell's X is chosen for its own shape: the
    run would go at another G/T under the cell's label), and elsewhere acts nowhere; a bad flag after `--` is one
    line (BadInput), not a traceback."""
    import bench
    cfg, _ = bench.checked(["--model", tiny_model, "--recency", "1"], [9])
    assert (cfg.recency, cfg.generation_slowdown) == (1.0, 1.0)
    with pytest.raises(bench.BadInput, match="^--decode-cost after --: part 9 sets the decoding's shape per cell"):
        bench.checked(["--model", tiny_model, "--decode-cost", "gpu"], [9])
    with pytest.raises(bench.BadInput, match="^the flags after --: --decode-cost: acts only in the emulated decoding"):
        bench.checked(["--model", tiny_model, "--decode-cost", "gpu"], [1])
    with pytest.raises(bench.BadInput, match="^the flags after --: --lr: "):
        bench.checked(["--model", tiny_model, "--lr", "-1"], [9])


# a row of part 9 as bench.py's hardware_row writes it, with the fields plot.py --slowdown reads
ROW = dict(searchers=1, ratio=1.0, x=2.0, y=1.5, shape="linear", mode="sync", seed=0, ideal=1.8, speedup_first_step=1.0,
           steps_per_s=0.5, step=6, reached=True)


def test_part9_in_parts_is_read_as_one(tmp_path):
    """plot.py --slowdown A B: a sweep run in two invocations drawn as one (every row, every searcher count)."""
    import plot
    for name, n, ratio in (("a", 4, 1.0), ("b", 1, 2.0)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"equal_hardware": {
            "gain": 0.15, "searchers": [n], "rows": [dict(ROW, searchers=n, ratio=ratio, mode="sync")]}}))
    eh = plot.read_part9([str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert eh["searchers"] == [1, 4] and [r["ratio"] for r in eh["rows"]] == [1.0, 2.0] and eh["gain"] == 0.15
    # another target, or a file without part 9: refused in one line (plot.main: status 2), not drawn together
    (tmp_path / "c.json").write_text(json.dumps({"equal_hardware": {"gain": 0.25, "searchers": [4], "rows": []}}))
    (tmp_path / "d.json").write_text(json.dumps({"settings": {}}))
    for other, line in (("c", f"{tmp_path / 'c.json'}: another target or other emulated costs than {tmp_path / 'a.json'}"),
                        ("d", f"{tmp_path / 'd.json'} holds no part 9 (bench.py --parts 9)")):
        with pytest.raises(plot.BadRun) as e:
            plot.read_part9([str(tmp_path / "a.json"), str(tmp_path / f"{other}.json")])
        assert str(e.value) == line


def test_a_missing_matplotlib_skips_the_picture(tmp_path, monkeypatch, capsys):
    """Without matplotlib (here: its import made to fail), bench.py's picture is skipped with one line
    saying why and how to draw it later; plot.py alone refuses in one line, status 2."""
    import bench
    import plot
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    (tmp_path / "bench.json").write_text(json.dumps({"equal_hardware": {"gain": 0.15, "searchers": [1], "rows": [ROW]}}))
    bench.picture(str(tmp_path / "bench.json"), str(tmp_path / "equal_hardware.png"))
    assert capsys.readouterr().out.strip() == (
        "9. picture skipped: matplotlib is not installed (pip install matplotlib); "
        f"`python tools/plot.py --slowdown {tmp_path / 'bench.json'}` draws it later")
    assert not (tmp_path / "equal_hardware.png").exists()
    with pytest.raises(SystemExit) as e:
        plot.main(["--slowdown", str(tmp_path / "bench.json"), "-o", str(tmp_path / "x.png")])
    assert e.value.code == 2 and capsys.readouterr().err.strip() == (
        "plot.py: matplotlib is not installed (pip install matplotlib); no picture drawn")


def test_plot_checks_a_bench_json_before_matplotlib(tmp_path, monkeypatch, capsys):
    """plot.py --slowdown on a hand-edited or missing bench.json: one line naming the file and the field, status 2,
    before matplotlib is looked for (here missing: a file's fault is still the one named), never a traceback."""
    import plot
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    good = {"equal_hardware": {"gain": 0.15, "searchers": [1], "rows": [ROW], "costs": None}}
    path = tmp_path / "bench.json"

    def refused(text, line):
        path.write_text(text)
        with pytest.raises(SystemExit) as e:
            plot.main(["--slowdown", str(path), "-o", str(tmp_path / "x.png")])
        assert e.value.code == 2 and capsys.readouterr().err.strip() == f"plot.py: {line}"

    def edited(change, line):
        part = json.loads(json.dumps(good))
        change(part["equal_hardware"])
        refused(json.dumps(part), line)

    with pytest.raises(SystemExit) as e:
        plot.main(["--slowdown", str(tmp_path / "none.json")])
    assert e.value.code == 2 and capsys.readouterr().err.strip() == f"plot.py: {tmp_path / 'none.json'} does not exist"
    refused("", f"{path} does not read as a bench.json (not JSON)")
    refused("[1, 2]", f"{path} holds no part 9 (bench.py --parts 9)")
    edited(lambda eh: eh.pop("gain"), f"{path}: equal_hardware.gain is missing")
    edited(lambda eh: eh.update(gain="0.15"), f'{path}: equal_hardware.gain is "0.15", not a number')
    edited(lambda eh: eh.update(searchers=[]), f"{path}: equal_hardware.searchers is [], not a list of searcher counts")
    edited(lambda eh: eh.update(rows={}), f"{path}: equal_hardware.rows is {{}}, not a list")
    edited(lambda eh: eh.update(rows=[3]), f"{path}: equal_hardware.rows[0] is not an object")
    edited(lambda eh: eh["rows"][0].pop("shape"), f"{path}: equal_hardware.rows[0].shape is missing")
    edited(lambda eh: eh["rows"][0].update(step=True), f"{path}: equal_hardware.rows[0].step is true, not a number or null")
    edited(lambda eh: eh["rows"][0].update(searchers=1.5), f"{path}: equal_hardware.rows[0].searchers is 1.5, not a whole number")
    edited(lambda eh: eh.update(costs=[]), f"{path}: equal_hardware.costs is [], not an object or null")
    edited(lambda eh: eh["rows"][0].update(speedup_interp_first_step="1.5"),
           f'{path}: equal_hardware.rows[0].speedup_interp_first_step is "1.5", not a number or null')
    path.write_text(json.dumps(good))  # a good file: only now is matplotlib looked for
    with pytest.raises(SystemExit) as e:
        plot.main(["--slowdown", str(path), "-o", str(tmp_path / "x.png")])
    assert e.value.code == 2 and "matplotlib is not installed" in capsys.readouterr().err


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed")
def test_the_picture_draws_intervals_and_older_files(tmp_path):
    """plot.py --slowdown: rows with the interpolated speed-up are drawn with their medians' 90% intervals (a seed
    that never reached the target at 0); a bench.json written before them (the first evaluation past the target
    alone) is still drawn."""
    import plot
    new = [dict(ROW, mode=m, seed=s, ratio=r, speedup_interp_first_step=u, step_interp=12.5)
           for r in (1.0, 2.0) for s in range(4) for m, u in (("sync", 1.0), ("lag1", [1.4, 1.6, 1.5, 0.0][s]))]
    for name, rows in (("new", new), ("old", [ROW, dict(ROW, ratio=2.0)])):
        (tmp_path / f"{name}.json").write_text(json.dumps({"equal_hardware": {"gain": 0.15, "searchers": [1], "rows": rows}}))
        plot.main(["--slowdown", str(tmp_path / f"{name}.json"), "-o", str(tmp_path / f"{name}.png")])
        assert (tmp_path / f"{name}.png").stat().st_size > 0


def test_costs_are_checked_before_anything_starts(tmp_path, capsys):
    """--costs FILE: a missing file, no JSON, not an object, a cost missing, not a number (JSON true is none) or not
    positive and finite: one line naming the file and what is wrong, status 2, before OUT is made. A tba.py
    --calibration file (two costs) is refused for its missing tokens_per_batch, which only a calibration run measures."""
    import bench
    path = tmp_path / "costs.json"
    good = dict(seconds_per_token=2e-4, train_step=0.2, tokens_per_batch=900)

    def refused(text, why):
        path.write_text(text)
        with pytest.raises(bench.BadInput) as e:
            bench.read_costs(str(path))
        assert str(e.value) == f"--costs: {path}{why}"

    with pytest.raises(bench.BadInput, match=f"^--costs: {tmp_path / 'no.json'} does not exist$"):
        bench.read_costs(str(tmp_path / "no.json"))
    refused("", " is empty, not a calibration.json")
    refused("{", " is not JSON, not a calibration.json")
    refused("[0.1]", " holds a JSON list, not an object with seconds_per_token, train_step, tokens_per_batch")
    for key, value, why in (("train_step", True, "true, not a number"), ("train_step", "0.2", '"0.2", not a number'),
                            ("seconds_per_token", -1, "-1, not a positive finite number"),
                            ("tokens_per_batch", 0, "0, not a positive finite number"),
                            ("train_step", float("nan"), "nan, not a positive finite number"),
                            ("train_step", 1e400, "inf, not a positive finite number")):
        refused(json.dumps(dict(good, **{key: value})), f": {key} is {why}")
    refused(json.dumps({"seconds_per_token": 2e-4, "train_step": 0.2}), " has no tokens_per_batch (a tba.py --calibration "
            "file: give the calibration.json of an earlier bench.py --parts 9, which adds the tokens a batch of prompts makes)")
    path.write_text(json.dumps(dict(good, file="elsewhere", extra=1)))
    assert bench.read_costs(str(path)) == good
    # copied into OUT whole, only the three costs (tba.py reads two of them: --calibration)
    (tmp_path / "out").mkdir()
    costs = bench.reuse_costs(str(path), str(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "calibration.json").read_text()) == good
    assert costs == dict(good, file=str(tmp_path / "out" / "calibration.json"))
    # a write that fails leaves the file as it was and no part of it beside
    with pytest.raises(TypeError):
        bench.write_json(str(tmp_path / "out" / "calibration.json"), {"seconds_per_token": object()})
    assert json.loads((tmp_path / "out" / "calibration.json").read_text()) == good
    assert os.listdir(tmp_path / "out") == ["calibration.json"]
    # the command line: one line, status 2, nothing made
    path.write_text(json.dumps({"seconds_per_token": 2e-4, "train_step": 0.2}))
    for args, line in (([], f"--costs: {path} has no tokens_per_batch ("), (["--parts", "1"], "--costs acts only with --parts 9")):
        p = subprocess.run([*BENCH, "--parts", "9", "--costs", str(path), "--out", str(tmp_path / "b"), *args], cwd=tmp_path,
                           env=env(tmp_path), capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and p.stderr.startswith(f"bench.py: error: {line}") and len(p.stderr.splitlines()) == 1, p.stderr
        assert not (tmp_path / "b").exists()


def alive(procs) -> list:
    """Those of `procs` (psutil.Process) still running: a zombie waiting for its parent to reap it has stopped."""
    import psutil
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.engine
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_stops_every_run_bench_started(tiny_model, tmp_path, signum):
    """SIGTERM (what `timeout` sends) or SIGHUP (a closed terminal) to bench.py alone while a run goes: the run's
    trainer, fork server and searcher, in the run's own session, stop with it within seconds, as on Ctrl-C, and
    bench.py exits 128 + the signal in one line. Without it they lived on, parented by init, to the run's end."""
    import psutil
    out = tmp_path / "bench"
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen([*BENCH, "--parts", "1", "--seeds", "0", "--cap", "600", "--out", str(out), "--",
                                 "--model", tiny_model, "--steps", "100000", "--eval-every", "0", "--prompts-per-step", "4",
                                 "--samples-per-prompt", "4", "--max-new-tokens", "6"],
                                cwd=tmp_path, env=env(tmp_path), stdout=stdout, stderr=stderr)
    tree = []
    try:
        bench, deadline = psutil.Process(proc.pid), time.time() + 400
        while time.time() < deadline and proc.poll() is None:  # until the run's searcher lives (below tba.py)
            tree = alive(bench.children(recursive=True))
            runs = {p.pid for p in tree if p.ppid() == proc.pid}
            if runs and any(p.ppid() not in runs | {proc.pid} for p in tree):
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"no run with a searcher: {(tmp_path / 'stdout').read_text()[-3000:]}")
        assert any("tba.py" in " ".join(p.cmdline()) for p in tree)
        proc.send_signal(signum)
        code = proc.wait(timeout=30)
        t0 = time.time()
        while alive(tree) and time.time() - t0 < 20:
            time.sleep(0.5)
        assert not alive(tree), [" ".join(p.cmdline())[:200] for p in alive(tree)]
        assert code == 128 + signum, code
        assert (tmp_path / "stderr").read_text().splitlines() == [
            f"bench.py: stopped by {signum.name}; every run it started is stopped"]
    finally:  # whatever the test found, nothing of it outlives it
        for p in alive(tree):
            p.kill()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_colocated_calibration_holds_its_devices_and_all_reduce(tmp_path):
    import bench
    from runtime.slowdown import read_calibration
    costs = dict(seconds_per_token=1e-4, train_step=0.2, tokens_per_batch=900)
    path = bench.colocated_costs(costs, str(tmp_path), 4, 7.0)
    assert read_calibration(path) == dict(seconds_per_token=1e-4, train_step=0.2, devices=5,
                                          all_reduce=pytest.approx(bench.all_reduce_share(5) * 7.0 * 0.2))


def test_bad_arguments_are_refused_in_one_line_before_anything_runs(tmp_path):
    """Issue 67 items 13 and 14: each of these ended in a traceback (ZeroDivisionError; "tba.py produced no metrics"
    after the runs started) or ran silently wrong (a ratio or seed counted twice in the intervals; an empty table
    written over the document's; a point labelled G/T 0.2 whose X was clamped at 1)."""
    import bench
    (tmp_path / "file").write_text("")
    for args, line in ((["--parts", "9", "--eval-every", "0"], "--eval-every 0: give whole numbers of at least 1"),
                       (["--parts", "9", "--searchers", "0"], "--searchers 0: give whole numbers of at least 1"),
                       (["--parts", "9", "--slowdowns", "0.5"], "--slowdowns 0.5: give numbers of at least 1"),
                       (["--parts", "1", "--cap", "0"], "--cap 0: give positive numbers"),
                       (["--parts", "1", "--seeds", "-1"], "--seeds -1: give whole numbers of at least 0"),
                       (["--parts", "9", "--ratios", "-2"], "--ratios -2: give positive numbers"),
                       (["--parts", "9", "--ratios", "nan"], "--ratios nan: give positive numbers"),
                       (["--parts", "9", "--modes", "stream", "stream"], "--modes stream stream: each at most once"),
                       (["--parts", "1", "--seeds", "0", "0"], "--seeds 0 0: each at most once"),
                       (["--parts", "1", "--out", str(tmp_path / "file")], f"--out {tmp_path / 'file'} is a file: "
                                                                            f"pass a folder")):
        with pytest.raises(bench.BadInput) as e:
            bench.main(args)
        assert str(e.value) == line
    costs = dict(seconds_per_token=2e-4, train_step=0.1, tokens_per_batch=1000)
    least = 0.5 / bench.point(costs, 0.5, 4)[0]  # the G/T at X 1
    with pytest.raises(bench.BadInput, match=rf"^--ratios {least / 2:g}: at no slowdown \(X 1\) a round of 4 "
                                             rf"searcher\(s\) is already {least:.2f} x the step here"):
        bench.point(costs, least / 2, 4)
    table, doc = tmp_path / "part9.json", tmp_path / "doc.md"
    doc.write_text(f"{bench.TABLE_START}\nTHE TABLE\n{bench.TABLE_END}\n")
    table.write_text(json.dumps({"rows": [], "gain": 0.15}))
    for args, line in ((["--doc", str(doc)], f"--table: {table} holds no rows"),
                       (["--doc", str(tmp_path / "none.md")], f"--doc: {tmp_path / 'none.md'} is not a file this "
                                                               f"process can read and write")):
        with pytest.raises(bench.BadInput) as e:
            bench.main(["--table", str(table), *args])
        assert str(e.value) == line
    assert doc.read_text() == f"{bench.TABLE_START}\nTHE TABLE\n{bench.TABLE_END}\n"
    table.write_text(json.dumps({"rows": [dict({k: 1.0 for k in bench.PER_SEED}, G="fast")], "gain": 0.15}))
    with pytest.raises(bench.BadInput, match=r": a row's G is 'fast', not a number$"):
        bench.main(["--table", str(table)])


def test_a_lag_run_leaves_out_the_flags_declared_streaming():
    """without_streaming: the flags that act in no --lag run (their fields' `acts`, runtime/config.py: the buffer's
    sampling, and --max-reuse, the streaming trainer's replay), each with its value, and no other."""
    import bench
    flags = ["--recency", "1", "--lr", "2e-5", "--duplicates", "collapse", "--max-reuse", "3", "--buffer-capacity", "9"]
    assert bench.without_streaming(flags) == ["--lr", "2e-5"]


def test_part_1_gives_each_ratio_with_its_interval():
    """Part 1's table: sync is --searchers 0 --lag 0 (on-policy), and beside each seed's ratio the median over the
    seeds with its bootstrap interval (plot.interval), from launch and from the first step; a run that never reached
    the target counts at the cap, a bound, as part 9's rows count one at their horizon (before, a seed whose sync run
    never did had no ratio, one whose async run never did counted as 0)."""
    import bench
    import plot
    run = lambda seed, n, s: dict(seed=seed, searchers=n, reached=s is not None, seconds=s, first_step_seconds=5.0,
                                  step=20, seconds_per_step=0.5, utilisation=0.9 if n else None)
    r = dict(machine=dict(cpu="x", cores=2, threads_per_process=1, torch="t"), flags=[], seeds=[0, 1, 2, 3, 4],
             cap=600, time_to_target=[run(0, 0, 40), run(0, 1, 20), run(1, 0, 30), run(1, 1, 25), run(2, 0, 50),
                                      run(2, 1, 20), run(3, 0, None), run(3, 1, 20), run(4, 0, 36), run(4, 1, None)])
    lines = bench.table(r).splitlines()
    assert any("sync: --searchers 0 --lag 0 (one process, on-policy)" in line for line in lines)
    said = []
    for t in (lambda s: s, lambda s: s - 5):  # from launch, from the first step (at 5 s)
        ratio, (lo, hi) = plot.interval([t(40) / t(20), t(30) / t(25), t(50) / t(20), t(600) / t(20), t(36) / t(600)])
        said.append(f"{ratio:.2f} [{lo:.2f}, {hi:.2f}]")
    assert (f"   sync / async, the median over 5 seed(s) with its 90% interval: from launch {said[0]}; from "
            f"the first step {said[1]}") in lines, lines
    r.update(seeds=[0, 1, 2, 3], time_to_target=r["time_to_target"][:8])
    assert "from launch 2.25 " in bench.table(r)  # seed 3's sync at the cap: 30x (before: no ratio, 2.00)
    r.update(seeds=[0], time_to_target=r["time_to_target"][:2])
    assert "from launch 2.00 (no interval below 2 seeds)" in bench.table(r)


def test_the_t_interval_covers_what_it_says():
    """bench.t_interval: Student's t quantiles as tabled (9 and 4 degrees of freedom), and over 4,000 simulated cells
    of 10 seeds' log-normal ratios, the 90% interval holds the true ratio about 90% of the time (a percentile
    bootstrap of the median over 5 seeds held it as often as its min and max did); none below 2 values."""
    import numpy as np
    import bench
    assert bench.t_quantile(0.95, 9) == pytest.approx(1.833113, abs=1e-5)
    assert bench.t_quantile(0.975, 9) == pytest.approx(2.262157, abs=1e-5)
    assert bench.t_quantile(0.95, 4) == pytest.approx(2.131847, abs=1e-5)
    rng = np.random.default_rng(0)
    hits = [lo <= 1.3 <= hi for lo, hi in (bench.t_interval(1.3 * np.exp(0.2 * rng.standard_normal(10)), log=True)[1]
                                           for _ in range(4000))]
    assert 0.88 < np.mean(hits) < 0.92, np.mean(hits)
    assert bench.t_interval([1.2]) == (1.2, None) and bench.t_interval([]) == (None, None)
    point, (lo, hi) = bench.t_interval([0.01, 0.03, 0.02])
    assert point == pytest.approx(0.02) and lo < 0.02 < hi


def test_a_study_flag_goes_only_to_the_runs_where_it_acts():
    """`-- --max-reuse 1.5` (the streaming trainer's replay) goes to the streaming runs and to no --lag 0 nor colocated
    run, which would refuse it (part 9 crashed within 28 s); a flag that acts everywhere goes everywhere, a boolean
    flag without its value and a --flag=value alike; --keep-full never reaches a --lag run."""
    import bench
    flags = ["--max-reuse", "1.5", "--lr", "1e-4", "--keep-full", "--recency=0.5", "--no-activation-checkpointing"]
    assert bench.acting(flags, [], 4) == flags
    assert bench.acting(flags, ["--lag", "0"], 4) == ["--lr", "1e-4", "--no-activation-checkpointing"]
    assert bench.acting(flags, ["--lag", "0"], 0) == ["--lr", "1e-4", "--no-activation-checkpointing"]
    assert bench.acting(["--max-reuse", "1.5"], ["--keep-full"], 4) == ["--max-reuse", "1.5"]
    # a row's mode names those of them that act in some modes only: the flags every run gets name nothing apart
    assert bench.mode_label("stream", bench.acting(flags, [], 4)) == "stream --max-reuse 1.5 --keep-full --recency=0.5"
    assert bench.mode_label("sync", bench.acting(flags, ["--lag", "0"], 4)) == "sync"


def test_the_plan_counts_the_horizon_and_the_bound_the_mean_cycle():
    """The plan's estimate: each run its start-up, the horizon from its first round (no run stops at its target) and
    its evaluations (before, 12 steps where runs made 40: 1 h 02 min said for 2 h 50 min); the bound from the
    searchers' mean cycle, not the slowest's."""
    import types
    import bench
    costs = dict(seconds_per_token=1.4e-4, train_step=0.2, tokens_per_batch=900)
    cfg = types.SimpleNamespace(prompts_per_step=32, search_samples_per_prompt=8, decode_shape="rho-math-1b")
    (cell,) = bench.part9_plan(costs, cfg, [4], [2.0], [], ["colocated", "stream"], [0, 1], 1, "gpu+tails")
    est = bench.plan_seconds(cell, costs, cfg, 2, horizon=100.0)
    startup = 2 * bench.STARTUP[0] + 4 * bench.STARTUP[1]
    assert 2 * (startup + 200.0) < est < 2 * (startup + 200.0 + 200 * bench.EVAL_SECONDS)  # 2 seeds, 2 modes
    rows = [dict(rounds=[[0, 0, 0.0, 1.0], [1, 0, 0.0, 3.0]]), dict(rounds=[[0, 1, 1.0, 1.0], [1, 1, 3.0, 3.0]]),
            dict(rounds=[[0, 1, 2.0, 1.0]])]
    assert bench.cycle_of(rows) == pytest.approx(2.0)  # searchers of 1 s and 3 s: 2 s a round, not 3


def test_the_ceiling_says_what_overlap_alone_allows_and_what_the_tails_add():
    """At G/T 2 on 4 searchers against 5 colocated devices, streaming whole rounds gains at most about 1.1x in
    throughput (overlap alone: the colocated round on 5 devices costs about the searchers' on 4, GPU-shaped steps
    being mostly their fixed part); engines kept full make a batch's responses in well under half a round's time (a
    round waits for its slowest of GSM8K's tail), so that the trainer sets the pace: 2x and more. At G/T 1 both are
    the trainer's pace."""
    import types
    import bench
    costs = dict(seconds_per_token=1.42e-4, train_step=0.199, tokens_per_batch=936)
    cfg = types.SimpleNamespace(prompts_per_step=32, search_samples_per_prompt=8, decode_shape="rho-math-1b")
    two, one = bench.ceiling(costs, 2.0, 4, cfg), bench.ceiling(costs, 1.0, 4, cfg)
    assert 1.0 < two["stream"] < 1.15 and two["G_full"] < two["G"] / 2 and two["full"] > 2.0
    assert two["stream"] == pytest.approx(two["colocated"] / two["G"]) and two["full"] == pytest.approx(
        two["colocated"] / two["T"])
    assert one["full"] == pytest.approx(one["stream"], rel=0.01)
