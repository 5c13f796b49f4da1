"""Untrained tiny models of the architectures users bring (Pythia, Qwen2, GPT-2, Llama), made in code
for the tests: `make_bpe_tokenizer` (a byte-level BPE tokenizer trained here, like the subword
tokenizers of real models), `make_model(..., arch="gpt_neox")` and `make_reward_model` (a sequence
classifier with one output, as the paper's reward model). A Llama comes from tiny.py, which makes the
`tiny` model.
"""

import json
import os

import torch

from runtime import tiny
from tasks.arith import splits as arith_splits


def bpe_texts() -> list[str]:
    """Text to train the BPE tokenizer on: every arith problem with its answer, and the GSM8K
    problems of the test slice (tests/data/gsm8k) in the task's prompt, with their solutions."""
    from tasks.gsm8k import PROMPT as GSM8K_PROMPT

    texts = [p.prompt + p.answer for split in arith_splits() for p in split]
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "gsm8k", "train.jsonl")
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            texts.append(GSM8K_PROMPT.format(question=row["question"]) + row["answer"])
    return texts


def make_bpe_tokenizer(vocab_size=512, texts=None):
    """A byte-level BPE tokenizer (as GPT-2, Pythia and Qwen2 use) trained here on `texts` (default
    `bpe_texts()`), with tiny.SPECIALS for pad, BOS, EOS and unknown; loads in transformers and in vLLM.
    Like those models' tokenizers it adds no BOS or EOS when encoding. Training is deterministic.
    (transformers 5 reads the folder of a qwen2 model with its own Qwen2Tokenizer, which keeps this
    vocabulary and these merges but pre-splits text its own way, one digit a token; vLLM does too.)"""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=tiny.SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # all 256 bytes
    tok.train_from_iterator(texts if texts is not None else bpe_texts(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")


# arch -> the transformers classes of its causal LM and of its sequence classifier (reward model)
CAUSAL_LM = dict(llama="LlamaForCausalLM", gpt_neox="GPTNeoXForCausalLM", gpt2="GPT2LMHeadModel",
                 qwen2="Qwen2ForCausalLM")
SEQ_CLS = dict(llama="LlamaForSequenceClassification", gpt_neox="GPTNeoXForSequenceClassification",
               gpt2="GPT2ForSequenceClassification", qwen2="Qwen2ForSequenceClassification")
ARCHS = tuple(CAUSAL_LM)


def arch_config(arch: str, tokenizer, hidden: int, layers: int, heads: int, ffn: int, max_len: int, **extra):
    """A transformers config of `arch` in the given shape, with the tokenizer's special tokens.
    Llama and Qwen2 tie the LM head to the embeddings; GPT-NeoX does not (as Pythia); GPT-2 does."""
    import transformers

    if arch == "llama":
        return tiny.llama_config(tokenizer, hidden, layers, heads, ffn, max_len, **extra)
    special = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                   eos_token_id=tokenizer.eos_token_id, **extra)
    if arch == "gpt_neox":  # Pythia's layout: parallel residual, rotary on a quarter of each head
        return transformers.GPTNeoXConfig(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=ffn,
            num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=max_len,
            tie_word_embeddings=False, **special)
    if arch == "gpt2":  # no dropout: tests compare log-probs exactly
        return transformers.GPT2Config(
            vocab_size=len(tokenizer), n_embd=hidden, n_inner=ffn, n_layer=layers, n_head=heads,
            n_positions=max_len, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **special)
    if arch == "qwen2":
        return transformers.Qwen2Config(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=ffn,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
            max_position_embeddings=max_len, tie_word_embeddings=True, **special)
    raise ValueError(f"arch {arch!r}: not one of {ARCHS}")


def make_model(out: str, hidden=64, layers=2, heads=2, ffn=None, max_len=256, seed=0, arch="llama", tokenizer=None):
    """Save a randomly initialised tiny causal LM (a Llama unless `arch` says otherwise: see ARCHS)
    and its tokenizer (default: the character-level one) to `out`; return (model, tokenizer)."""
    import transformers

    if arch == "llama":
        return tiny.make_model(out, hidden, layers, heads, ffn, max_len, seed, tokenizer)
    tokenizer = tokenizer or tiny.make_tokenizer()
    config = arch_config(arch, tokenizer, hidden, layers, heads, ffn or 3 * hidden, max_len)
    torch.manual_seed(seed)
    model = getattr(transformers, CAUSAL_LM[arch])(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model, tokenizer


def make_reward_model(out: str, arch="gpt_neox", tokenizer=None, hidden=64, layers=2, heads=2, ffn=None,
                      max_len=256, seed=0):
    """Save a randomly initialised tiny reward model to `out`, with its tokenizer (default: a BPE
    one), and return (model, tokenizer): a sequence classifier of `arch` with one output (the
    reward), read at the last token that is not padding, so `pad_token_id` is set."""
    import transformers

    tokenizer = tokenizer or make_bpe_tokenizer()
    config = arch_config(arch, tokenizer, hidden, layers, heads, ffn or 3 * hidden, max_len, num_labels=1)
    torch.manual_seed(seed)
    model = getattr(transformers, SEQ_CLS[arch])(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model, tokenizer
