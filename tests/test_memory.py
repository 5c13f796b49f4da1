"""tools/memory.py at a small size: the formula for the trainer's peak, fitted on two depths of a
model of rho-math-1b's layer shape narrowed 4x (bf16 products on a CPU without AVX-512 are slow), predicts
the peak measured on a third (bytes, not time), and activation checkpointing keeps less for the backward pass; the
plan it prints from the fit has each term (tests/test_memory_plan.py checks the counting without measuring)."""

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
    qwen = {(loss, rank): (int(gb), int(more)) for loss, rank, gb, more in re.findall(
        r"Qwen2.5-7B, run_math.sh's trainer, LOSS=(\w+) .*?, rank (\d)(?: and up)?: about (\d+) GB of 80 .*?with "
        r"--behaviour-logprobs trainer about (\d+) GB", p.stdout)}
    assert set(qwen) == {(loss, rank) for loss in ("tb", "drgrpo") for rank in "01"}, p.stdout
    # rank 0: the shared bf16 copy (15.2 GB) and 4 searchers' CUDA contexts (2 GB); TBA′ also pi_ref's copy
    assert 16 <= qwen["drgrpo", "0"][0] - qwen["drgrpo", "1"][0] <= 18, p.stdout
    assert 31 <= qwen["tb", "0"][0] - qwen["tb", "1"][0] <= 33, p.stdout
    # at least weights, gradients, AdamW (16 x 7.62e9 / 4) and the end of the backward pass (6 x 1.09e9)
    assert qwen["tb", "1"][0] == qwen["drgrpo", "1"][0] >= 37, p.stdout
    for gb, more in qwen.values():  # --behaviour-logprobs trainer: its copy's bf16 shard, 3.8 GB
        assert 3 <= more - gb <= 5, p.stdout
    # with --micro-batch 1 the statistics pass holds one sequence's logits, not a group's 16 (19.9 GB)
    assert re.search(r"the statistics pass's logits and chunk 1\.5;", p.stdout), p.stdout
    # the root unit's reduce-scatter: its bf16 gradients beside the float32 input, 6 x 1.09e9
    assert re.search(r"the end of the backward pass 6\.5,", p.stdout), p.stdout
    host = {lag: (float(ring), float(old), float(mine)) for lag, ring, old, mine in re.findall(
        r"--lag (\d+): rank 0's host RAM .*?: ([\d.]+) GB pinned \(.*?registered host memory: exact; one block a "
        r"tensor .*?would take ([\d.]+)\); --behaviour-logprobs trainer adds on each rank \d+ slots of its bf16 "
        r"shards, ([\d.]+) GB", p.stdout)}
    # (L + 1) x 15.2 GB exact, x 29 GB a block a tensor before; --behaviour-logprobs trainer's (L + 1) x 3.8 GB
    assert host == {"2": (45.7, 86.9, 11.4), "10": (167.5, 318.5, 41.9)}, p.stdout
    rho = re.findall(r"rho-math-1b, .*?--evaluator after: its engine 16\.0 more .*?, (\d+) GB, and 7 snapshots on the "
                     r"host, 15\.4 GB", p.stdout)
    assert len(rho) == 2, p.stdout
    assert "--evaluator after: refused with run_math.sh's 4 trainer ranks" in p.stdout
