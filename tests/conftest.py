"""Shared fixtures: tiny models made here (no downloads) and a runner for `tba.py` as a subprocess."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
DATA = os.path.join(ROOT, "tests", "data", "gsm8k")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The `tiny` model's shape (0.65M parameters, character tokenizer) with room for GSM8K prompts,
    warm-started (about 15 s) until about 20% of arith answers are right: rewards vary, so training
    has a signal (with all rewards 0 and the policy equal to pi_ref, the TB gradient is exactly zero).
    Smaller models plateau below 10% here, too rarely right for runs of 4 prompts x 4 samples."""
    import tiny
    path = str(tmp_path_factory.mktemp("tiny") / "model")
    r = tiny.RECIPE
    model, tokenizer = tiny.make_model(path, r["hidden"], r["layers"], r["heads"], r["ffn"], max_len=1024)  # GSM8K fits
    done = tiny.warm_start(model, tokenizer, steps=600, batch=64, lr=r["sft_lr"], seed=0, target=0.2)
    model.save_pretrained(path)
    with open(os.path.join(path, "warm_start.json"), "w") as f:  # for tests/test_tiny.py
        json.dump(done, f)
    return path


def env(tmp):
    e = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TBA_CACHE=str(tmp / "cache"))
    e.pop("RANK", None)
    return e


def run_tba(args, tmp, timeout=300, torchrun=None):
    """Run tba.py to completion; returns the CompletedProcess (stdout and stderr together)."""
    cmd = [sys.executable, os.path.join(ROOT, "tba.py"), *args]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={torchrun}", *cmd[1:]]
    return subprocess.run(cmd, cwd=str(tmp), env=env(tmp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]
