"""tba.py end to end as a subprocess, with the real vLLM CPU engine and tiny models made here."""

import json
import os

import numpy as np

import pytest

from conftest import DATA, SMALL, TLDR, metrics, run_tba, shared_run
from rewards import gsm8k_reward
from runtime.log import Log

TRAIN_FIELDS = {"kind": str, "step": int, "time": float, "loss": float, "reward": float,
                "beta": float, "lr": float, "staleness": float, "staleness_max": int, "wait": float,
                "samples": int, "reference": int, "reuse": float}
LOSS_FIELDS = {"tb": ["log_z"], "rloo": ["kl"], "grpo": ["clip_frac", "kl"]}  # each loss's own statistics
EVAL_FIELDS = {"kind": str, "step": int, "time": float, "accuracy": float, "version": int}


def check_rows(rows, steps, batch=4 * 4, loss="tb"):
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    for r in train:
        for k, t in {**TRAIN_FIELDS, **{k: float for k in LOSS_FIELDS[loss]}}.items():
            assert isinstance(r[k], t) or (t is float and isinstance(r[k], int)), (k, r)
        assert np.isfinite(r["loss"]) and 0 <= r["reward"] <= 1 and r["wait"] >= 0
        assert 0 <= r["staleness"] <= r["staleness_max"] <= r["step"] - 1
        assert not set(r) - {"loss", *LOSS_FIELDS[loss], *Log.FIELDS}, set(r) - set(Log.FIELDS)  # its one list
    assert train[-1]["samples"] >= batch  # at least one batch of B x K arrived
    for r in evals:
        for k, t in EVAL_FIELDS.items():
            assert isinstance(r[k], t) or (t is float and isinstance(r[k], int)), (k, r)
        assert 0 <= r["accuracy"] <= 1
    assert evals[0]["version"] == 0 and evals[-1]["version"] == steps  # one at the start, one at the end
    return train, evals


def check_final(out, initial):
    from transformers import AutoModelForCausalLM
    final = AutoModelForCausalLM.from_pretrained(os.path.join(out, "final"))
    start = AutoModelForCausalLM.from_pretrained(initial)
    moved = max((a - b).abs().max().item() for a, b in zip(final.parameters(), start.parameters()))
    assert moved > 1e-4  # it trained


def run_small(tiny_model, tmp_path, *args, torchrun=None):
    """A short toy run that must succeed; returns (its output folder, the completed process)."""
    out = tmp_path / "run"
    p = run_tba(["--model", tiny_model, *SMALL, *args, "--out", str(out)], tmp_path, torchrun=torchrun)
    assert p.returncode == 0, p.stdout[-3000:]
    return out, p


@pytest.mark.engine
def test_async_run(tiny_model, tmp_path):
    out, p = run_small(tiny_model, tmp_path, "--steps", "6", "--sync-every", "2", "--eval-every", "3")
    train, evals = check_rows(metrics(out), 6)
    # the final evaluation is searcher 0's: its engine reloaded the step-6 weights (its version moved)
    assert evals[-1]["version"] == 6 and evals[-1]["step"] == 6
    # staleness was measured: data from the initial policy is 2+ steps old by step 3
    assert any(r["staleness_max"] >= 2 for r in train)
    config = json.load(open(out / "config.json"))
    assert config["searchers"] == 1 and config["samples_per_prompt"] == 4 and config["model_path"] == tiny_model
    assert "held-out accuracy" in p.stdout and "done: 6 steps" in p.stdout
    check_final(out, tiny_model)


def capped_slow_run(tmp_path_factory, tiny_model):
    """(its --out, its output) of a streaming run under --max-reuse 1 with generation slowed 20x, made once a
    session (shared_run: test_slowdown reads it too)."""
    return shared_run(tmp_path_factory, "capped-slow", ["--model", tiny_model, *SMALL, "--steps", "6", "--eval-every",
                                                        "0", "--max-reuse", "1", "--generation-slowdown", "20"])


@pytest.mark.engine
def test_the_trainer_waits_for_data_under_the_reuse_cap(tiny_model, tmp_path_factory):
    """--max-reuse 1 with generation slowed (the trainer outpaces the searcher): it waits for data
    after the first step instead of replaying, and never draws more than it has received; the
    summary line gives the draws per trajectory."""
    out, stdout = capped_slow_run(tmp_path_factory, tiny_model)
    train, _ = check_rows(metrics(out), 6)
    B_K = 4 * 4
    for r in train:  # each step drew B x K, and the draws stayed within the trajectories received
        assert r["reuse"] == pytest.approx(r["step"] * B_K / r["samples"]) and r["reuse"] <= 1 + 1e-9
    assert sum(r["wait"] > 0.05 for r in train[1:]) >= 3, train  # it waited for data, step after step
    assert f"| {train[-1]['reuse']:.2f} draws a trajectory |" in stdout


def test_synchronous_run(tiny_model, logged_run):
    out, _ = logged_run  # conftest's: --searchers 0 --steps 5 --eval-every 2
    train, evals = check_rows(metrics(out), 5)
    assert all(r["wait"] == 0 for r in train)
    assert [e["version"] for e in evals] == [0, 2, 4, 5]
    check_final(out, tiny_model)


def two_ranks_run(tmp_path_factory, tiny_model):
    """The --out of a run of two trainer ranks and one searcher at --lag 1 with the RLOO baseline and TBA′ resets
    every 2 steps, made once a session (shared_run: test_lag reads it too)."""
    return shared_run(tmp_path_factory, "two-ranks", ["--model", tiny_model, *SMALL, "--steps", "6", "--eval-every",
                                                      "0", "--lag", "1", "--loss", "rloo", "--ref-reset-every", "2"],
                      torchrun=2)[0]


@pytest.mark.engine
def test_fsdp_two_ranks(tiny_model, tmp_path_factory):
    """torchrun --nproc_per_node=2: FSDP2 over two trainer ranks (gloo), one searcher at --lag 1; with the RLOO
    baseline and TBA′ resets of pi_ref every 2 steps."""
    out = two_ranks_run(tmp_path_factory, tiny_model)
    train, _ = check_rows(metrics(out), 6, loss="rloo")
    assert json.load(open(out / "config.json"))["threads"] >= 1
    assert [r["reference"] for r in train] == [0, 2, 2, 4, 4, 6]
    check_final(out, tiny_model)


def synchronous_lag_run(tmp_path_factory, tiny_model):
    """The --out of a synchronous run at --lag 3 with the GRPO baseline, made once a session (test_lag reads it)."""
    return shared_run(tmp_path_factory, "sync-lag", ["--model", tiny_model, *SMALL, "--searchers", "0", "--steps", "7",
                                                     "--eval-every", "0", "--lag", "3", "--loss", "grpo"])[0]


@pytest.mark.engine
def test_synchronous_lag_sets_the_staleness(tiny_model, tmp_path_factory):
    """--lag L in the synchronous mode (k = 1; each batch its step's rounds): every batch is exactly L steps stale
    once the run is L steps in (the initial weights until then); with the GRPO baseline."""
    out = synchronous_lag_run(tmp_path_factory, tiny_model)
    train, _ = check_rows(metrics(out), 7, loss="grpo")
    assert [r["staleness"] for r in train] == [0, 1, 2, 3, 3, 3, 3]
    assert all(r["staleness_max"] == r["staleness"] for r in train)
    check_final(out, tiny_model)


TLDR_SMALL = ["--task", "tldr", "--data", TLDR, "--prompts-per-step", "4", "--samples-per-prompt", "4",
              "--max-new-tokens", "12", "--lr", "1e-3"]


def check_tldr(out, steps, initial=0):
    rows = metrics(out)
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert train[0]["samples"] >= max(initial, 16)  # the first step came after the initial buffer
    for e in evals:
        assert 0 <= e["win_rate"] <= 1 and np.isfinite(e["score"]) and e["kl_ref_theta_per_token"] >= 0
        assert 1 <= e["ppl_sft_authors"] <= e["ppl_sft"] and "accuracy" not in e
    assert abs(evals[0]["kl_ref_theta_per_token"]) < 1e-6  # the policy is pi_ref at step 0
    assert evals[-1]["kl_ref_theta_per_token"] > 1e-4      # and has moved at the end
    assert evals[-1]["version"] == steps
    return train, evals


@pytest.mark.engine
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_gpt_neox_tldr_with_a_reward_model(mode, tiny_neox, tiny_rm, tmp_path):
    """A Pythia-shaped policy (GPT-NeoX, through vLLM's Transformers backend, BPE tokens) trained on
    TL;DR-format prompts against a GPT-NeoX reward model, in both modes, with an initial buffer."""
    out = tmp_path / "run"
    p = run_tba(["--model", tiny_neox, "--reward-model", tiny_rm, *TLDR_SMALL, "--steps", "3", "--eval-every", "2",
                 "--initial-buffer", "40", "--searchers", "1" if mode == "async" else "0", "--out", str(out)], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:]
    check_tldr(out, 3, initial=40)
    assert "held-out win rate" in p.stdout
    check_final(out, tiny_neox)


@pytest.mark.engine
def test_tldr_under_torchrun_with_two_ranks(tiny_model, tiny_rm, tmp_path):
    """The Llama-shaped tiny policy (character tokens) with the GPT-NeoX reward model (BPE tokens: the
    text is tokenized again), two FSDP2 ranks, the GRPO baseline."""
    out, _ = run_small(tiny_model, tmp_path, "--reward-model", tiny_rm, *TLDR_SMALL, "--steps", "3",
                       "--eval-every", "0", "--loss", "grpo", "--non-eos-penalty", torchrun=2)
    check_tldr(out, 3)
    check_final(out, tiny_model)


@pytest.mark.engine
def test_gsm8k_task(tiny_model, tmp_path):
    """GSM8K on the CPU with a tiny model: accuracy is about 0; prompts, rewards and eval rows are checked."""
    out = tmp_path / "run"
    p = run_tba(["--model", tiny_model, "--task", "gsm8k", "--data", DATA, "--steps", "2", "--eval-limit", "5",
                 "--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-new-tokens", "16",
                 "--temperature", "0.7", "--out", str(out)], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:]
    rows = metrics(out)
    train, evals = check_rows(rows, 2, batch=2 * 2)
    test = [json.loads(line) for line in open(os.path.join(DATA, "test.jsonl"))]
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)  # characters outside its vocabulary drop out
    prompt = f"[MATH TASK] Problem:\n{test[0]['question']}\n\nSolution:\n"
    for e in evals:
        example = e["example"]
        assert example["prompt"] == tokenizer.decode(tokenizer(prompt).input_ids, skip_special_tokens=True)
        assert example["accuracy"] == gsm8k_reward(example["completion"], test[0]["answer"])  # the metric's value
