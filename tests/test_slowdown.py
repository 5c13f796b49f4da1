"""--generation-slowdown (bench.py part 9's emulation of the generation-bound regime): a slowed round
takes X times its generation's cost alone (each engine calibrated once, warm and alone), in the
searchers and in the synchronous baseline; evaluation is not slowed; the run records the factor and
the calibrations in config.json and its summary line."""

import json
import time

import pytest

from conftest import metrics
from runtime.slowdown import slow_down
from test_e2e import run_small


def test_slow_down_sleeps_until_x_times_the_cost_alone():
    assert slow_down(0.5, 0.1, 1.0) == 0.0  # off: no sleep at all, even where generation was slowed by others
    t0 = time.perf_counter()
    slept = slow_down(0.05, 0.02, 6.0)  # took 0.05 s (sharing the cores), 0.02 s alone: charged 0.12 s
    took = time.perf_counter() - t0
    assert slept == pytest.approx(0.07)
    assert 0.07 <= took < 1.0  # a sleep lasts at least its time; the bound above only catches a wrong factor
    assert slow_down(0.3, 0.02, 6.0) == 0.0  # took longer than charged: no sleep, never a negative one


@pytest.mark.parametrize("searchers, x", [(0, 100.0), (1, 5.0)], ids=["synchronous", "async"])
def test_both_paths_honour_the_slowdown(searchers, x, tiny_model, tmp_path):
    out, p = run_small(tiny_model, tmp_path, "--steps", "3", "--eval-every", "2", "--searchers", str(searchers),
                       "--generation-slowdown", str(x))
    saved = json.load(open(out / "config.json"))
    assert saved["generation_slowdown"] == x
    engine = "trainer" if searchers == 0 else "0"
    calibrated = saved["seconds_per_token"]
    assert list(calibrated) == [engine] and 0 < calibrated[engine] < 1  # s a token, alone
    assert f"generation slowed {x:g}x (emulated)" in p.stdout
    rows = metrics(out)
    train, evals = [r for r in rows if r["kind"] == "train"], [r for r in rows if r["kind"] == "eval"]
    last = train[-1]
    # each round received slept until X x its cost alone had passed, none longer: the generation and the
    # sleeps add up to what was charged, or more where a round took longer by itself
    assert last["generate"] > 0 and last["charged"] > 0 and last["slept"] > 0
    assert last["generate"] + last["slept"] >= last["charged"] * (1 - 1e-9)
    assert last["slept"] < last["charged"]
    if searchers == 0:  # the trainer's own rounds, timed around them, held the generation and the sleep
        assert sum(r["search"] for r in train) >= last["generate"] + last["slept"]
        assert len(evals) == 3  # evaluation is not slowed: test_only_search_rounds_are_slowed
    else:  # the rounds are the searcher's: the trainer spent none of its own time in them
        assert all(r["search"] == 0 for r in train)
        assert last["slept"] <= last["time"]  # one searcher: the sleeps of the rounds received fit in the run


def test_slowdown_below_one_is_refused(tiny_model, tmp_path):
    from conftest import run_tba
    p = run_tba(["--model", tiny_model, "--generation-slowdown", "0.5", "--out", str(tmp_path / "r")], tmp_path)
    assert p.returncode == 2 and p.stdout.strip().splitlines()[-1] == \
        "tba.py: error: --generation-slowdown: must be 1 (off) or more, got 0.5"


def test_only_search_rounds_are_slowed(tiny_model, monkeypatch):
    """The emulation slows the searchers' generation, each decoding step of it, never the evaluation: counted
    by the calls to slow_down in one engine (a comparison of times would depend on the machine's load)."""
    import searcher
    from runtime import slowdown
    from transformers import AutoTokenizer
    from test_weight_sync import config
    calls = []
    monkeypatch.setattr(slowdown, "slow_down", lambda generate, alone, factor: calls.append((factor, alone)) or 0.0)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompts, answers = [tok("12+34=").input_ids, tok("47+85=").input_ids], ["46", "132"]
    engine = searcher.Engine(config(tiny_model, generation_slowdown=100.0), "cpu", 0.1, prompts, answers)
    try:
        engine.clock.seconds_per_token = 1e-4  # as calibrated: s a generated token costs this engine alone
        scores, _ = engine.evaluate(prompts, answers)
        assert calls == [] and "accuracy" in scores
        trajectories, made = engine.search([0, 1], 4, (0, 0, 0))
        longest = max(len(t.response) for t in trajectories)
        assert len(calls) == longest and all(f == 100.0 for f, _ in calls)  # one a decoding step
        assert calls[0][1] == pytest.approx(8 * 1e-4)  # the first step: 8 sequences, a token each, at their cost alone
        assert len(trajectories) == 8 and made["slept"] == 0.0
    finally:
        engine.close()
