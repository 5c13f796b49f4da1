"""tba.py end to end as a subprocess, with the real vLLM CPU engine and tiny models made here."""

import json
import os

import numpy as np

from conftest import DATA, metrics, run_tba
from rewards import gsm8k_reward

TRAIN_FIELDS = {"kind": str, "step": int, "time": float, "loss": float, "reward": float, "log_z": float,
                "beta": float, "lr": float, "staleness": float, "staleness_max": int, "wait": float,
                "samples": int}
EVAL_FIELDS = {"kind": str, "step": int, "time": float, "accuracy": float, "version": int}
SMALL = ["--prompts-per-step", "4", "--samples-per-prompt", "4", "--max-new-tokens", "6", "--lr", "1e-3"]


def check_rows(rows, steps, batch=4 * 4):
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    for r in train:
        for k, t in TRAIN_FIELDS.items():
            assert isinstance(r[k], t) or (t is float and isinstance(r[k], int)), (k, r)
        assert np.isfinite(r["loss"]) and 0 <= r["reward"] <= 1 and r["wait"] >= 0
        assert 0 <= r["staleness"] <= r["staleness_max"] <= r["step"] - 1
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


def test_synchronous_run(tiny_model, tmp_path):
    out, _ = run_small(tiny_model, tmp_path, "--searchers", "0", "--steps", "4", "--eval-every", "2")
    train, evals = check_rows(metrics(out), 4)
    assert all(r["wait"] == 0 for r in train)
    assert [e["version"] for e in evals] == [0, 2, 4]
    check_final(out, tiny_model)


def test_fsdp_two_ranks(tiny_model, tmp_path):
    """torchrun --nproc_per_node=2: FSDP2 over two trainer ranks (gloo), one searcher."""
    out, _ = run_small(tiny_model, tmp_path, "--steps", "4", "--eval-every", "0", torchrun=2)
    train, _ = check_rows(metrics(out), 4)
    assert json.load(open(out / "config.json"))["threads"] >= 1
    check_final(out, tiny_model)


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
        assert example["reward"] == gsm8k_reward(example["completion"], test[0]["answer"])
