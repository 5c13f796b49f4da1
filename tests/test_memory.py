"""tools/memory.py at a small size: the formula for the trainer's peak, fitted on two depths of a
model of rho-math-1b's layer shape narrowed 4x (bf16 products on a CPU without AVX-512 are slow), predicts
the peak measured on a third (bytes, not time), and activation checkpointing keeps less for the backward pass."""

import pytest
import os
import re
import subprocess
import sys

from conftest import ROOT, env


@pytest.mark.engine
def test_the_formula_predicts_the_measured_peak(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "memory.py"), "--layers", "1", "2", "3",
                        "--K", "2", "--prompt", "24", "--response", "16", "--vocab", "1024", "--narrow", "4"],
                       cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = re.findall(r"(with|without) activation checkpointing: kept for the backward pass ([\d.]+) KB a token a "
                      r"layer .*? peak by the formula (\d+) MiB, measured (\d+) MiB \(([-+][\d.]+)%\)", p.stdout)
    assert [r[0] for r in rows] == ["without", "with"], p.stdout
    for how, kept, predicted, measured, error in rows:
        assert abs(float(error)) < 15, p.stdout  # the formula within 15% of the measured peak
    assert float(rows[1][1]) < float(rows[0][1]), p.stdout  # recomputation keeps less a token a layer
    qwen = {(loss, rank): int(gb) for loss, rank, gb in re.findall(
        r"Qwen2.5-7B, run_math.sh's trainer, LOSS=(\w+) .*?, rank (\d)(?: and up)?: about (\d+) GB of 80", p.stdout)}
    assert set(qwen) == {(loss, rank) for loss in ("tb", "drgrpo") for rank in "01"}, p.stdout
    # rank 0: the shared bf16 copy (15.2 GB) and 4 searchers' CUDA contexts (2 GB); TBA′ also pi_ref's copy
    assert 16 <= qwen["drgrpo", "0"] - qwen["drgrpo", "1"] <= 18, p.stdout
    assert 31 <= qwen["tb", "0"] - qwen["tb", "1"] <= 33, p.stdout
    assert qwen["tb", "1"] == qwen["drgrpo", "1"] >= 31, p.stdout  # at least weights, gradients, AdamW: 16 x 7.62e9 / 4
    # with --micro-batch 1 the statistics pass holds one sequence's logits, not a group's 16 (19.9 GB)
    assert re.search(r"the statistics pass 1\.5\)", p.stdout), p.stdout
    host = dict(re.findall(r"--lag (\d+): rank 0's host RAM .*?: (\d+) GB pinned", p.stdout))
    assert host == {"2": "46", "10": "168"}, p.stdout  # (L + 1) x 15.2 GB
