"""The tiny model's warm start stops at its accuracy target, and its accuracy check is greedy decoding; its build
shows progress and leaves no temporary folder behind."""

import json
import os
import time

import pytest
import torch

from runtime import tiny
from tasks.arith import splits as arith_splits


def test_warm_start_stops_at_target(tiny_model):
    done = json.load(open(os.path.join(tiny_model, "warm_start.json")))  # conftest: at most 600 steps, target 0.2
    assert done["sft_check_accuracy"] >= 0.2
    assert done["sft_steps_taken"] < 600  # stopped early, at its first check at or above the target


def test_greedy_accuracy_is_transformers_greedy_decoding(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    problems = arith_splits()[1][:64]
    ids = torch.tensor([tok(p.prompt).input_ids for p in problems])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=4,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    right = [tok.decode(row[ids.shape[1]:], skip_special_tokens=True) == p.answer for row, p in zip(out, problems)]
    assert 0 < sum(right) < len(problems)  # a check that can tell right from wrong
    assert tiny.greedy_accuracy(model, tok, problems) == sum(right) / len(problems)


def test_a_build_shows_progress_and_leaves_nothing_when_stopped(tmp_path, monkeypatch, capsys):
    """A line every few seconds (here: every step) with the warm start's step and check accuracy; a build stopped
    (Ctrl-C, an error) removes its temporary folder; a complete one is renamed into place."""
    recipe = dict(tiny.RECIPE, sft_max_steps=3, sft_check=16, sft_batch=8)
    tiny.build(str(tmp_path / "built"), recipe, every=0)
    lines = capsys.readouterr().out.splitlines()
    assert [line.rsplit(",", 1)[0] for line in lines] == [
        f"  warm start: step {s} (at most 3), check accuracy 0.000 (stops at 0.35)" for s in (1, 2, 3)]
    assert json.load(open(tmp_path / "built" / "tiny_recipe.json"))["sft_steps_taken"] == 3
    assert [p.name for p in tmp_path.iterdir()] == ["built"]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(tiny, "warm_start", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tiny.build(str(tmp_path / "stopped"), recipe)
    assert [p.name for p in tmp_path.iterdir()] == ["built"]


def test_the_next_build_removes_what_killed_builds_left(tmp_path, monkeypatch):
    """A build killed outright (SIGKILL: no cleanup runs) leaves its .tiny-* folder; the next build, under the lock,
    removes those made before it took the lock, and nothing else."""
    root = tmp_path / "cache"
    root.mkdir()
    stale, other = root / ".tiny-dead1234", root / "tiny-000000000000"
    stale.mkdir()
    other.mkdir()
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    built = []

    def build(out, *args, **kwargs):
        built.append(out)
        os.makedirs(out)
        open(os.path.join(out, "tiny_recipe.json"), "w").write("{}")
        return out
    monkeypatch.setattr(tiny, "build", build)
    monkeypatch.setenv("TBA_CACHE", str(root))
    path = tiny.cached()
    assert built == [path] and not stale.exists() and other.is_dir()
    assert tiny.cached() == path and built == [path]  # cached: no second build
