"""Trainer memory: a formula for the trainer GPU's peak, checked against a measured peak on the CPU.

    python tools/memory.py                 # rho-math-1b's layer shape, scaled down to a few layers, on the CPU
    python tools/memory.py --layers 1 2 4  # the layer counts measured: two to fit, a deeper one to check
    python tools/memory.py --narrow 4      # a layer 4 times narrower (where bf16 matrix products are slow)

The trainer step (policy.load_policy with bf16 compute, tba.backward, AdamW) runs on the CPU under
PyTorch's MemTracker (torch/distributed/_tools/mem_tracker.py), which attributes every live tensor
to parameters, gradients, optimizer state or activations and records the peak. The models have
rho-math-1b's layer shape (hidden 2048, MLP 5632, 32 heads with 4 key/value heads, vocabulary
32,000) and 1-4 layers instead of 22, and the batch is one prompt of K responses, padded as GSM8K's
are. From the measurements: the bytes kept for the backward pass per token and layer (with and
without --activation-checkpointing) and a fixed part (logits and their gradients, which grow with
tokens, not layers); the formula (float32 weights and AdamW, what is kept, the loss's backward transients and
FSDP2's gathered root; or, at the pass's end, every gradient and the root's reduce-scatter) then predicts the peak
of a model of another depth, which is measured too, and prints both. --narrow N divides the layer's widths and heads by N (the test's shape: a
CPU without AVX-512 multiplies bf16 matrices in PyTorch's reference loop, 16x the work at full width taking
minutes); what is kept scales with the widths, and the extrapolations scale from the shape measured. Finally it prints
the memory plan, term by term and as allocated, for rho-math-1b at the paper's GSM8K settings and for run_math.sh's
Qwen2.5-7B trainer (rank 0 and the others, each loss, with and without --behaviour-logprobs trainer, --lag 2 and
10, GPU and host): beside the fit, FSDP2's buffers and the end of the backward pass, --lag's pinned slots as
runtime/weights.flat_slot allocates them (registered host memory, exact), --evaluator after's engine and snapshots.
The plan's counting is in small functions of sizes (the tests call them without measuring). Bad arguments are refused
in one line, exit status 2, before anything is measured.
"""

import argparse
import math
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
        raise ValueError(f"--narrow {narrow}: must divide rho-math-1b's {RHO['kv_heads']} key/value heads (1, 2 or 4)")
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
    step = lambda: tba.gradient(cfg)(model, batch, 0, 1, prompts, 0, torch.device("cpu"), cfg, beta=cfg.beta)
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


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors in one line too (its usage line aside)
        refuse(message)


def refuse(message: str):
    print(f"memory.py: {message}", file=sys.stderr)
    sys.exit(2)


def check(args) -> dict:
    """Arguments the fit cannot use, refused in one line before anything is measured; returns the layer's shape."""
    a, b, c = args.layers
    if not 1 <= a < b < c:
        refuse(f"--layers {a} {b} {c}: three increasing depths of at least 1 (two to fit, a deeper one to check)")
    if args.K < 2:  # np.linspace of one point is the shortest length: the token count would be wrong
        refuse(f"--K {args.K}: at least 2 sequences (their lengths run from a quarter of --response to --response)")
    if args.prompt < 1:
        refuse(f"--prompt {args.prompt}: at least 1 token")
    if args.response < 4:
        refuse(f"--response {args.response}: at least 4 tokens (the shortest response is a quarter of it)")
    if args.prompt + args.response > 2048:
        refuse(f"--prompt + --response: {args.prompt + args.response} tokens, more than the models' 2048 positions")
    if args.vocab < 1000:
        refuse(f"--vocab {args.vocab}: at least 1000 (the token ids drawn run up to 999)")
    try:
        return shape(args.narrow)
    except ValueError as e:
        refuse(str(e))


def main(argv=None):
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs=3, default=[1, 2, 4], help="two depths to fit, one to check")
    p.add_argument("--K", type=int, default=4, help="responses (sequences) in the pass")
    p.add_argument("--prompt", type=int, default=200, help="prompt tokens")
    p.add_argument("--response", type=int, default=128, help="longest response tokens")
    p.add_argument("--vocab", type=int, default=RHO["vocab"])
    p.add_argument("--narrow", type=int, default=1, help="divide the layer's widths and heads by this (1, 2 or 4)")
    args = p.parse_args(argv)
    s = check(args)
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
        # them): in the loss's backward no gradient yet, the kept bytes, the loss's transients and the root
        # gathered; at the end every gradient, no activation, and the root unit's reduce-scatter (one pass, one
        # rank: nothing accumulated yet)
        state = lambda gradients: gpu.trainer_bytes(m["params"], m["params"], "float32", gradients)  # noqa: E731
        measured = dict(s, layers=c, vocab=args.vocab)
        transient = loss_backward(args.K, args.prompt + args.response, args.vocab) + 2 * root_numel(measured)
        predicted = max(state(False) + fixed + c * per_layer + transient,
                        state(True) + end_of_backward(measured, 1, accumulating=False))
        print(f"{how} activation checkpointing: kept for the backward pass {per_layer / tokens / 1024:.1f} KB a token "
              f"a layer and {fixed / tokens / 1024:.0f} KB a token besides; {c} layers: peak by the formula "
              f"{predicted / 2**20:.0f} MiB, measured {m['peak']['Total'] / 2**20:.0f} MiB "
              f"({100 * (predicted - m['peak']['Total']) / m['peak']['Total']:+.1f}%)")
    for recompute in (False, True):
        print(rho_line(fits, args.vocab, s, recompute))
    for loss in ("tb", "drgrpo"):
        for rank in (0, 1):
            print(qwen_line(fits, args.vocab, s, loss, rank))
    for lag in (2, 10):
        print(host_line(lag))
    print(qwen_evaluator_line())
    return out


# --- the plan: pure functions of sizes (no measuring) ---------------------------------------------------
# Qwen/Qwen2.5-7B's config.json (biases on q, k and v: Qwen2's attention)
QWEN_7B = dict(hidden=3584, ffn=18944, heads=28, kv_heads=4, vocab=152064, layers=28, tie=False, bias=True)
GB = 1e9
CARD = 80e9        # an "80 GB" card (A100, H100), in the plan's decimal GB
CONTEXT = 0.5e9    # a CUDA context
USABLE = 84.5e9    # what an "80 GB" card (85.0e9 bytes) leaves to a process's allocations
RESERVE = 0.10     # the caching allocator's cached blocks beyond what is allocated, a share of it
NCCL = 1.5e9       # NCCL's own buffers on a trainer GPU (its channels', outside torch's allocator)
HEADROOM = 5e9     # what the plan keeps free of a card for what it does not count
EXPANDABLE = 0.02  # RESERVE with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (grown in place; assumed)
GSM8K = dict(steps=700, eval_every=100, trainer_memory=0.2, searchers=3)  # run_gsm8k.sh; --trainer-memory's default
MATH = dict(ranks=4, tokens=4096, searchers=4, steps=420, eval_every=5)   # run_math.sh
BEHAVIOUR = "the behaviour copy's bf16 shard"
MOMENTS = ("the loss's backward", "a block's backward", "the end of the backward pass", "the statistics pass")


def decoder_shapes(c: dict) -> list[tuple[int, ...]]:
    """The distinct weights' shapes of a Llama or Qwen2 decoder of config `c` (RHO's and QWEN_7B's keys), in the
    model's order: each layer's q, k, v (with their biases where `bias`: Qwen2), o, gate, up, down and two norms;
    the embeddings, the final norm and the LM head unless tied."""
    h, f, kv = c["hidden"], c["ffn"], c["kv_heads"] * (c["hidden"] // c["heads"])
    attention = [(h, h), (h,), (kv, h), (kv,), (kv, h), (kv,)] if c.get("bias") else [(h, h), (kv, h), (kv, h)]
    layer = attention + [(h, h), (f, h), (f, h), (h, f), (h,), (h,)]
    return [(c["vocab"], h)] + layer * c["layers"] + [(h,)] + ([] if c["tie"] else [(c["vocab"], h)])


def numel(shapes) -> int:
    return sum(math.prod(s) for s in shapes)


def block_numel(c: dict) -> int:
    """A decoder block's parameters: an FSDP2 unit of its own (runtime/policy.load_policy)."""
    return (numel(decoder_shapes(c)) - root_numel(c)) // c["layers"]


def root_numel(c: dict) -> int:
    """The root unit's parameters (FSDP2's fully_shard of the whole model takes what no block holds): the
    embeddings, the final norm and the untied LM head."""
    return c["vocab"] * c["hidden"] * (1 if c["tie"] else 2) + c["hidden"]


def fsdp_pass(c: dict, compute: int = 2) -> dict[str, float]:
    """FSDP2's bytes on a rank while a block is recomputed in a gradient pass, beside the activations, by name
    (compute dtype: `compute` bytes): the root unit kept gathered from its forward to its post-backward (the root
    does not reshard after forward: torch/distributed/fsdp/_fully_shard/_fsdp_state.py:203-207), the block and the
    next one, prefetched (_fsdp_param_group.py:828-830); the unsharded gradients until their unit's post-backward
    (_fsdp_param_group.py:618-630): the LM head's, computed first and reduced last with the root, and the block's;
    the previous block's float32 reduce-scatter input, held until this block's post-backward (_fsdp_param_group.py:
    639-658, 717-719)."""
    root, block, head = root_numel(c), block_numel(c), c["vocab"] * c["hidden"]
    return {"the root gathered": root * compute, "two blocks gathered": 2 * block * compute,
            "the LM head's gradient": head * compute, "a block's gradients": block * compute,
            "the last block's reduce-scatter input": block * 4}


def fsdp_statistics(c: dict, compute: int = 2) -> float:
    """FSDP2's bytes in a pass without gradient: the root gathered and a block with the next one."""
    return (root_numel(c) + 2 * block_numel(c)) * compute


def end_of_backward(c: dict, world: int, weights: int = 4, compute: int = 2, accumulating: bool = True) -> float:
    """What the end of a backward pass adds to every gradient and AdamW's state on a rank of `world`: the root unit's
    reduce-scatter, which runs last (its post-backward, from the final callback: _fsdp_state.py:395-431), after
    every activation is gone and its gathered weights are resharded (_fsdp_param_group.py:637-638). Its unsharded
    gradients (compute dtype) are copied into a float32 reduce-scatter input before they are freed
    (_fsdp_collectives.py:597-606); then the input, held until the final callback (_fsdp_state.py:428-431), and
    the float32 output (:612-616), cast to the weights' dtype (:696) and added to the gradient accumulated over the
    step's earlier passes (:744-749: `accumulating`; the first pass's output becomes the gradient). The larger of
    the two moments; `weights`: the trainer dtype's bytes."""
    root = root_numel(c)
    shard = -(-root // world)
    copy_in = root * (compute + 4) - (0 if accumulating else shard * weights)  # the root's gradient not there yet
    cast = weights != 4
    output = (shard * 4 if accumulating or cast else 0) + (shard * weights if accumulating and cast else 0)
    return max(copy_in, root * 4 + output)


def shard_sizes(c: dict, world: int, rank: int, nbytes: int) -> list[int]:
    """Bytes of each of rank `rank`'s FSDP2 shards (dim 0 cut as torch.chunk: runtime/gpu.shard_rows)."""
    return [gpu.shard_rows(s[0], world, rank) * math.prod(s[1:]) * nbytes for s in decoder_shapes(c)]


def pow2_ceil(n: int) -> int:
    """n rounded up to a power of two, as c10::llvm::PowerOf2Ceil (c10/util/llvmMathExtras.h:701-705)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def pinned_tensors(sizes) -> int:
    """Bytes of the tensors of `sizes` bytes pinned one block each by torch's caching host allocator (--lag's history
    before runtime/weights.flat_slot), each block rounded up to a power of two (ATen/core/CachingHostAllocator.h:
    302-309): about 1.9x the bytes for Qwen2.5-7B's shapes. The "before" figure of docs/gpu.md's plan."""
    return sum(pow2_ceil(s) for s in sizes)


def history(c: dict, lag: int, world: int = 1, rank: int = 0) -> float:
    """--lag's ring on the host: L + 1 slots, each ONE pinned block of the bf16 weights (world 1: runtime/weights.Outbox,
    every distinct tensor) or of a rank's bf16 shards (runtime/policy.LaggedCopy), registered in place, so exact on any
    torch (runtime/gpu.pinned_block)."""
    return (lag + 1) * gpu.pinned_block(shard_sizes(c, world, rank, 2))


def loss_backward(sequences: int, tokens: int, vocab: int, chunk_bytes: int = 2**28) -> float:
    """What the loss's backward pass adds to what the pass keeps (loss.next_token_logprobs, a chunk of positions at a
    time): the logits' bf16 gradient, accumulated over the chunks, and beside it the chunk's, which the backward of
    the slice `logits[:, at]` pads with zeros to the logits' full size (SliceBackward0's gradient has its input's
    shape); the chunk's float32 log-softmax recomputed (torch.utils.checkpoint) with its gradient and the gather's:
    three float32 chunks of at most `chunk_bytes` (loss.chunks)."""
    positions = max(1, chunk_bytes // (4 * sequences * vocab))
    return 2 * 2 * sequences * tokens * vocab + 3 * 4 * sequences * min(positions, tokens) * vocab


def moments(c: dict, kept: float, block: float, sequences: int, tokens: int, world: int,
            statistics: float = 0.0) -> dict[str, float]:
    """What a rank of `world` holds beside the trainer's state at each moment of a step that can be its peak (bytes),
    for a pass of `sequences` x `tokens` that keeps `kept` for its backward and recomputes `block` a block
    (activation checkpointing; else 0): the loss's backward (`loss_backward`, the root gathered), a block's backward
    (the block recomputed, FSDP2's buffers: `fsdp_pass`), the end of the backward pass (`end_of_backward`) and, where
    the group's statistics come from passes without gradient of `statistics` bytes (logits and a chunk), those
    (`fsdp_statistics`)."""
    out = {"the loss's backward": kept + loss_backward(sequences, tokens, c["vocab"]) + 2 * root_numel(c),
           "a block's backward": kept + block + sum(fsdp_pass(c).values()),
           "the end of the backward pass": end_of_backward(c, world)}
    if statistics:
        out["the statistics pass"] = statistics + fsdp_statistics(c)
    return out


def describe(x: dict) -> str:
    return ", ".join(f"{k} {v / GB:.1f}" for k, v in x.items())


def rho_moments(fits: dict, vocab: int, s: dict = RHO, recompute: bool = False) -> dict[str, float]:
    """rho-math-1b's pass at the paper's settings (20 sequences of 750 token slots, whole prompts: no statistics pass),
    what it keeps and recomputes scaled from the fit at the shape measured (`s`, vocabulary `vocab`) to its width and
    vocabulary, and its `moments` on one rank."""
    T = 20 * 750
    per_token_layer, per_token = fits[recompute]
    kept = per_token_layer * RHO["hidden"] / s["hidden"] * T * RHO["layers"] + per_token * RHO["vocab"] / vocab * T
    block = fits[False][0] * RHO["ffn"] / s["ffn"] * T if recompute else 0.0
    return dict(kept=kept, block=block, **moments(RHO, kept, block, 20, 750, 1))


def rho_plan(fits: dict, vocab: int, s: dict = RHO, recompute: bool = False) -> dict[str, float]:
    """rho-math-1b's trainer GPU at the paper's settings (one rank, float32 weights, 7 passes a step), term by term
    (bytes): weights, gradients and AdamW (the gradients accumulate from the step's first pass on, so a later pass
    holds them all), the largest of the pass's moments (`rho_moments`), the shared bf16 copy for the searchers, the
    CUDA contexts (the trainer's, and the 3 searchers' on GPU 0 for CUDA IPC); --evaluator after's engine
    (--trainer-memory of an 80 GB card) and its snapshots on the host."""
    P, x = numel(decoder_shapes(RHO)), rho_moments(fits, vocab, s, recompute)
    peak = max((k for k in MOMENTS if k in x), key=x.get)
    return {"weights, gradients and AdamW": gpu.trainer_bytes(P, P, "float32"), f"{peak} (the largest)": x[peak],
            "shared copy": 2 * P, "CUDA contexts": CONTEXT * (1 + GSM8K["searchers"]),
            "--evaluator after's engine": GSM8K["trainer_memory"] * CARD,
            "--evaluator after's snapshots (host)": gpu.snapshots(GSM8K["steps"], GSM8K["eval_every"]) * 2 * P}


def rho_line(fits: dict, vocab: int, s: dict, recompute: bool) -> str:
    plan, x = rho_plan(fits, vocab, s, recompute), rho_moments(fits, vocab, s, recompute)
    on_gpu = {k: v for k, v in plan.items() if "--evaluator" not in k}
    total, engine = sum(on_gpu.values()), plan["--evaluator after's engine"]
    n, snaps = gpu.snapshots(GSM8K["steps"], GSM8K["eval_every"]), plan["--evaluator after's snapshots (host)"]
    return (f"rho-math-1b, 20 x 750 tokens a pass, {'with' if recompute else 'without'} activation checkpointing: about "
            f"{total / GB:.0f} GB on the trainer GPU ({describe(on_gpu)}; kept for the backward pass "
            f"{x['kept'] / GB:.1f}, a block recomputed {x['block'] / GB:.1f}; the moments: "
            f"{describe({k: x[k] for k in MOMENTS if k in x})}); --evaluator after: its engine {engine / GB:.1f} more "
            f"(--trainer-memory {GSM8K['trainer_memory']} of {CARD / GB:.0f} GB), {(total + engine) / GB:.0f} GB, and "
            f"{n} snapshots on the host, {snaps / GB:.1f} GB (--eval-every {GSM8K['eval_every']}, {GSM8K['steps']} steps)")


def qwen_moments(fits: dict, vocab: int, s: dict = RHO) -> dict[str, float]:
    """run_math.sh's pass on a rank (qwen_plan says how each part is scaled): what it keeps, the block recomputed, the
    statistics pass's logits and chunk, and the `moments`."""
    q, tokens = QWEN_7B, MATH["tokens"]
    (ckpt_layer, fixed), (full_layer, _) = fits[True], fits[False]
    kept = (ckpt_layer * q["hidden"] / s["hidden"] * q["layers"] + fixed * q["vocab"] / vocab) * tokens
    block = full_layer * q["ffn"] / s["ffn"] * tokens
    logits = tokens * q["vocab"] * 2 + 2**28
    return dict(kept=kept, block=block, logits=logits,
                **moments(q, kept, block, 1, tokens, MATH["ranks"], statistics=logits))


def qwen_plan(fits: dict, vocab: int, s: dict = RHO, loss: str = "tb", rank: int = 0,
              behaviour: bool = False) -> dict[str, float]:
    """run_math.sh's trainer: Qwen2.5-7B over 4 GPUs (FSDP2 shards weights, gradients and AdamW), micro-batch 1 of up to
    4,096 tokens (--context), activation checkpointing, float32 weights, bf16 compute: rank `rank`'s GPU, term by
    term (bytes). What a pass keeps is scaled from the fit at the shape measured (`s`, vocabulary `vocab`): a block's
    checkpoint (its input) by the hidden width, the fixed part (logits, log-softmax chunks) by the vocabulary; the one
    block recomputed at a time in the backward pass by the fit without checkpointing, scaled by the MLP's width; the
    statistics pass without gradient holds one sequence's bf16 logits and a float32 chunk (tba.backward). The terms:
    the shard of weights, AdamW and the gradients (alive through the step's 128 passes of accumulation); the largest
    of the pass's moments (`qwen_moments`); the CUDA context; on rank 0 the shared bf16 copy for the searchers
    (runtime/weights.py), TBA′'s second one for pi_ref (--ref-reset-every) and the CUDA context each searcher opens on
    GPU 0 to map them (CUDA IPC); with --behaviour-logprobs trainer (`behaviour`) its copy's bf16 shard
    (runtime/policy.LaggedCopy, resharded after each rescore, which runs before the step's passes)."""
    q, x = QWEN_7B, qwen_moments(fits, vocab, s)
    shard = sum(shard_sizes(q, MATH["ranks"], rank, 1))
    peak = max((k for k in MOMENTS if k in x), key=x.get)
    P = numel(decoder_shapes(q))
    plan = {"weights, gradients and AdamW shard": gpu.trainer_bytes(shard, shard, "float32"),
            f"{peak} (the largest)": x[peak], "CUDA context": CONTEXT}
    if rank == 0:
        plan["shared copy"] = 2 * P
        if loss == "tb":
            plan["pi_ref's shared copy"] = 2 * P
        plan[f"{MATH['searchers']} searchers' CUDA contexts"] = MATH["searchers"] * CONTEXT
    if behaviour:
        plan[BEHAVIOUR] = 2 * shard
    return plan


def on_card(plan: dict, reserve: float = RESERVE) -> float:
    """What a GPU whose plan (allocated bytes, term by term) is `plan` holds: the plan, the allocator's
    `reserve` beyond it and NCCL's buffers; HEADROOM below USABLE is the plan's aim."""
    return sum(plan.values()) * (1 + reserve) + NCCL


def headroom_line(plan: dict) -> str:
    """What a trainer GPU holds beyond the plan's allocations, and the setting that leaves HEADROOM where it
    falls short (run_math.sh says the same at its start)."""
    held, expandable = on_card(plan), on_card(plan, EXPANDABLE)
    line = (f"with the allocator's {RESERVE:.0%} and NCCL's {NCCL / GB:.1f} about {held / GB:.0f} of the "
            f"{USABLE / GB:.1f} GB usable, {(USABLE - held) / GB:.1f} free")
    if USABLE - held >= HEADROOM:
        return line
    return (f"{line}, under the {HEADROOM / GB:.0f} GB kept: PYTORCH_CUDA_ALLOC_CONF="
            f"expandable_segments:True leaves {(USABLE - expandable) / GB:.0f} if the allocator then keeps "
            f"{EXPANDABLE:.0%}")


def qwen_line(fits: dict, vocab: int, s: dict, loss: str, rank: int) -> str:
    plan, more = qwen_plan(fits, vocab, s, loss, rank), qwen_plan(fits, vocab, s, loss, rank, behaviour=True)
    x = qwen_moments(fits, vocab, s)
    name = {"tb": "TBA′", "drgrpo": "Dr. GRPO"}[loss]
    return (f"Qwen2.5-7B, run_math.sh's trainer, LOSS={loss} ({name}; {MATH['ranks']} GPUs, 1 x {MATH['tokens']} tokens "
            f"a pass, activation checkpointing), rank {rank}{'' if rank == 0 else ' and up'}: about "
            f"{sum(plan.values()) / GB:.0f} GB of {CARD / GB:.0f} ({describe(plan)}; kept for the backward pass "
            f"{x['kept'] / GB:.1f}, a block recomputed {x['block'] / GB:.1f}, the statistics pass's logits and chunk "
            f"{x['logits'] / GB:.1f}; the moments: {describe({k: x[k] for k in MOMENTS if k in x})}; FSDP2's in a block's "
            f"backward: {describe(fsdp_pass(QWEN_7B))}); with --behaviour-logprobs trainer about "
            f"{sum(more.values()) / GB:.0f} GB (its copy's bf16 shard {more[BEHAVIOUR] / GB:.1f}); "
            f"without it, {headroom_line(plan)}")


def host_plan(lag: int, rank: int = 0, behaviour: bool = False, loss: str = "tb") -> dict[str, float]:
    """run_math.sh's hosts for Qwen2.5-7B with --lag `lag`, term by term (bytes): on rank 0 (the node's leader) the
    ring of the weights of the last L steps and the current (runtime/weights.Outbox); on every rank with
    --behaviour-logprobs trainer the ring of its bf16 shards (runtime/policy.LaggedCopy); both pinned, one block a slot
    (`history`). While rank 0 writes a checkpoint it also holds the model and AdamW in float32 (gathered to it:
    runtime/checkpoint.save_checkpoint), the searchers' older weights (with --lag they hold those of step - L:
    weights.Outbox.saved) and under TBA′ pi_ref's (`loss` tb)."""
    q, world = QWEN_7B, MATH["ranks"]
    P = numel(decoder_shapes(q))
    plan = {}
    if rank == 0:
        plan["--lag's history"] = history(q, lag)
    if behaviour:
        plan["--behaviour-logprobs trainer's history"] = history(q, lag, world, rank)
    if rank == 0:
        plan["a checkpoint: the model and AdamW"] = 12 * P
        plan["a checkpoint: the searchers' weights"] = 2 * P
        if loss == "tb":
            plan["a checkpoint: pi_ref's"] = 2 * P
    return plan


def host_line(lag: int) -> str:
    ring = host_plan(lag)["--lag's history"]
    mine = host_plan(lag, behaviour=True)["--behaviour-logprobs trainer's history"]
    other = host_plan(lag, rank=1, behaviour=True)["--behaviour-logprobs trainer's history"]
    checkpoint = sum(v for k, v in host_plan(lag).items() if k.startswith("a checkpoint"))
    disk = checkpoint + ring  # trainer.pt also holds the history's slots (weights.Outbox.saved), each block once
    old = (lag + 1) * pinned_tensors([math.prod(x) * 2 for x in decoder_shapes(QWEN_7B)])
    return (f"Qwen2.5-7B, --lag {lag}: rank 0's host RAM for the weights of the last {lag} steps and the current: "
            f"{ring / GB:.1f} GB pinned ({lag + 1} slots of one block each, registered host memory: exact; one "
            f"block a tensor from torch's pinned allocator would take {old / GB:.1f}); --behaviour-logprobs trainer "
            f"adds on each rank {lag + 1} slots of its bf16 shards, {mine / GB:.1f} GB (ranks 1 and up "
            f"{other / GB:.1f}): rank 0 {(ring + mine) / GB:.1f} GB; while a checkpoint is written, rank 0 also holds "
            f"the model, AdamW, the searchers' weights and pi_ref's: {checkpoint / GB:.1f} GB more, and writes them "
            f"with the history: {disk / GB:.1f} GB on disk")


def qwen_evaluator_line() -> str:
    P = numel(decoder_shapes(QWEN_7B))
    n = gpu.snapshots(MATH["steps"], MATH["eval_every"])
    return (f"Qwen2.5-7B, --evaluator after: refused with run_math.sh's {MATH['ranks']} trainer ranks (it runs an engine "
            f"in one trainer process); on one rank the trainer's weights, gradients and AdamW alone take "
            f"{gpu.trainer_bytes(P, P, 'float32') / GB:.1f} GB, and --eval-every {MATH['eval_every']} over "
            f"{MATH['steps']} steps would keep {n} snapshots on the host, {n * 2 * P / GB:.0f} GB")


if __name__ == "__main__":
    sys.exit(main() and 0)
