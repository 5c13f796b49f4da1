"""Trainer memory: a formula for the trainer GPU's peak, checked against a measured peak on the CPU.

    python tools/memory.py                 # rho-math-1b's layer shape, scaled down to a few layers, on the CPU
    python tools/memory.py --layers 2 4    # the layer counts measured
    python tools/memory.py --narrow 4      # a layer 4 times narrower (where bf16 matrix products are slow)

The trainer step (policy.load_policy with bf16 compute, tba.backward, AdamW) runs on the CPU under
PyTorch's MemTracker (torch/distributed/_tools/mem_tracker.py), which attributes every live tensor
to parameters, gradients, optimizer state or activations and records the peak. The models have
rho-math-1b's layer shape (hidden 2048, MLP 5632, 32 heads with 4 key/value heads, vocabulary
32,000) and 1-4 layers instead of 22, and the batch is one prompt of K responses, padded as GSM8K's
are. From the measurements: the bytes kept for the backward pass per token and layer (with and
without --activation-checkpointing) and a fixed part (logits and their gradients, which grow with
tokens, not layers); the formula then predicts the peak of a model of another depth, which is
measured too, and prints both. --narrow N divides the layer's widths and heads by N (the test's shape: a
CPU without AVX-512 multiplies bf16 matrices in PyTorch's reference loop, 16x the work at full width taking
minutes); what is kept scales with the widths, and the extrapolations scale from the shape measured. Finally it extrapolates to rho-math-1b at the paper's settings and to
Qwen2.5-7B at run_math.sh's.
"""

import argparse
import os
import socket
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root, above tools/

import numpy as np
import torch

from runtime import gpu
from runtime import ranks
from runtime import policy
import tba
from runtime.config import Config
from buffer import Trajectory

RHO = dict(hidden=2048, ffn=5632, heads=32, kv_heads=4, vocab=32000, layers=22, tie=False)  # realtreetune/rho-1b-sft-GSM8K


def shape(narrow: int) -> dict:
    """rho-math-1b's layer with its widths and heads divided by `narrow` (the head width kept)."""
    if narrow < 1 or RHO["kv_heads"] % narrow:
        raise SystemExit(f"--narrow {narrow}: must divide rho-math-1b's {RHO['kv_heads']} key/value heads")
    return dict(RHO, hidden=RHO["hidden"] // narrow, ffn=RHO["ffn"] // narrow, heads=RHO["heads"] // narrow,
                kv_heads=RHO["kv_heads"] // narrow)


def make(path, layers, vocab, s=RHO):
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["ffn"], num_attention_heads=s["heads"],
                         num_key_value_heads=s["kv_heads"], num_hidden_layers=layers, vocab_size=vocab,
                         max_position_embeddings=2048, tie_word_embeddings=s["tie"])
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)


def measure(path, K, prompt, response, recompute) -> dict:
    """One trainer step of one prompt x K responses of lengths up to `response` (bf16 compute), after
    a first step (AdamW's state exists, as in every later step): the peak of live tensors during the
    backward pass (MemTracker, bytes by kind), the bytes autograd keeps for the backward pass (each
    storage once; FSDP2's gathered bf16 weights aside: they are freed after the forward and gathered
    again), and the parameter count."""
    from torch.distributed._tools.mem_tracker import MemTracker
    cfg = Config(model=path, prompts_per_step=1, samples_per_prompt=K, micro_batch=K, timeout=60)
    model = policy.load_policy(path, torch.device("cpu"), "bfloat16", recompute=recompute)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    rng = np.random.default_rng(0)
    lengths = np.linspace(response // 4, response, K).astype(int)  # responses of different lengths: padding
    batch = [[Trajectory(0, rng.integers(4, 1000, size=int(n)).astype(np.int32), 1.0, -5.0, -5.0, 0)
              for n in lengths]]
    prompts = [rng.integers(4, 1000, size=prompt).tolist()]
    step = lambda: tba.backward(model, batch, 1, prompts, 0, torch.device("cpu"), cfg, cfg.beta)
    step()
    opt.step()
    opt.zero_grad(set_to_none=True)
    weights = {tuple(p.shape) for p in model.parameters()}
    saved = {}

    def pack(t):
        if not (t.dim() <= 2 and tuple(t.shape) in weights):  # FSDP2's gathered weights: not activations
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return dict(peak={str(k): v for k, v in peak.items()}, saved=sum(saved.values()),
                params=sum(p.numel() for p in model.parameters()), tokens=K * (prompt + response))


def init():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(s.getsockname()[1]))
    ranks.init_distributed(600, "cpu")  # gloo and a CPU mesh even where CUDA exists: this measures the CPU


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs=3, default=[1, 2, 4], help="two depths to fit, one to check")
    p.add_argument("--K", type=int, default=4, help="responses (sequences) in the pass")
    p.add_argument("--prompt", type=int, default=200, help="prompt tokens")
    p.add_argument("--response", type=int, default=128, help="longest response tokens")
    p.add_argument("--vocab", type=int, default=RHO["vocab"])
    p.add_argument("--narrow", type=int, default=1, help="divide the layer's widths and heads by this (1, 2 or 4)")
    args = p.parse_args(argv)
    s = shape(args.narrow)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    init()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for L in args.layers:
            make(os.path.join(tmp, str(L)), L, args.vocab, s)
            for recompute in (False, True):
                out[L, recompute] = measure(os.path.join(tmp, str(L)), args.K, args.prompt, args.response, recompute)
    a, b, c = args.layers
    tokens = out[a, False]["tokens"]
    print(f"rho-math-1b's layer shape{f' narrowed {args.narrow}x' if args.narrow > 1 else ''}, {args.K} sequences x up to {args.prompt + args.response} tokens "
          f"({tokens} token slots), vocabulary {args.vocab}, bf16 compute, CPU")
    fits = {}
    for recompute in (False, True):
        how = "with" if recompute else "without"
        saved = {L: out[L, recompute]["saved"] for L in args.layers}
        per_layer = (saved[b] - saved[a]) / (b - a)  # bytes kept a layer, all tokens
        fixed = saved[a] - a * per_layer                 # embeddings' output, logits, the log-softmax chunks
        fits[recompute] = (per_layer / tokens, fixed / tokens)
        m = out[c, recompute]
        # float32 weights and AdamW's moments (runtime/gpu.trainer_bytes, as its check with --searchers 0 counts
        # them): at the backward pass's start no gradient yet, at its end every gradient and no activation
        state = lambda gradients: gpu.trainer_bytes(m["params"], m["params"], "float32", gradients)  # noqa: E731
        predicted = max(state(False) + fixed + c * per_layer, state(True))
        print(f"{how} activation checkpointing: kept for the backward pass {per_layer / tokens / 1024:.1f} KB a token "
              f"a layer and {fixed / tokens / 1024:.0f} KB a token besides; {c} layers: peak by the formula "
              f"{predicted / 2**20:.0f} MiB, measured {m['peak']['Total'] / 2**20:.0f} MiB "
              f"({100 * (predicted - m['peak']['Total']) / m['peak']['Total']:+.1f}%)")
    # rho-math-1b at the paper's settings: 20 sequences of about 750 token slots (prompt + 512) a pass
    P, T = 1.10e9, 20 * 750
    shared, contexts = 2 * P, 0.5e9 * 4  # the bf16 copy for the searchers; CUDA contexts (trainer + 3 searchers)
    for recompute in (False, True):
        per_token_layer, per_token = fits[recompute]
        kept = per_token_layer * RHO["hidden"] / s["hidden"] * T * RHO["layers"] + per_token * T
        state = gpu.trainer_bytes(int(P), int(P), "float32", gradients=False)
        total = max(state + kept, gpu.trainer_bytes(int(P), int(P), "float32")) + shared + contexts
        print(f"rho-math-1b, 20 x 750 tokens a pass, {'with' if recompute else 'without'} activation checkpointing: "
              f"about {total / 1e9:.0f} GB on the trainer GPU (weights and AdamW {state / 1e9:.1f}, kept for the "
              f"backward pass {kept / 1e9:.1f}, shared copy {shared / 1e9:.1f}, CUDA contexts {contexts / 1e9:.1f})")
    qwen_7b(fits, args.vocab, s)
    return out


QWEN_7B = dict(params=7.62e9, hidden=3584, ffn=18944, layers=28, vocab=152064)  # Qwen/Qwen2.5-7B's config.json


def qwen_7b(fits: dict, vocab: int, s: dict = RHO, ranks: int = 4, tokens: int = 4096, searchers: int = 4):
    """run_math.sh's trainer: Qwen2.5-7B over `ranks` GPUs (FSDP2 shards weights, gradients and AdamW), micro-batch
    1 of up to `tokens` (--context), activation checkpointing, for each loss. What a pass keeps is scaled from the fit
    at the shape measured (`s`, vocabulary `vocab`): a block's checkpoint (its input) by the hidden width, the fixed part
    (logits, log-softmax chunks) by the vocabulary; the one block recomputed at a time in the backward pass by the fit
    without checkpointing, scaled by the MLP's width. Every term rank 0 holds at once: the shard of weights, AdamW and
    the gradients (alive through the group's 128 micro-batches of accumulation), a pass's activations (the larger of
    the gradient pass and the statistics pass without gradient, both of --micro-batch 1 sequence: tba.backward), FSDP2's
    gathered units, its CUDA context, and on rank 0 the shared bf16 copy for the searchers (runtime/weights.py), TBA′'s
    second one for pi_ref (--ref-reset-every), and the CUDA context each searcher opens on GPU 0 to map them (CUDA
    IPC). And rank 0's host RAM for --lag L: L + 1 pinned bf16 copies (runtime/weights.Outbox.keep). An estimate: no
    GPU ran it."""
    q, P = QWEN_7B, QWEN_7B["params"]
    (ckpt_layer, fixed), (full_layer, _) = fits[True], fits[False]
    kept = (ckpt_layer * q["hidden"] / s["hidden"] * q["layers"] + fixed * q["vocab"] / vocab) * tokens
    block = full_layer * q["ffn"] / s["ffn"] * tokens  # one block's activations, live while it is recomputed
    statistics = tokens * q["vocab"] * 2 + 2**28  # the pass without gradient: one sequence's bf16 logits, a chunk
    shard = int(P / ranks)
    state = gpu.trainer_bytes(shard, shard, "float32")  # weights, gradients (accumulating), AdamW's moments
    gathered = 2 * 2 * q["vocab"] * q["hidden"]  # FSDP2's bf16 all-gather of the largest units (embeddings, lm_head)
    context, copy = 0.5e9, 2 * P  # a CUDA context; one bf16 copy of the weights
    for loss, name, pi_ref in (("tb", "TBA′", True), ("drgrpo", "Dr. GRPO", False)):
        rank0 = dict(shard=state, activations=max(kept + block, statistics), gathered=gathered, context=context,
                     shared=copy, pi_ref=copy if pi_ref else 0.0, searchers=searchers * context)
        other = sum(rank0[k] for k in ("shard", "activations", "gathered", "context"))
        for rank, total in ((0, sum(rank0.values())), (1, other)):
            terms = (f"weights, gradients and AdamW shard {state / 1e9:.1f}, a pass's activations "
                     f"{rank0['activations'] / 1e9:.1f} (kept {kept / 1e9:.1f}, a recomputed block {block / 1e9:.1f}; "
                     f"the statistics pass {statistics / 1e9:.1f}), gathered weights {gathered / 1e9:.1f}, CUDA context "
                     f"{context / 1e9:.1f}")
            if rank == 0:
                terms += (f", shared copy {copy / 1e9:.1f}" + (f", pi_ref's shared copy {copy / 1e9:.1f}" if pi_ref else "")
                          + f", {searchers} searchers' CUDA contexts {searchers * context / 1e9:.1f}")
            print(f"Qwen2.5-7B, run_math.sh's trainer, LOSS={loss} ({name}; {ranks} GPUs, 1 x {tokens} tokens a pass, "
                  f"activation checkpointing), rank {rank}{'' if rank == 0 else ' and up'}: about {total / 1e9:.0f} GB "
                  f"of 80 ({terms}; count about 10% more)")
    for lag in (2, 10):
        print(f"Qwen2.5-7B, --lag {lag}: rank 0's host RAM for the weights of the last {lag} steps and the current: "
              f"{(lag + 1) * copy / 1e9:.0f} GB pinned ({lag + 1} bf16 copies); a checkpoint holds them too, beside the "
              f"model ({P * 4 / 1e9:.0f} GB) and AdamW ({P * 8 / 1e9:.0f} GB): about "
              f"{((lag + 1) * copy + P * 12) / 1e9:.0f} GB")


if __name__ == "__main__":
    sys.exit(main() and 0)
