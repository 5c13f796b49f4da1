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
    """A randomly initialised 2-layer Llama with the character tokenizer (about 0.1M parameters)."""
    import tiny
    path = str(tmp_path_factory.mktemp("tiny") / "model")
    tiny.make_model(path, hidden=64, layers=2, heads=2)
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
