"""--lag L, the exact lag: the batch of step n is made of rounds sampled by the weights of step n - L, split
across the searchers, whatever their number, the trainer ranks' and a resume; L = 0 is the synchronous
baseline on the searchers' hardware. A killed or stopped searcher ends the run in one line."""

import os
import re
import signal

import pytest
import torch

from conftest import SMALL, metrics, run_tba
from test_faults import assert_all_gone, assert_checkpoint, searcher_pids, start, wait_for_steps


def train_rows(out):
    return [r for r in metrics(out) if r["kind"] == "train"]


def assert_exact(rows, lag):
    """Every trajectory of step n's batch (row step n + 1) was sampled by the weights of step n - L (0 before)."""
    for r in rows:
        expected = min(r["step"] - 1, lag)
        assert r["staleness"] == expected and r["staleness_max"] == expected, (lag, r["step"], r["staleness"],
                                                                              r["staleness_max"])


@pytest.mark.engine
@pytest.mark.parametrize("searchers,lag", [(1, 0), (1, 2), (2, 1), (2, 3)])
def test_staleness_is_exactly_the_lag(tiny_model, tmp_path_factory, searchers, lag):
    """With L = 0 the trainer waits for each step's rounds (a wait in every step) and the searchers wait for
    each step's weights (staleness 0); with L >= 1 exactly L. The evaluations come, of the weights asked for (the
    runs of test_probes' evaluation grid: one searcher at L = 2 is one of them)."""
    from test_probes import grid_run
    two = ["--searchers", "2"] if searchers > 1 else []
    out, _ = grid_run(tmp_path_factory, tiny_model, ["--lag", str(lag), *two], 8)
    rows = train_rows(out)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert_exact(rows, lag)
    assert rows[-1]["samples"] >= 8 * 4 * 4 and rows[-1]["reuse"] <= 1.0 + 1e-9  # each trajectory used once
    if lag == 0:
        assert all(r["wait"] > 0 for r in rows), [r["wait"] for r in rows]
    assert [r["version"] for r in metrics(out) if r["kind"] == "eval"] == [0, 2, 4, 6, 8]


@pytest.mark.engine
def test_two_trainer_ranks(tiny_model, tmp_path_factory):
    """test_e2e's run of two ranks at --lag 1."""
    from test_e2e import two_ranks_run
    assert_exact(train_rows(two_ranks_run(tmp_path_factory, tiny_model)), 1)


@pytest.mark.engine
def test_a_resumed_run_keeps_the_lag_and_learns_the_same(tiny_model, tmp_path):
    """6 steps straight and 3 + 3 resumed at L = 2 with one searcher: the same staleness, and the same weights
    (the checkpoint keeps the last L steps' weights, from which the resumed searcher's rounds are sampled,
    each from the same prompts and seeds)."""
    from safetensors.torch import load_file
    flags = ["--model", tiny_model, *SMALL, "--searchers", "1", "--lag", "2", "--eval-every", "0"]
    p = run_tba([*flags, "--steps", "6", "--out", str(tmp_path / "straight")], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:]
    p = run_tba([*flags, "--steps", "3", "--save-every", "3", "--out", str(tmp_path / "a")], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:]
    state = torch.load(tmp_path / "a" / "checkpoint" / "trainer.pt", weights_only=True)
    assert sorted(state["history"]) == [1, 2, 3]  # the weights the rounds of steps 3, 4, 5 need, and step 3's
    p = run_tba([*flags, "--steps", "6", "--resume", str(tmp_path / "a" / "checkpoint")], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:]
    assert_exact(train_rows(tmp_path / "a"), 2)
    # no round twice: the checkpoint keeps none of the steps to come, which the resumed searcher makes again. A row
    # counts the rounds taken before its step: those of steps 1..s, and any of the L - 1 after it made already
    # (their weights were out: which, is the searcher's race with the trainer); 6 rounds of 16 at the end
    straight_rows, resumed_rows = train_rows(tmp_path / "straight"), train_rows(tmp_path / "a")
    for rows in (straight_rows, resumed_rows):
        assert all(16 * s <= r["samples"] <= 16 * min(s + 1, 6) for s, r in enumerate(rows, 1)), rows
        assert rows[-1]["samples"] == 96
    assert resumed_rows[-1]["reuse"] == pytest.approx(straight_rows[-1]["reuse"])  # each trajectory drawn once
    straight = load_file(tmp_path / "straight" / "final" / "model.safetensors")
    resumed = load_file(tmp_path / "a" / "final" / "model.safetensors")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


@pytest.mark.engine
def test_a_reset_publishes_the_lagged_policy_and_the_current_pi_ref(tiny_model, tmp_path):
    """TBA′ with --lag: at a reset (every 3 steps) pi_ref becomes the current weights at once, while the policy
    the searchers sample with stays L behind; no round is lost to the reset (each group is one round's)."""
    out = tmp_path / "run"
    p = run_tba(["--model", tiny_model, *SMALL, "--searchers", "1", "--lag", "2", "--ref-reset-every", "3",
                 "--steps", "4", "--save-every", "4", "--eval-every", "0", "--out", str(out)], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:]
    rows = train_rows(out)
    assert_exact(rows, 2)
    assert [r["reference"] for r in rows] == [0, 0, 3, 3]
    # each batch scored under the pi_ref of its step (the reset's, from the batch after it on)
    assert [r["batch_reference"] for r in rows] == [0, 0, 0, 3]
    state = torch.load(out / "checkpoint" / "trainer.pt", weights_only=True)
    assert state["pi_ref_version"] == 3 and state["synced_version"] <= 4 - 2 + 1  # pi_ref: now; policy: L behind
    assert sorted(state["history"]) == [2, 3, 4]


@pytest.mark.engine
def test_the_synchronous_baseline_in_one_process_has_the_lag_too(tiny_model, tmp_path_factory):
    from test_e2e import synchronous_lag_run
    assert_exact(train_rows(synchronous_lag_run(tmp_path_factory, tiny_model)), 3)


@pytest.mark.engine
@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_killed_or_stopped_searcher_ends_the_run_in_one_line(tiny_model, tmp_path, how):
    """Killed: the run stops within seconds naming it; stopped (SIGSTOP): once it has sent nothing for
    --timeout, after a checkpoint. No hang either way, nothing left behind."""
    out = tmp_path / "run"
    proc = start(["--model", tiny_model, *SMALL, "--searchers", "1", "--lag", "1", "--steps", "100000",
                  "--eval-every", "0", "--timeout", "20", "--out", str(out)], tmp_path)
    try:
        wait_for_steps(proc, out, 3)
        pids = searcher_pids(proc.pid)
        os.kill(pids[0], signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [line for line in output.splitlines() if line.startswith("tba.py: error")]
    assert proc.returncode == 1 and len(lines) == 1, output[-3000:]
    if how == "killed":  # the trainer lives: it keeps its progress
        assert re.fullmatch(r"tba.py: error: searcher 0 \(pid \d+\) died with exit code -9; checkpoint in .*", lines[0]), lines
    else:
        assert "has sent nothing for" in lines[0] and "checkpoint in" in lines[0], lines
    assert_checkpoint(out)
    assert_all_gone(pids)  # the stopped searcher too: killed as the run stopped


@pytest.mark.engine
def test_a_seeded_lag_with_resets_is_the_same_twice(tiny_model, tmp_path):
    """TBA′ at --lag 2, pi_ref reset every 4 steps, two searchers: every batch scored under the pi_ref of its step
    (each round waits for it before scoring), so two runs of one seed give the same rows."""
    rows = []
    for run in ("a", "b"):
        p = run_tba(["--model", tiny_model, *SMALL, "--searchers", "2", "--lag", "2", "--ref-reset-every", "4",
                     "--steps", "9", "--eval-every", "0", "--seed", "5", "--out", str(tmp_path / run)], tmp_path)
        assert p.returncode == 0, p.stdout[-3000:]
        rows.append(train_rows(tmp_path / run))
    keys = ("step", "loss", "reward", "log_z", "staleness", "reference", "batch_reference")
    assert [[r[k] for k in keys] for r in rows[0]] == [[r[k] for k in keys] for r in rows[1]]
    # the batch of step s is scored under the reset at or before s (rows count steps from 1)
    assert [r["batch_reference"] for r in rows[0]] == [(r["step"] - 1) // 4 * 4 for r in rows[0]]


@pytest.mark.engine
def test_the_trainer_recomputes_the_behaviour_log_probs_with_the_lagged_weights(tiny_model, tmp_path):
    """--behaviour-logprobs trainer (the authors'): each batch rescored by the trainer's copy at the weights of step
    s - L. They sampled it, so on the CPU in float32 the trainer's log-probs equal vLLM's (any other step's weights
    would differ: lr 1e-3 moves them); the same after a resume, whose copy is rebuilt from the checkpoint's history."""
    flags = ["--model", tiny_model, *SMALL, "--searchers", "1", "--lag", "2", "--loss", "drgrpo",
             "--behaviour-logprobs", "trainer", "--eval-every", "0"]
    out = tmp_path / "run"
    p = run_tba([*flags, "--steps", "4", "--save-every", "4", "--out", str(out)], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:]
    p = run_tba([*flags, "--steps", "7", "--resume", str(out / "checkpoint")], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:]
    rows = train_rows(out)
    assert [r["step"] for r in rows] == list(range(1, 8))
    assert all(r["behaviour_gap"] < 1e-4 for r in rows), [r["behaviour_gap"] for r in rows]
