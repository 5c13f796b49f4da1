"""--lora-rank (lora.py, with peft): the searchers get the merged weights under the plain model's names,
FSDP2 trains the adapter, and checkpoints resume exactly; on GPT-2 (Conv1D weights, stored (in, out)) and
Llama (Linear, tied embeddings)."""

import json
import os

import pytest
import torch

from runtime import lora
import models
from runtime import tiny
from runtime import weights
from conftest import cached_model, metrics, run_tba
from tasks.arith import splits as arith_splits

SMALL = ["--prompts-per-step", "4", "--samples-per-prompt", "4", "--max-new-tokens", "6", "--lr", "1e-2",
         "--lora-rank", "4", "--lora-alpha", "8", "--weight-decay", "0.01"]
TARGETS = {"gpt2": (".attn.c_attn.",), "llama": (".self_attn.q_proj.", ".self_attn.v_proj.")}  # peft's defaults


@pytest.fixture(scope="session")
def tiny_gpt2():
    """A GPT-2 of the `tiny` model's shape and character tokenizer, warm-started on arith to about 20%
    (about 25 s on an idle core, once: conftest.cached_model): rewards vary, so the adapter has a gradient (B = 0
    at the start: the policy is pi_ref). Its accuracy is checked on 256 problems, not 512: this GPT-2 is checked
    after almost every step (from 10%). At twice the Llama's lr: at the same lr it took 581 steps, not 269."""
    r, tok = tiny.RECIPE, tiny.make_tokenizer()

    def build(path):
        model, _ = models.make_model(path, hidden=r["hidden"], layers=r["layers"], heads=r["heads"], ffn=r["ffn"],
                                     max_len=256, arch="gpt2", tokenizer=tok)
        done = tiny.warm_start(model, tok, steps=600, batch=64, lr=2 * r["sft_lr"], seed=0, target=0.2, check=256)
        model.save_pretrained(path)
        return done
    recipe = "".join(open(f.__file__).read() for f in (tiny, models)) + json.dumps(r, sort_keys=True) + "gpt2 600 64 2lr 0.2 256"
    return cached_model("tiny-gpt2", recipe, build)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_gather_sends_the_merged_model_under_its_own_names(arch, tmp_path):
    """weights.gather of a LoRA model = peft's own merge_and_unload(), name for name (no adapter names, the
    tied LM head once, as the plain model's `aliases`); the checkpoints' merge_state_dict agrees."""
    import copy
    from transformers import AutoModelForCausalLM
    path = str(tmp_path / arch)
    models.make_model(path, hidden=32, layers=2, heads=2, max_len=64, arch=arch, tokenizer=models.make_bpe_tokenizer())
    plain = AutoModelForCausalLM.from_pretrained(path)
    model = lora.wrap(AutoModelForCausalLM.from_pretrained(path), 4, 8, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_()  # B starts at 0: make the update show
    sent = dict(weights.gather(model))
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    assert list(sent) == list(dict(weights.gather(plain)))
    assert weights.aliases(model) == weights.aliases(plain)
    assert all(torch.allclose(sent[n], merged[n], atol=1e-6) for n in sent)
    moved = [n for n in sent if not torch.equal(sent[n], plain.state_dict()[n])]
    assert moved and all(any(t in n for t in TARGETS[arch]) and n.endswith(".weight") for n in moved)
    saved = lora.merge_state_dict(model, model.state_dict())
    assert all(torch.allclose(saved[n], merged[n], atol=1e-6) for n in merged)


def load(folder):
    from safetensors.torch import load_file
    return load_file(os.path.join(folder, "model.safetensors"))


@pytest.mark.engine
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_lora_run_checkpoints_and_resumes_exactly(arch, request, tmp_path):
    """Synchronous, fixed seed: 4 steps straight == 2 steps, a checkpoint, a resume to 4, bit for bit. The
    checkpoint holds the merged model and the adapter; AdamW holds the adapter's parameters only; the
    final model differs from --model only in the target modules."""
    start = request.getfixturevalue("tiny_gpt2" if arch == "gpt2" else "tiny_model")
    common = ["--model", start, "--searchers", "0", "--seed", "3", "--sync-every", "2", "--eval-every", "0",
              "--eval-limit", "20", *SMALL]
    a = run_tba([*common, "--steps", "4", "--out", str(tmp_path / "a")], tmp_path)
    assert a.returncode == 0, a.stdout[-3000:]
    b1 = run_tba([*common, "--steps", "2", "--save-every", "2", "--out", str(tmp_path / "b")], tmp_path)
    assert b1.returncode == 0, b1.stdout[-3000:]
    ckpt = tmp_path / "b" / "checkpoint"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(ckpt / "adapter"))
    state = torch.load(ckpt / "trainer.pt", weights_only=True)
    assert len(state["optimizer"]["state"]) == sum(len(TARGETS[arch]) * 2 for _ in range(3))  # A, B x layers
    b2 = run_tba([*common, "--steps", "4", "--resume", str(ckpt), "--out", str(tmp_path / "b2")], tmp_path)
    assert b2.returncode == 0, b2.stdout[-3000:]
    rows_a = [r for r in metrics(tmp_path / "a") if r["kind"] == "train"]
    rows_b = [r for r in metrics(tmp_path / "b2") if r["kind"] == "train"]
    assert [(r["lr"], r["reward"], r["loss"]) for r in rows_a[2:]] == [(r["lr"], r["reward"], r["loss"]) for r in rows_b]
    wa, wb, w0 = load(tmp_path / "a" / "final"), load(tmp_path / "b2" / "final"), load(start)
    assert wa.keys() == wb.keys() == w0.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    moved = [k for k in wa if not torch.equal(wa[k], w0[k])]
    assert moved and all(any(t in k for t in TARGETS[arch]) for k in moved), moved
    assert max((wa[k] - w0[k]).abs().max().item() for k in moved) > 1e-3  # it trained
    ckpt_model = load(ckpt / "model")
    assert ckpt_model.keys() == w0.keys()  # the merged model, a plain one


@pytest.mark.engine
def test_searchers_get_the_merged_weights(tiny_gpt2, tmp_path):
    """Two trainer ranks (FSDP2 shards the frozen weights and the adapter) and one searcher: searcher 0's
    final evaluation, with the weights it was sent, scores what greedy decoding of the saved merged model
    scores, and that differs from the starting model's (the check can tell them apart)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = tmp_path / "run"
    p = run_tba(["--model", tiny_gpt2, "--searchers", "1", "--steps", "4", "--sync-every", "2", "--eval-every", "0",
                 "--eval-limit", "200", "--seed", "1", *SMALL, "--lr", "3e-2",  # big steps: the answers must move
                 "--out", str(out)], tmp_path, torchrun=2, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:]
    final = [r for r in metrics(out) if r["kind"] == "eval"][-1]
    assert final["version"] == 4
    tok, problems = AutoTokenizer.from_pretrained(tiny_gpt2), arith_splits()[1][:200]
    greedy = lambda path: tiny.greedy_accuracy(AutoModelForCausalLM.from_pretrained(path), tok, problems)
    assert abs(final["accuracy"] - greedy(out / "final")) <= 1 / 200  # one near-tie at most
    assert abs(greedy(out / "final") - greedy(tiny_gpt2)) >= 3 / 200, "the run did not move the greedy answers"
