"""bench.py part 8 (TRL's GRPOTrainer, trl_grpo.py): its evaluation is tba.py's, it skips in one line
without TRL, and, where a TRL environment exists ($TBA_TRL_PYTHON or ~/.cache/tba/trl-venv), a short
run writes the rows bench.py reads."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, env


@pytest.mark.engine
def test_greedy_accuracy_is_the_searchers(tiny_model, tmp_path):
    """trl_grpo.greedy_accuracy (transformers, one batch) gives what searcher.Engine.evaluate (vLLM,
    temperature 0, stop at EOS, arith_reward) gives, on the 400 held-out problems; also for perturbed
    weights, whose answers run on without EOS or carry stray characters."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import trl_grpo
    from searcher import Engine
    from tasks.arith import splits as arith_splits
    from test_weight_sync import config

    _, test = arith_splits()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    noisy = str(tmp_path / "noisy")
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.save_pretrained(noisy)
    tok.save_pretrained(noisy)
    prompts = [tok(p.prompt).input_ids for p in test]
    for path in (tiny_model, noisy):
        cfg = config(path, max_new_tokens=8)
        engine = Engine(cfg, "cpu", 0.1, prompts, [p.answer for p in test])
        expected = engine.evaluate(prompts, [p.answer for p in test])[0]["accuracy"]
        engine.close()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        accuracy, example = trl_grpo.greedy_accuracy(model, tok, test, 8)
        assert accuracy == expected, (path, accuracy, expected)
        assert example["prompt"] == test[0].prompt


def test_reached_tolerates_float_sums():
    import bench
    curve = [(1.0, 0, 0.24), (2.0, 10, 0.3), (3.0, 20, 0.39), (4.0, 30, 0.49)]
    assert bench.reached(curve, 0.24 + 0.15) == (3.0, 20)  # 0.24 + 0.15 = 0.39000000000000001
    assert bench.reached(curve, 0.24 + 0.25) == (4.0, 30)
    assert bench.reached(curve, 0.6) == (None, None)
    assert bench.reached([(1.0, 0, 0.0), (2.0, 10, 0.0)], 0.0) == (2.0, 10)  # never the start itself


@pytest.mark.engine
def test_part8_skips_in_one_line(tiny_model, tmp_path):
    out = tmp_path / "bench"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench.py"), "--parts", "8", "--quick",
                        "--trl-python", str(tmp_path / "no-such-python"), "--out", str(out), "--", "--model", tiny_model],
                       cwd=tmp_path, env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:]
    assert "8. TRL GRPOTrainer: skipped: --trl-python" in p.stdout
    assert json.load(open(out / "bench.json"))["trl"].keys() == {"note"}
    assert not list(out.glob("seed*")), "tba.py's side of a skipped part 8 was run"


def trl_python():
    for python in (os.environ.get("TBA_TRL_PYTHON"), os.path.expanduser("~/.cache/tba/trl-venv/bin/python")):
        if python and os.path.exists(python) and subprocess.run(
                [python, "-c", "from trl import GRPOTrainer"], capture_output=True).returncode == 0:
            return python
    pytest.skip("no TRL environment ($TBA_TRL_PYTHON or ~/.cache/tba/trl-venv; bench.py --parts 8 makes one)")


@pytest.mark.engine
def test_trl_grpo_short_run(tiny_model, tmp_path):
    python, out = trl_python(), tmp_path / "trl"
    p = subprocess.run([python, os.path.join(ROOT, "tools", "trl_grpo.py"), "--model", tiny_model, "--out", str(out),
                        "--steps", "4", "--eval-every", "2", "--eval-limit", "40", "--prompts-per-step", "4"],
                       cwd=tmp_path, env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    evals, train = [r for r in rows if r["kind"] == "eval"], [r for r in rows if r["kind"] == "train"]
    assert [e["step"] for e in evals] == [0, 2, 4] and [t["step"] for t in train] == [1, 2, 3, 4]
    assert all(0 <= e["accuracy"] <= 1 and e["seconds"] > 0 for e in evals)
    times = [r["time"] for r in sorted(rows, key=lambda r: (r["step"], r["kind"] == "eval"))]
    assert times == sorted(times) and times[0] > 0
    assert all(0 < t["generate"] < t["seconds"] and 0 <= t["reward"] <= 1 for t in train)
    assert evals[2]["overhead"] == pytest.approx(sum(e["seconds"] for e in evals[:2]))
    config = json.load(open(out / "config.json"))
    assert config["versions"]["trl"].startswith("1.") and config["grpo"]["num_generations"] == 8
    assert config["grpo"]["per_device_train_batch_size"] == 32 and config["grpo"]["beta"] == 0.0
