"""tools/memory.py at a small size: the formula for the trainer's peak, fitted on two depths of a
model of rho-math-1b's layer width, predicts the peak measured on a third (bytes, not time), and
activation checkpointing keeps less for the backward pass."""

import os
import re
import subprocess
import sys

from conftest import ROOT, env


def test_the_formula_predicts_the_measured_peak(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "memory.py"), "--layers", "1", "2", "3",
                        "--K", "2", "--prompt", "24", "--response", "16", "--vocab", "1024"],
                       cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = re.findall(r"(with|without) activation checkpointing: kept for the backward pass ([\d.]+) KB a token a "
                      r"layer .*? peak by the formula (\d+) MiB, measured (\d+) MiB \(([-+][\d.]+)%\)", p.stdout)
    assert [r[0] for r in rows] == ["without", "with"], p.stdout
    for how, kept, predicted, measured, error in rows:
        assert abs(float(error)) < 15, p.stdout  # the formula within 15% of the measured peak
    assert float(rows[1][1]) < float(rows[0][1]), p.stdout  # recomputation keeps less a token a layer
    qwen = dict(re.findall(r"Qwen2.5-7B, .*?, rank (\d)(?: and up)?: about (\d+) GB", p.stdout))
    assert set(qwen) == {"0", "1"}, p.stdout  # run_math.sh's trainer: rank 0 holds the shared bf16 copy too
    assert 14 <= int(qwen["0"]) - int(qwen["1"]) <= 16, p.stdout  # its 15.2 GB
    assert int(qwen["1"]) >= 31, p.stdout  # at least the shard of weights, gradients and AdamW: 16 x 7.62e9 / 4 bytes
