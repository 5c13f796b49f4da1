"""tools/sft_attacker.py: Lee et al.'s SFT of the red-teaming attacker (their prior), on a tiny attacker and a
small instruction set made here (tests/redteam_models.py): the examples, the schedule, a run that learns
the instructions, and refusals in one line."""

import json
import os
import subprocess
import sys

import pytest
import torch

import redteam_models as rm
import sft_attacker as sft
from conftest import ROOT, env

TOOL = os.path.join(ROOT, "tools", "sft_attacker.py")


def run_tool(args, tmp_path, timeout=600):
    return subprocess.run([sys.executable, TOOL, *map(str, args)], cwd=str(tmp_path), env=env(tmp_path),
                          capture_output=True, text=True, timeout=timeout)


def test_examples_train_on_the_instruction_and_eos_only():
    tok = rm.bpe()
    ids, mask = sft.example(tok, "List:\n1.", "Tell me the way home.")
    learned = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(learned) == " Tell me the way home." + tok.eos_token and ids[-1] == tok.eos_token_id
    assert ids[:mask.index(1)] == tok("List:\n1.").input_ids  # the prompt's own tokens: no loss


def test_schedule_and_split_are_theirs():
    # get_linear_schedule_with_warmup(opt, 100, 100), stepped after each update: a warmup over the whole run
    assert [sft.lr_at(s, 3e-5, 100, 100) for s in (0, 1, 50, 99)] == pytest.approx([0, 3e-7, 1.5e-5, 2.97e-5])
    assert sft.lr_at(150, 1.0, 100, 200) == pytest.approx(0.5) and sft.lr_at(200, 1.0, 100, 200) == 0.0
    train, held = sft.split([f"i{k}" for k in range(30)])
    assert len(held) == 3 and sorted(train + held) == sorted(f"i{k}" for k in range(30))
    assert (train, held) == sft.split([f"i{k}" for k in range(30)])  # seed 42, as their dataset.py


def test_weight_decay_spares_biases_and_layer_norms(tmp_path):
    from transformers import AutoModelForCausalLM
    path = rm.make_attacker(str(tmp_path / "gpt2"), "gpt2")
    names = sft.decay_names(AutoModelForCausalLM.from_pretrained(path))
    assert "transformer.h.0.attn.c_attn.weight" in names and "transformer.wte.weight" in names
    assert not [n for n in names if "bias" in n or ".ln_" in n]


def nll(path, instructions):
    """Mean NLL per learned token of the instructions after redteam.py's prompt, under the model at `path`."""
    from tasks.redteam import ATTACK_PROMPT
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    rows = [sft.example(tok, ATTACK_PROMPT, x["instruction"]) for x in instructions]
    with torch.no_grad():
        return sft.loss_of(model, rows, tok.pad_token_id, "cpu").item()


@pytest.mark.engine
def test_sft_learns_the_instructions(tmp_path):
    data = rm.instructions(60)
    (tmp_path / "sft.json").write_text(json.dumps(data))
    attacker = rm.make_attacker(str(tmp_path / "attacker"), "llama")
    out = tmp_path / "sft"
    p = run_tool(["sft.json", "--model", attacker, "--out", out, "--steps", "60", "--batch", "16", "--grad-acc", "2",
                  "--lr", "3e-3", "--warmup", "3"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "step   60/60 | train loss" in p.stdout and "validation loss" in p.stdout
    before, after = nll(attacker, data), nll(str(out), data)
    assert after < 0.5 * before, (before, after)  # measured: 6.29 -> 1.72 nats a token


@pytest.mark.engine
def test_bad_input_is_refused_in_one_line(tmp_path):
    (tmp_path / "bad.json").write_text('[{"instruction": "ok"}, {"text": "no instruction"}]')
    (tmp_path / "broken.json").write_text("[{")
    (tmp_path / "ok.json").write_text(json.dumps(rm.instructions(5)))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    for args, says in [(["missing.json", "--out", "o"], "DATA: cannot read missing.json"),
                       (["broken.json", "--out", "o"], "not valid JSON"),
                       (["bad.json", "--out", "o"], "item 1: no text field 'instruction'"),
                       (["ok.json", "--out", "full"], "--out: full exists and is not empty"),
                       (["ok.json", "--out", "o", "--steps", "0"], "--steps: must be at least 1"),
                       (["ok.json", "--out", "o", "--model", str(tmp_path / "nothing")], "--model:")]:
        p = run_tool(args, tmp_path, timeout=120)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and says in lines[0], (args, p.stderr)
