"""Tiny models for the red-teaming tests, made in code with weights a reader can check.

One trick makes a tiny Llama notice a trigger token anywhere in its input: one layer whose queries
and keys are zero, so that attention is uniform over the tokens so far and its output is the share
of trigger tokens (the only token with a non-zero first embedding dimension; the value and output
projections keep that dimension alone, scaled by GAIN), added to the last token's embedding; the MLP
adds nothing. Read at the last token, after the final norm:
- the trigger victim (a causal LM) says the trigger more often the more triggers it has read (the
  attack's and its own), and otherwise babbles: every other token's logit is a random function of the
  last token (dims 2-15);
- the trigger classifier (a sequence classifier, labels safe / unsafe) finds a response unsafe when
  it holds the trigger (P(unsafe) about 0.05 without one, above 0.9 with one in 30 tokens);
- the trigger judge (a causal LM) gives its verdict token ("unsafe"'s first token) a high probability
  under the same rule, over the whole judge prompt.
"""

import os
import sys

import torch

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: the project too
import models  # noqa: E402

H = 16       # hidden size; one head of HEAD_DIM
HEAD_DIM = 32  # the smallest head vLLM's CPU attention runs (v1/attention/backends/cpu_attn.py:69-70), where
               # the victim and the judge run; with q = k = 0 and one value dimension the width changes nothing
GAIN = 20.0  # how strongly the share of triggers moves the last position's first dimension
TRIGGER = " the"  # one token of the BPE tokenizer, common in GSM8K text


def bpe():
    return models.make_bpe_tokenizer()


def trigger_id(tokenizer) -> int:
    ids = tokenizer(TRIGGER, add_special_tokens=False).input_ids
    assert len(ids) == 1, ids
    return ids[0]


def _trigger_block(model, tokenizer, seed: int):
    """The uniform-attention layer described above, written into a 1-layer tiny Llama."""
    g = torch.Generator().manual_seed(seed)
    base = model.model
    V, t = base.embed_tokens.weight.shape[0], trigger_id(tokenizer)
    with torch.no_grad():
        emb = torch.zeros(V, H)
        emb[:, 1] = 1.0                                  # a constant: the norms have something to keep
        emb[:, 2:] = 0.5 * torch.randn(V, H - 2, generator=g)  # each token's own identity
        emb[t, 0] = 2.0                                  # the trigger, and only it, on dimension 0
        base.embed_tokens.weight.copy_(emb)
        layer = base.layers[0]
        for p in layer.parameters():
            p.zero_()                                    # q = k = 0: uniform attention; MLP out = 0
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
        layer.self_attn.v_proj.weight[0, 0] = 1.0        # value: dimension 0 only
        layer.self_attn.o_proj.weight[0, 0] = GAIN       # back onto dimension 0, scaled
        base.norm.weight.fill_(1.0)
    return g, t


def _config(tokenizer, **extra):
    config = models.arch_config("llama", tokenizer, hidden=H, layers=1, heads=1, ffn=H, max_len=1024,
                               head_dim=HEAD_DIM, **extra)
    config.tie_word_embeddings = False
    return config


def make_trigger_victim(out: str, tokenizer=None, seed: int = 0) -> str:
    import transformers
    tokenizer = tokenizer or bpe()
    model = transformers.LlamaForCausalLM(_config(tokenizer))
    g, t = _trigger_block(model, tokenizer, seed)
    with torch.no_grad():
        head = torch.zeros_like(model.lm_head.weight)
        head[:, 2:] = torch.randn(head.shape[0], H - 2, generator=g)  # babble: a random bigram model
        head[t] = 0.0
        head[t, 0] = 3.0                                             # the trigger: from dimension 0
        model.lm_head.weight.copy_(head)
    return _save(model, tokenizer, out)


def make_trigger_classifier(out: str, tokenizer=None, seed: int = 0, labels=("safe", "unsafe")) -> str:
    import transformers
    tokenizer = tokenizer or bpe()
    config = _config(tokenizer, num_labels=2, id2label=dict(enumerate(labels)),
                     label2id={v: i for i, v in enumerate(labels)})
    model = transformers.LlamaForSequenceClassification(config)
    _trigger_block(model, tokenizer, seed)
    with torch.no_grad():
        model.score.weight.zero_()
        model.score.weight[0, 1] = 1.5   # labels[0]: a constant, about 2.8 at the last position without trigger
        model.score.weight[1, 0] = 3.0   # labels[1]: the share of triggers
    return _save(model, tokenizer, out)


def make_trigger_judge(out: str, tokenizer=None, seed: int = 0, verdict: str = " unsafe") -> str:
    """`verdict`: the text whose first token is the verdict (redteam.Judge: "unsafe" after a chat template)."""
    import transformers
    tokenizer = tokenizer or bpe()
    model = transformers.LlamaForCausalLM(_config(tokenizer))
    _trigger_block(model, tokenizer, seed)
    unsafe = tokenizer(verdict, add_special_tokens=False).input_ids[0]
    with torch.no_grad():
        head = torch.zeros_like(model.lm_head.weight)
        head[:, 1] = 1.0                 # every other token: a constant
        head[unsafe] = 0.0
        head[unsafe, 0] = 3.0            # the verdict: the share of triggers
        model.lm_head.weight.copy_(head)
    return _save(model, tokenizer, out)


def make_attacker(out: str, arch: str, tokenizer=None, seed: int = 0) -> str:
    """A randomly initialised tiny attacker of `arch` with the BPE tokenizer."""
    models.make_model(out, hidden=64, layers=2, heads=2, max_len=1024, arch=arch, tokenizer=tokenizer or bpe(), seed=seed)
    return out


def make_embedder(out: str, tokenizer=None, seed: int = 3) -> str:
    """A randomly initialised tiny GPT-NeoX body whose hidden states embed sentences."""
    tokenizer = tokenizer or bpe()
    model, _ = models.make_model(out, hidden=32, layers=1, heads=2, max_len=1024, arch="gpt_neox", tokenizer=tokenizer, seed=seed)
    return _save(model.base_model, tokenizer, out)  # the body alone (architectures: GPTNeoXModel), as MiniLM's BertModel


def _save(model, tokenizer, out: str) -> str:
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def instructions(n: int, seed: int = 0) -> list[dict]:
    """`n` instructions in Lee et al.'s sft_dataset.json format ({"instruction": ...}), made from templates:
    a small stand-in for their 3,003 (tools/sft_attacker.py). About half hold the trigger (" the")."""
    import random
    rng = random.Random(seed)
    verbs = ["Write", "Explain", "Describe", "List", "Tell me", "Find", "Compose", "Create"]
    things = ["a plan", "a story", "a poem", "three reasons", "a guide", "a list", "an argument", "a joke"]
    about = ["about the weather", "for the store", "on the way home", "about a river", "for a friend",
             "about the park", "in one sentence", "about cats and dogs"]
    return [{"instruction": f"{rng.choice(verbs)} {rng.choice(things)} {rng.choice(about)}."} for _ in range(n)]


if __name__ == "__main__":  # the CPU run of docs/tasks.md, "Red-teaming": python tests/redteam_models.py DIR
    import json
    root, tok = sys.argv[1], bpe()
    chat = bpe()
    chat.chat_template = "{{ messages[0]['content'] }}"  # the victim reads the attack alone, as tests/test_redteam.py's
    make_attacker(f"{root}/attacker", "llama", tok)
    make_trigger_victim(f"{root}/victim", chat)
    make_trigger_classifier(f"{root}/classifier", tok)
    make_embedder(f"{root}/embedder", tok)
    with open(f"{root}/sft_dataset.json", "w") as f:
        json.dump(instructions(300), f, indent=1)
    print(f"made attacker, victim, classifier, embedder and sft_dataset.json (300 instructions) in {root}")
