"""The tiny model's warm start stops at its accuracy target, and its accuracy check is greedy decoding."""

import json
import os

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
