"""--generation-slowdown (bench.py part 9's emulation of the generation-bound regime): a slowed round
takes X times its generation's cost alone (each engine calibrated once, warm and alone), in the
searchers and in the synchronous baseline; evaluation is not slowed; the run records the factor and
the calibrations in config.json and its summary line."""

import json
import time

import numpy as np
import pytest

from conftest import DEVICE, metrics
from runtime.slowdown import slow_down
from test_e2e import capped_slow_run, run_small


def test_slow_down_sleeps_until_x_times_the_cost_alone():
    assert slow_down(0.5, 0.1, 1.0) == 0.0  # off: no sleep at all, even where generation was slowed by others
    t0 = time.perf_counter()
    slept = slow_down(0.05, 0.02, 6.0)  # took 0.05 s (sharing the cores), 0.02 s alone: charged 0.12 s
    took = time.perf_counter() - t0
    assert slept == pytest.approx(0.07)
    assert 0.07 <= took < 1.0  # a sleep lasts at least its time; the bound above only catches a wrong factor
    assert slow_down(0.3, 0.02, 6.0) == 0.0  # took longer than charged: no sleep, never a negative one


@pytest.mark.engine
@pytest.mark.parametrize("searchers, x", [(0, 100.0), (1, 20.0)], ids=["synchronous", "async"])
def test_both_paths_honour_the_slowdown(searchers, x, tiny_model, tmp_path, tmp_path_factory):
    """The async case reads test_e2e's run under the reuse cap (generation slowed 20x)."""
    if searchers == 0:
        out, p = run_small(tiny_model, tmp_path, "--steps", "3", "--eval-every", "2", "--searchers", "0",
                           "--generation-slowdown", str(x))
        stdout = p.stdout
    else:
        out, stdout = capped_slow_run(tmp_path_factory, tiny_model)
    saved = json.load(open(out / "config.json"))
    assert saved["generation_slowdown"] == x
    engine = "trainer" if searchers == 0 else "0"
    calibrated = saved["seconds_per_token"]
    assert list(calibrated) == [engine] and 0 < calibrated[engine] < 1  # s a token, alone
    assert f"generation slowed {x:g}x (emulated)" in stdout
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


@pytest.mark.engine
def test_slowdown_below_one_is_refused(tiny_model, tmp_path, refusal):
    status, lines = refusal(["--model", tiny_model, "--generation-slowdown", "0.5", "--out", str(tmp_path / "r")])
    assert status == 2 and lines[-1] == "tba.py: error: --generation-slowdown: must be 1 (off) or more, got 0.5"


@pytest.mark.engine
def test_a_colocated_calibration_is_for_the_one_process_run_only(tiny_model, tmp_path, refusal):
    """A calibration with devices (the colocated baseline's: generation and training split over D devices) with
    searchers would charge each searcher a fifth of its round: refused in one line."""
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"seconds_per_token": 1e-4, "train_step": 0.05, "devices": 5, "all_reduce": 0.01}))
    status, lines = refusal(["--model", tiny_model, "--generation-slowdown", "2", "--calibration", str(costs),
                             "--out", str(tmp_path / "r")])
    assert status == 2 and lines[-1] == (f"tba.py: error: --calibration: {costs} holds a colocated run's devices "
                                         f"(generation and training split over them): with --searchers 0 only")


@pytest.mark.engine
def test_only_search_rounds_are_slowed(tiny_model, monkeypatch):
    """The emulation slows the searchers' generation, each decoding step of it, never the evaluation: counted
    by the calls to slow_down in one engine (a comparison of times would depend on the machine's load)."""
    import searcher
    from runtime import slowdown
    from transformers import AutoTokenizer
    from test_weight_sync import config
    calls = []
    monkeypatch.setattr(slowdown, "slow_down", lambda generate, alone, factor, limit=0: calls.append((factor, alone)) or 0.0)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompts, answers = [tok("12+34=").input_ids, tok("47+85=").input_ids], ["46", "132"]
    engine = searcher.Engine(config(tiny_model, generation_slowdown=100.0), DEVICE, 0.1, prompts, answers)
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


# --- the emulated device time, unit by unit -------------------------------------------------------------------
def test_a_training_step_lasts_y_times_its_cost_alone():
    """--train-slowdown Y: a step of compute (here a sleep of 0.05 s, its cost alone by the calibration) and its charge
    last Y x 0.05 s, within 10%; without a calibration the first 3 steps run unslowed and give the cost alone."""
    from runtime.slowdown import TrainClock
    clock = TrainClock(3.0, seconds=0.05)
    for _ in range(3):
        t0 = time.perf_counter()
        time.sleep(0.05)
        clock.charge(time.perf_counter() - t0)
        assert time.perf_counter() - t0 == pytest.approx(0.15, rel=0.1)
    assert clock.charged == pytest.approx(0.45) and clock.over == 0.0
    own = TrainClock(4.0)
    assert [own.charge(s) for s in (0.2, 0.1, 0.3)] == [0.0, 0.0, 0.0] and own.seconds == 0.2  # the median
    assert TrainClock(1.0).charge(5.0) == 0.0  # off


def test_real_compute_above_the_charge_is_over_budget():
    from runtime.slowdown import Clock, TrainClock
    clock = Clock(2.0, seconds_per_token=1e-3)
    clock.step(0.5, 10)  # charged 2 x 10 x 1 ms = 0.02 s, took 0.5 s
    made = clock.account()
    assert made["charged"] == pytest.approx(0.02) and made["over"] == pytest.approx(0.48) and made["slept"] == 0.0
    train = TrainClock(2.0, seconds=0.01)
    train.charge(0.1)
    assert train.over == pytest.approx(0.08)


def test_a_gpu_shaped_step_costs_a_fixed_part_and_a_little_a_sequence():
    """--decode-cost gpu: the same cost as linear at a whole batch, about half of it for one sequence at Llama-2-7B's
    shape (GPU_PER_SEQUENCE = 0.016 from vLLM's published step times), where linear charges 1 / 64 of it; a model with
    grouped-query attention is flatter by its KV cache's bytes a token over its weights' (rho-math-1b: 0.0042)."""
    from runtime.slowdown import GPU_PER_SEQUENCE, Clock, per_sequence
    gpu = Clock(10.0, 1e-3, "gpu", full=64, model="llama-2-7b")
    linear = Clock(10.0, 1e-3, "linear", full=64)
    assert gpu.alone(64) == pytest.approx(linear.alone(64))
    assert gpu.alone(1) / gpu.alone(64) == pytest.approx((1 + GPU_PER_SEQUENCE) / (1 + 64 * GPU_PER_SEQUENCE))
    assert linear.alone(1) / linear.alone(64) == pytest.approx(1 / 64)
    # rho-math-1b: 22 layers x 4 key/value heads x 64 against 32 x 32 x 128, over 1.10B parameters against 6.74B
    assert per_sequence("rho-math-1b") == pytest.approx(0.016 * (22 * 4 * 64 / 1.10e9) / (32 * 32 * 128 / 6.74e9))
    assert per_sequence("qwen2.5-7b") < per_sequence("rho-math-1b") < per_sequence("llama-2-7b") == GPU_PER_SEQUENCE
    rho = Clock(10.0, 1e-3, "gpu", full=64)  # the default shape: rho-math-1b's, the paper's GSM8K model
    assert 0.98 < rho.alone(16) / rho.alone(64) * (1 + 64 * rho.b) / (1 + 16 * rho.b) < 1.02
    assert rho.alone(16) / rho.alone(64) > 0.8  # a quarter of the batch costs almost as much a step


def test_a_colocated_run_splits_generation_and_training_over_its_devices():
    """A colocated calibration (devices D = 5, all_reduce): each decoding step costs the slowest device's share of the
    running sequences, ceil(r / D); linear: a fifth of the whole, one sequence still a whole one's; GPU-shaped: the
    fixed part is each device's, so a fifth of the sequences costs more than a fifth (rho-math-1b: 0.60 of the whole
    at 256); a training step costs Y x its cost alone / D, then the all-reduce; a round's cost alone adds its steps."""
    from runtime.slowdown import Clock, TrainClock
    one, five = Clock(10.0, 1e-3, "linear", full=256), Clock(10.0, 1e-3, "linear", full=256, devices=5)
    assert five.alone(256) == pytest.approx(one.alone(52)) and five.alone(1) == one.alone(1) == pytest.approx(1e-3)
    gpu1, gpu5 = Clock(10.0, 1e-3, "gpu", full=256), Clock(10.0, 1e-3, "gpu", full=256, devices=5)
    b = gpu1.b
    assert gpu5.alone(256) / gpu1.alone(256) == pytest.approx((1 + 52 * b) / (1 + 256 * b))
    assert 0.55 < gpu5.alone(256) / gpu1.alone(256) < 0.65 and gpu5.alone(1) == pytest.approx(gpu1.alone(1))
    # a round's cost alone: responses of 3, 1 and 2 steps: steps with 3, 2 and 1 running
    assert one.round_alone([3, 1, 2]) == pytest.approx(1e-3 * (3 + 2 + 1))
    assert gpu1.round_alone([3, 1, 2]) == pytest.approx(gpu1.alone(3) + gpu1.alone(2) + gpu1.alone(1))
    assert one.round_alone([]) == 0.0
    train = TrainClock(2.0, seconds=0.1, devices=5, all_reduce=0.01)
    t0 = time.perf_counter()
    train.charge(0.0)
    assert train.charged == pytest.approx(2.0 * 0.1 / 5 + 0.01) and time.perf_counter() - t0 >= 0.05
    assert train.ended is not None and train.ended <= time.time()


def test_a_long_tailed_response_holds_its_slot_for_its_emulated_steps():
    """--response-lengths gsm8k: a response vLLM finished after 3 steps stays in its slot (and runs for the clock) until
    3 x its draw from the tail have passed; the draws follow GSM8K_TAIL and are reproducible from the seed."""
    import types
    from runtime.slowdown import GSM8K_TAIL, Tails, tail
    engine = types.SimpleNamespace(get_num_unfinished_requests=lambda: 0, has_unfinished_requests=lambda: False)
    slots = Tails(engine)
    slots.admit("a", (0, 1, 2, 0))
    out = types.SimpleNamespace(request_id="a", outputs=[types.SimpleNamespace(token_ids=[5, 6, 7])])
    end = max(3, round(3 * tail((0, 1, 2, 0))))
    left = [slots.leave([out] if step == 2 else []) for step in range(end + 1)]
    assert [i for i, x in enumerate(left) if x] == [end - 1] and slots.running() == 0 and not slots.busy()
    draws = [tail((0, i)) for i in range(2000)]
    assert draws[:3] == [tail((0, i)) for i in range(3)] and min(GSM8K_TAIL) <= min(draws) <= max(draws) <= max(GSM8K_TAIL)
    assert np.median(draws) == pytest.approx(1.0, abs=0.05) and np.quantile(draws, 0.95) == pytest.approx(1.989, abs=0.1)


def test_a_calibration_file_is_plain_json_of_two_costs(tmp_path):
    from runtime.errors import ConfigError
    from runtime.slowdown import read_calibration
    good = tmp_path / "costs.json"
    good.write_text(json.dumps({"seconds_per_token": 2e-4, "train_step": 0.1, "note": "idle"}))
    assert read_calibration(str(good)) == {"seconds_per_token": 2e-4, "train_step": 0.1, "devices": 1, "all_reduce": 0.0}
    for text, why in (("not json", "does not read as JSON"), ('{"seconds_per_token": 0, "train_step": 1}', "positive"),
                      ('{"train_step": 1}', "positive")):
        good.write_text(text)
        with pytest.raises(ConfigError, match=rf"^--calibration: .*{why}"):
            read_calibration(str(good))


@pytest.mark.engine
@pytest.mark.parametrize("searchers", [0, 1])
def test_both_phases_emulated_from_one_calibration(searchers, tiny_model, tmp_path):
    """--train-slowdown and --calibration, with --searchers 0 and with a searcher: the costs alone are the file's (no
    engine times itself), recorded in config.json; every training step is charged Y x the file's step; the summary
    says both slowdowns."""
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"seconds_per_token": 1e-4, "train_step": 0.05}))
    out, p = run_small(tiny_model, tmp_path, "--steps", "4", "--eval-every", "0", "--searchers", str(searchers),
                       "--generation-slowdown", "3", "--train-slowdown", "2", "--calibration", str(costs))
    saved = json.load(open(out / "config.json"))
    assert (saved["train_slowdown"], saved["calibration"], saved["train_step"]) == (2.0, str(costs), 0.05)
    assert set(saved["seconds_per_token"].values()) == {1e-4}
    assert "generation slowed 3x (emulated) | training slowed 2x (emulated)" in p.stdout
    train = [r for r in metrics(out) if r["kind"] == "train"]
    assert [r["train_charged"] for r in train] == pytest.approx([0.1 * (i + 1) for i in range(4)])
    assert all(r["train_slept"] <= r["train_charged"] and r["over_budget"] >= 0 for r in train)


@pytest.mark.engine
def test_no_round_of_the_synchronous_baseline_starts_before_its_weights(tiny_model, tmp_path):
    """--lag 0 with both phases emulated and two searchers, read from the rows' timeline: every step's weights reach
    the shared copy only after its training and its emulated charge ended (`trained` <= `published`), and every
    round of each searcher starts only once the weights it was made with were published; each round it sends is
    listed once, with the version it needs. Before the charge moved ahead of the publish, a round for the next step
    started inside the trainer's sleep (a baseline faster than the hardware allows)."""
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"seconds_per_token": 5e-4, "train_step": 0.05}))
    out, _ = run_small(tiny_model, tmp_path, "--steps", "6", "--eval-every", "0", "--lag", "0", "--searchers", "2",
                       "--generation-slowdown", "20", "--train-slowdown", "6", "--calibration", str(costs))
    train = [r for r in metrics(out) if r["kind"] == "train"]
    published = {r["step"]: r["published"] for r in train}
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6] and all(r["trained"] <= r["published"] for r in train[:-1])
    assert train[-1]["published"] is None  # no round needs the last step's weights: --lag keeps them (final: at the end)
    rounds = [tuple(x) for r in train for x in r["rounds"]]
    assert sorted((v, s) for s, v, _, _ in rounds) == [(v, s) for v in range(6) for s in (0, 1)]  # step v's rounds
    late = [(s, v, start, published[v]) for s, v, start, _ in rounds if v and start < published[v]]
    assert not late, f"rounds that started before their weights were published: {late}"
    assert train[-1]["over_trainer"] >= 0 and set(train[-1]["uncharged_searchers"]) == {"0", "1"}
