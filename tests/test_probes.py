"""What probing the new modes found (resume, faults, odd flags), each pinned: a refusal in one line before
anything is written, every evaluation at the step asked for, a round never counted twice, a dead searcher's
run keeping its progress, and flags refused where they would change nothing."""

import dataclasses
import re
import shutil
import time
import math
import os

import numpy as np
import pytest

from buffer import ReplayBuffer, Trajectory, to_arrays
from conftest import ROOT, SMALL, env, metrics, run_tba, shared_run
from runtime import checks
from runtime.config import Config
from runtime.errors import ConfigError



def evals(out):
    return [r["step"] for r in metrics(out) if r["kind"] == "eval"]


def checkpoint(step: int, history=(), fields=("behaviour_logps",)) -> dict:
    """A checkpoint's state as runtime.checks reads it: its step, the lag's history, a buffer of made trajectories."""
    t = Trajectory(0, np.array([3, 4], np.int32), 1.0, -2.0, -2.5, step, behaviour_logps=np.zeros(2, np.float32))
    if "ref_logps" in fields:
        t.ref_logps = np.zeros(2, np.float32)
    return dict(step=step, history={v: {} for v in history}, buffer=to_arrays([t]))


# --- 1, 2: a resume the checkpoint cannot feed is refused before anything is written ----------------------------
def test_a_lag_the_checkpoint_cannot_serve_is_refused():
    cfg = lambda lag: Config(lag=lag, loss="drgrpo")
    with pytest.raises(ConfigError, match=r"^--lag: 2 samples the rounds after step 6 with the weights of steps 4-5, "
                                          r"and the checkpoint keeps none of them: resume with --lag 0$"):
        checks.check_resumable(cfg(2), checkpoint(6))  # a streaming run's checkpoint
    with pytest.raises(ConfigError, match=r"resume with --lag 1 or less"):
        checks.check_resumable(cfg(3), checkpoint(6, history=(5, 6)))  # a --lag 1 checkpoint, raised to 3
    checks.check_resumable(cfg(1), checkpoint(6, history=(4, 5, 6)))  # lowered: its weights are there
    with pytest.raises(ConfigError, match=r"with the weights of step 5, and the checkpoint keeps none of them"):
        checks.check_resumable(cfg(1), checkpoint(6))  # one step: "step 5", not "steps 5-5"
    checks.check_resumable(cfg(None), checkpoint(6))  # streaming from any checkpoint


def test_a_loss_the_buffer_cannot_feed_is_refused():
    with pytest.raises(ConfigError, match=r"^--loss: tbprime reads ref_logps, which the checkpoint's buffer does not hold"):
        checks.check_resumable(Config(loss="tbprime"), checkpoint(6))
    checks.check_resumable(Config(loss="tbprime"), checkpoint(6, fields=("ref_logps",)))
    made_for_drgrpo = checkpoint(6)
    made_for_drgrpo["buffer"]["logp_ref"][:] = np.nan  # no pi_ref pass for a loss that reads none
    with pytest.raises(ConfigError, match=r"^--loss: tb reads logp_ref"):
        checks.check_resumable(Config(loss="tb"), made_for_drgrpo)


@pytest.mark.engine
def test_a_refused_resume_writes_nothing(tiny_model, tmp_path, tmp_path_factory, refusal):
    """The probe's commands: a streaming checkpoint (a copy of test_faults' shared run, saved at step 3) resumed
    with --lag 2 is refused in one line, and the run's config.json is the checkpoint's run's still."""
    import shutil
    from test_faults import capped_checkpoint
    shared, _ = capped_checkpoint(tmp_path_factory, tiny_model)
    out = tmp_path / "stream"  # a resume without --out writes into the checkpoint's run: a copy, not the shared one
    shutil.copytree(shared, out, symlinks=True)
    before = (out / "config.json").read_text()
    status, said = refusal(["--model", tiny_model, *SMALL, "--steps", "5", "--lag", "2", "--eval-every", "0",
                            "--resume", str(out / "checkpoint")])
    lines = [line for line in said if line.startswith("tba.py: error:")]
    assert status == 2 and lines == ["tba.py: error: --lag: 2 samples the rounds after step 3 with the weights "
                                           "of steps 1-2, and the checkpoint keeps none of them: resume with --lag 0"], said
    assert (out / "config.json").read_text() == before


# --- 3, 11: flags out of range or acting nowhere -----------------------------------------------------------------
@pytest.mark.parametrize("flag", ["generation_slowdown", "train_slowdown", "timeout", "lr", "beta"])
@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_no_flag_takes_inf_or_nan(flag, value):
    with pytest.raises(ConfigError, match=rf"^--{flag.replace('_', '-')}: must be a finite number, got {value}$"):
        checks.check(Config(**{flag: value}), 1)


@pytest.mark.parametrize("given, acts", [
    (dict(lag=1, recency=0.5), "streaming"), (dict(lag=1, reward_inv_temp=2.0), "streaming"),
    (dict(lag=1, max_staleness=1), "streaming"), (dict(lag=1, buffer_capacity=1), "streaming"),
    (dict(lag=1, duplicates="collapse"), "streaming"),
    (dict(loss="tb", importance_weights=False), "--loss tbprime"), (dict(loss="tb", is_cap=2.0), "drgrpo or tbprime"),
    (dict(loss="tb", norm="budget"), "drgrpo or tbprime"), (dict(loss="tb", clip=0.1), "--loss grpo"),
    (dict(loss="grpo", is_cap=2.0), "drgrpo or tbprime"),
    (dict(loss="drgrpo", importance_weights=False), "--loss tbprime"),
    (dict(loss="tbprime", reward_temp=2.0), "--loss tb"), (dict(lag=1, max_reuse=2.0), "streaming trainer"),
    (dict(searchers=0, max_reuse=1.0), "streaming trainer"), (dict(decode_cost="gpu"), "emulated decoding"),
    (dict(response_lengths="gsm8k"), "emulated decoding"),
    (dict(calibration="costs.json"), "emulated device time"),  # a calibration without a slowdown
])
def test_a_flag_that_would_change_nothing_is_refused(given, acts):
    """One rule (its field's `acts`, checks.acts_only): a flag given another value than its default where it cannot act."""
    cfg = Config(**given)
    derived = cfg
    flag = next(k for k in given if k not in ("lag", "loss", "searchers"))
    with pytest.raises(ConfigError, match=rf"^--{flag.replace('_', '-')}: acts only in .*{acts}.*; here it would "
                                          rf"change nothing$"):
        checks.check_unused(derived, cfg)
    checks.check_unused(dataclasses.replace(derived, **{flag: getattr(Config(), flag)}))  # its default: fine


# --- 4, 6, 7: every evaluation asked for happens, of the step it names, in every mode ----------------------------
def grid_run(tmp_path_factory, tiny_model, mode: list, steps: int):
    """(its --out, its output) of a run of `mode` evaluated every 2 steps, made once a session (shared_run:
    test_lag reads these runs too)."""
    return shared_run(tmp_path_factory, "grid" + "".join(mode), ["--model", tiny_model, *SMALL, "--steps", str(steps),
                                                                 "--eval-every", "2", *mode])


@pytest.mark.engine
@pytest.mark.parametrize("mode, steps, grid", [
    (["--lag", "2"], 8, [0, 2, 4, 6, 8]), (["--lag", "20"], 5, [0, 2, 4, 5]),  # past the last lagged round too
    ([], 8, [0, 2, 4, 6, 8]), (["--sync-every", "3"], 8, [0, 2, 4, 6, 8]),  # streaming; holding older weights
])
def test_every_evaluation_is_of_the_step_asked_for(mode, steps, grid, tiny_model, tmp_path_factory):
    out, _ = grid_run(tmp_path_factory, tiny_model, mode, steps)
    assert evals(out) == grid and all(r["version"] == r["step"] for r in metrics(out) if r["kind"] == "eval")


@pytest.mark.engine
def test_a_resumed_runs_first_evaluation_is_of_its_checkpoint(tiny_model, tmp_path):
    """Streaming searchers that held older weights at the checkpoint (--sync-every 3, saved at step 4): the resumed
    run's first evaluation is of step 4's weights, and the summary credits its score to step 4."""
    out = tmp_path / "run"
    flags = ["--model", tiny_model, *SMALL, "--sync-every", "3", "--eval-every", "2"]
    p = run_tba([*flags, "--steps", "4", "--save-every", "4", "--out", str(out)], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:]
    p = run_tba([*flags, "--steps", "6", "--resume", str(out / "checkpoint")], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:]
    resumed = [r for r in metrics(out) if r["kind"] == "eval" and r.get("resumed") == 4]
    assert [r["step"] for r in resumed] == [4, 6], resumed
    assert f"resumed at step 4 ({resumed[0]['accuracy']:.3f})" in p.stdout.strip().splitlines()[-1]


# --- 9: no hang: an emulated step longer than --timeout -----------------------------------------------------------
@pytest.mark.engine
def test_an_emulated_step_past_the_timeout_stops_in_one_line(tiny_model, tmp_path):
    p = run_tba(["--model", tiny_model, *SMALL, "--searchers", "0", "--generation-slowdown", "1e6", "--timeout", "5",
                 "--steps", "3", "--out", str(tmp_path / "run")], tmp_path, timeout=240)
    lines = [line for line in p.stdout.splitlines() if line.startswith("tba.py:")]
    assert p.returncode == 1 and len(lines) == 1 and lines[0].startswith("tba.py: error: an emulated step of "), p.stdout
    assert "is longer than --timeout 5: lower the slowdown" in lines[0]


# --- 12, 13: the scoring batch; small things ------------------------------------------------------------------------
@pytest.mark.engine
def test_the_micro_batch_is_the_trainers_alone(tiny_model, tmp_path, monkeypatch):
    """--micro-batch 1 does not make the searchers score one sequence a pass: --score-batch is what 2 GiB of logits
    hold (256 at most), or what it says."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TBA_CACHE", str(tmp_path / "cache"))
    cfg, _, _ = checks.check(checks.parse(Config, ["--model", tiny_model, "--micro-batch", "1"]), 1)
    assert (cfg.micro_batch, cfg.score_batch) == (1, 256)
    cfg, _, _ = checks.check(checks.parse(Config, ["--model", tiny_model, "--score-batch", "3"]), 1)
    assert cfg.score_batch == 3


def test_a_byte_order_mark_is_read_and_an_empty_problem_refused(tmp_path):
    from tasks import math as math_task
    from tasks.task import read_jsonl
    path = tmp_path / "train.jsonl"
    path.write_bytes("\ufeff".encode() + b'{"problem": "1+1?", "answer": "2"}\n')
    assert [p.answer for p in read_jsonl(str(path), math_task.problem)] == ["2"]
    with pytest.raises(ConfigError, match=r"line 1: empty problem"):
        math_task.problem({"problem": "  ", "answer": "2"}, f"{path} line 1")


def test_bench_prints_only_the_parts_it_ran():
    import bench
    r = dict(machine=dict(cpu="x", cores=2, threads_per_process=1, torch="t"), flags=[], time_to_target=[],
             miniature=dict(lags=[0], losses=["tb"], rows=[dict(loss="tb", lag=0, final=0.5, best=0.6)]))
    lines = bench.table(r).splitlines()
    assert [line for line in lines if line[:2] in ("1.", "2.", "3.", "4.", "5.")] == [] and lines[2].startswith("12.")


def test_the_readme_says_where_the_trainer_is():
    from test_readme import section
    assert "`Trainer`, below it" in section("Read the code in this order")


def test_the_output_page_lists_every_losss_statistics():
    page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "output.md")).read()
    for stat in ("log_z", "kl", "clip_frac", "capped"):
        assert f"`{stat}`" in page, stat


def test_a_checkpoint_carries_no_round_to_come():
    """5 at the buffer's level (tests/test_lag.py runs it whole): rounds of steps already trained are dropped."""
    buf = ReplayBuffer(4, 1.0, 0.0)
    t = Trajectory(1, np.array([2], np.int32), 0.0, 0.0, 0.0, 0, for_step=3)
    buf.add([t])
    assert ReplayBuffer.from_state(buf.state()).waiting() == 0


# --- issue 44: the lag's host ring, the evaluation's seeds -----------------------------------------------------
def test_the_lags_history_is_a_ring_of_l_plus_1_buffers_reused():
    """--lag 2 on the CPU (pinning is a no-op there): the weights of each step go into one of 3 host buffers allocated
    once, step v's in slot v % 3, each holding the values written; the history is the last 3 steps'."""
    import multiprocessing as mp
    import torch
    from runtime import weights
    model = torch.nn.Linear(3, 2)
    out = weights.Outbox(weights.create(mp.get_context("spawn")), lag=2, timeout=10)
    out.share(model, 0, torch.float32, with_pi_ref=False)
    slots = [id(slot) for slot in out.ring]
    for v in range(1, 6):
        with torch.no_grad():
            model.weight.fill_(v)
        copy = out.keep(weights.gather(model), v)
        assert id(copy) == slots[v % 3] and torch.all(copy["weight"] == v)
        out.forget(v - 2)
    assert sorted(out.history) == [3, 4, 5] and [id(s) for s in out.ring] == slots
    assert all(torch.all(out.history[v]["weight"] == v) for v in (3, 4, 5))


def test_each_held_out_problem_has_its_own_seed():
    from searcher import evaluation_seed
    prompts = [[5, 6, 7], [5, 6, 8], [9]]
    assert len({evaluation_seed(3, p) for p in prompts}) == 3  # the problems' noise is their own
    assert [evaluation_seed(3, p) for p in prompts] == [evaluation_seed(3, list(p)) for p in prompts]  # reproducible
    assert evaluation_seed(4, prompts[0]) != evaluation_seed(3, prompts[0])


@pytest.mark.engine
def test_the_evaluations_can_come_after_the_run(tiny_model, tmp_path):
    """--evaluator after (bench.py part 9's: no evaluation disturbs a mode): the trainer keeps the weights of each step
    of the grid and evaluates them after the last, each row at the time its weights were made; the same scores as
    searcher 0's evaluation of those weights (greedy, --lag 1: the same weights in both runs)."""
    rows = {}
    for evaluator in ("after", "searcher"):
        out = tmp_path / evaluator
        p = run_tba(["--model", tiny_model, *SMALL, "--steps", "4", "--eval-every", "2", "--lag", "1", "--seed", "2",
                     "--evaluator", evaluator, "--out", str(out)], tmp_path)
        assert p.returncode == 0, p.stdout[-3000:]
        rows[evaluator] = [r for r in metrics(out) if r["kind"] == "eval"]
    assert [r["step"] for r in rows["after"]] == [0, 2, 4]
    assert [r["accuracy"] for r in rows["after"]] == [r["accuracy"] for r in rows["searcher"]]
    train = {r["step"]: r for r in metrics(tmp_path / "after") if r["kind"] == "train"}
    kinds = [r["kind"] for r in metrics(tmp_path / "after")]
    assert kinds.index("eval") > max(i for i, k in enumerate(kinds) if k == "train")  # after the last step
    assert rows["after"][1]["time"] <= train[3]["time"]  # the time its weights were made (after step 2)


def test_the_trainers_evaluator_needs_one_rank():
    with pytest.raises(ConfigError, match=r"^--evaluator: after runs an engine in the trainer's process"):
        checks.check(Config(evaluator="after", prompts_per_step=4), 2)


# --- the probes of the newest flags: data kept on a stop, a finish that can be had, odd values refused -----------
@pytest.mark.engine
def test_the_kept_evaluations_are_made_on_a_stop_and_a_stopped_end_can_be_finished(tiny_model, tmp_path):
    """--evaluator after stopped by Ctrl-C mid-run: every evaluation asked for so far is made and logged (before, the
    kept weights were lost with the process: no eval row at all), beside the checkpoint. A resume at the
    checkpoint's own --steps whose run has no final/ (a stop during the final evaluations) does the end only; once
    final/ exists, the same resume is refused as finished."""
    import signal
    import subprocess
    import sys
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "tba.py"), "--model", tiny_model, *SMALL, "--steps",
                          "100000", "--eval-every", "2", "--evaluator", "after", "--out", str(out)], cwd=tmp_path,
                         env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 180
    while not (out / "metrics.jsonl").exists() or sum(r["kind"] == "train" for r in metrics(out)) < 7:
        assert time.time() < deadline and p.poll() is None
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    output, _ = p.communicate(timeout=120)
    assert p.returncode == 130 and "evaluating the weights of" in output, output[-3000:]
    trained = max(r["step"] for r in metrics(out) if r["kind"] == "train")
    assert [r["step"] for r in metrics(out) if r["kind"] == "eval"] == list(range(0, trained + 1, 2))
    done = torch_load_step(out / "checkpoint")
    shutil.rmtree(out / "final", ignore_errors=True)
    p = run_tba(["--model", tiny_model, *SMALL, "--steps", str(done), "--resume", str(out / "checkpoint")], tmp_path)
    assert p.returncode == 0 and (out / "final" / "config.json").exists(), p.stdout[-3000:]
    p = run_tba(["--model", tiny_model, *SMALL, "--steps", str(done), "--resume", str(out / "checkpoint")], tmp_path)
    assert p.returncode == 2 and "the run is finished (its final/ is written)" in p.stdout


def torch_load_step(folder) -> int:
    import torch
    return torch.load(folder / "trainer.pt", weights_only=True)["step"]


@pytest.mark.engine
def test_a_lag_run_resumed_with_another_reference_reset_goes_on(tiny_model, tmp_path):
    """--lag 1 with TBA′ resets every 3 steps, saved at step 4, resumed with resets every 5: the searcher keeps the
    checkpoint's pi_ref (of step 3) until the run's own next reset (after step 5), instead of dying on a reset it could not
    reach (before: 'the pi_ref of step 18 were published while this searcher needed those of step 15')."""
    out = tmp_path / "run"
    flags = ["--model", tiny_model, *SMALL, "--lag", "1", "--loss", "tbprime", "--behaviour-logprobs", "trainer"]
    p = run_tba([*flags, "--steps", "4", "--ref-reset-every", "3", "--save-every", "4", "--out", str(out)], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:]
    p = run_tba([*flags, "--steps", "8", "--ref-reset-every", "5", "--resume", str(out / "checkpoint")], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:]
    train = [r for r in metrics(out) if r["kind"] == "train" and r.get("resumed") == 4]
    assert [r["step"] for r in train] == [5, 6, 7, 8] and [r["reference"] for r in train] == [5, 5, 5, 5]


def test_calibration_files_are_checked_in_one_line(tmp_path):
    from runtime.errors import ConfigError
    from runtime.slowdown import read_calibration
    costs = tmp_path / "costs.json"
    for text, why in (('{"seconds_per_token": true, "train_step": 1}', "seconds_per_token is True"),
                      ('{"seconds_per_token": 1e300, "train_step": 1}', "below 3600"), ("[]", "is None")):
        costs.write_text(text)
        with pytest.raises(ConfigError, match=rf"^--calibration: .*{re.escape(why)}"):
            read_calibration(str(costs))
    # a colocated run's: devices, a whole number, and the all-reduce's seconds a step
    for extra, why in (('"devices": 0', "devices must be a whole number of devices, 1 or more; it is 0"),
                       ('"devices": 2.5', "it is 2.5"), ('"all_reduce": -1', "all_reduce must be seconds"),
                       ('"all_reduce": true', "it is True")):
        costs.write_text('{"seconds_per_token": 1e-4, "train_step": 0.1, %s}' % extra)
        with pytest.raises(ConfigError, match=rf"^--calibration: .*{re.escape(why)}"):
            read_calibration(str(costs))
    costs.write_text('{"seconds_per_token": 1e-4, "train_step": 0.1, "devices": 5, "all_reduce": 0.02}')
    assert read_calibration(str(costs)) == dict(seconds_per_token=1e-4, train_step=0.1, devices=5, all_reduce=0.02)
    with pytest.raises(ConfigError, match=r"^--calibration: .*missing.json does not exist$"):
        read_calibration(str(tmp_path / "missing.json"))


def test_a_process_over_its_charge_is_called_cpu_bound():
    """The over-budget shares are each process's own: the done line and a warning say which runs over by 10% (a
    calibration from a faster machine: nothing slept, every step over its charge)."""
    from runtime.log import Log
    log = Log.__new__(Log)
    assert log.cpu_bound(dict(over_trainer=0.05, over_searchers={"0": 0.02})) == ""
    assert log.cpu_bound(dict(over_trainer=0.3, over_searchers={"0": 0.02, "1": 0.6})) == (
        "CPU-bound (the trainer 30%, searcher 1 60% over its own charge, uncharged work counted)")
    # work no device pays for counts with the overrun: 4% over and 7% of reloads, scoring and pi_ref is 11%
    assert log.cpu_bound(dict(over_trainer=0.0, over_searchers={"0": 0.04}, uncharged_trainer=0.02,
                              uncharged_searchers={"0": 0.07})) == (
        "CPU-bound (searcher 0 11% over its own charge, uncharged work counted)")


def test_the_work_no_device_pays_for_is_counted_per_round_and_per_process():
    """Log.searched: a round's reload (the engine's clock, `apart`) and its time beside its decoding steps and their
    sleep (scoring, pi_ref) are counted per part, per round in the train row's `uncharged`, and per process as a share
    of its charge; the trainer's publishes are its own; each round with a start is listed once, in the next row."""
    import types
    from runtime.log import Log
    log = Log.__new__(Log)
    log.t0, log.rank, log.emulated, log.overhead = 100.0, 1, True, 0.0
    log.generate = log.slept = log.charged = log.over = 0.0
    log.rounds, log.parts, log.budgets, log.uncharged, log.published, log.received = 0, {}, {}, {}, 0.0, []
    log.calibration, log.cpu_bound_said, log.last_train = {"seconds_per_token": {"0": 1e-4}}, False, None
    for version in (1, 2):
        log.searched(dict(searcher=0, version=version, started=100.0 + version, seconds=1.2, generate=0.1, slept=0.9,
                          charged=1.0, over=0.0, parts={}, seconds_per_token=1e-4, uncharged={"reload": 0.05}))
    assert log.per_round()["uncharged"] == pytest.approx({"reload": 0.05, "score": 0.2})
    assert log.received == [[0, 1, 1.0, 1.25], [0, 2, 2.0, 1.25]]  # [searcher, version, start, reload + round]
    log.published = 0.1
    clock = types.SimpleNamespace(charged=2.0, over=0.2)
    shares = log.over_shares(clock)
    assert shares["uncharged_searchers"] == {"0": pytest.approx(0.5 / 2.0)} and shares["over_searchers"] == {"0": 0.0}
    assert shares["over_trainer"] == pytest.approx(0.1) and shares["uncharged_trainer"] == pytest.approx(0.05)
