"""What the GPU path costs at the paper's models' shapes, on one CUDA GPU with PyTorch and no vLLM, budgeted to end
within tests/gpu_check.sh's 190 s on an H200 (not yet run on one); one JSON line a figure, printed as it is measured
(docs/gpu.md says what each means and what it cannot show).

    python tools/gpu_probe.py                    # on a GPU: Qwen2.5-7B's and rho-math-1b's shapes
    python tools/gpu_probe.py --reduced          # anywhere, the CPU too: the same code at a toy's shapes (tested)
    python tools/gpu_probe.py --parts host,math  # some parts only (their keys below)

Each part runs on its own: one that fails prints {"figure": its figure, "error": "<type>: <first line>"} (its
traceback on stderr) and the next one runs; the exit status is 1 if any part failed (11: no CUDA device and no
--reduced, refused before anything is allocated). After each part a "timing" line gives its seconds.

apis    Which torch APIs the weight path and this probe use exist on this torch (a lent GPU may have another torch
        than the pinned 2.13), and whether its allocator takes `pinned_max_round_threshold_mb`.
write   runtime/weights.py's `write` of Qwen2.5-7B's bf16 weights into the shared copy on the GPU, against one
        device-to-device copy of the same bytes (`allocate` first: it goes through `allocator_settings`).
host    --lag's copy of them to the host: into pageable memory (a fresh tensor) against one slot of the pinned ring
        (`weights.flat_slot`: one flat page-locked block, views into it); the bytes asked for against those locked:
        by torch's caching host allocator for one block as it is (rounded up to a power of two) and with
        pinned_max_round_threshold_mb:0 set around it, and by flat_slot; the host allocator's statistics.
math    One MATH training step (tba.backward, --micro-batch 1, the group's statistics passes too, TBA′'s loss,
        gradient clipping, AdamW) of a model of Qwen2.5-7B's width with 1 and 3 decoder blocks, float32 weights,
        activation checkpointing, one rank: after a warm-up step (AdamW's state made), the peaks of allocated and
        reserved GPU memory of the pass alone and of the update, and their growth a block (tools/memory.py's plan).
seeded  vLLM's per-request seeded sampling: it draws each seeded request's exponential noise one row at a time
        (vllm/v1/sample/ops/topk_topp_sampler.py:555-577); that loop at 256 sequences of Qwen's vocabulary, against
        one draw for all rows (unseeded), per decoding step.
decode-rho, decode-qwen
        A decoding step in plain torch (no vLLM) at rho-math-1b's and Qwen2.5-7B's shapes, random bf16 weights: one
        new token a sequence over a preallocated KV cache, grouped-query attention by scaled_dot_product_attention,
        eager and as a CUDA graph (vLLM decodes in graphs), against the running sequences at 256, 1,024 and 4,096
        tokens of context; per context the fit a + b x sequences and b / a, the per-sequence share that
        runtime/slowdown.py's GPU_PER_SEQUENCE (0.016, fitted to Llama-2-7B with full multi-head attention)
        stands for.
gsm8k   One training step of run_gsm8k.sh's batch at rho-math-1b's shape on one GPU (7 prompts x K = 20, --micro-batch
        20, 238-token prompts and 512-token responses: 750 tokens a sequence, the memory plan's; bf16 weights, no
        activation checkpointing, TB's loss, AdamW): after a warm-up step, its seconds and peaks.
"""

import argparse
import gc
import importlib
import json
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

import numpy as np
import torch

# not fields of the models' configs: the parameters, the decoder blocks, the attention's q/k/v bias
NOT_CONFIG = ("params", "layers", "qkv_bias")
QWEN = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
            vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=False,
            params=7.62e9, layers=28, qkv_bias=True)  # Qwen/Qwen2.5-7B's config.json
RHO = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
           max_position_embeddings=2048, rope_theta=1e4, tie_word_embeddings=False, params=1.10e9, layers=22,
           qkv_bias=False)  # realtreetune/rho-1b-sft-GSM8K's config.json (TinyLlama's shape, a Llama)
TOY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
           max_position_embeddings=512, rope_theta=1e4, tie_word_embeddings=False, params=2e6, layers=2, qkv_bias=True)
TOY_LLAMA = dict(TOY, num_attention_heads=8, qkv_bias=False)

# decoding: running sequences x tokens of context per sequence; the toy's for --reduced
DECODE = dict(sequences=(1, 8, 32, 64, 128, 256), contexts=(256, 1024, 4096))
DECODE_TOY = dict(sequences=(1, 4, 8), contexts=(16, 64))
DECODE_BUDGET = {"rho": 35.0, "qwen": 45.0}  # s on a GPU: the grid stops where it runs over

# the torch APIs the weight path (runtime/weights.py) and this probe reach for; a lent GPU may have another torch
APIS = ("torch._C._accelerator_getAllocatorSettings", "torch._C._accelerator_setAllocatorSettings",
        "torch.cuda.memory._set_allocator_settings", "torch.cuda.cudart", "torch.cuda.memory.host_memory_stats",
        "torch.cuda.memory.reset_peak_host_memory_stats", "torch._C._accelerator_emptyHostCache",
        "torch._C._host_emptyCache", "torch.nn.functional.rms_norm", "torch.cuda.CUDAGraph",
        "torch.distributed.fsdp.fully_shard")

NO_CUDA = 11  # the exit status of a run refused for want of a GPU (tests/gpu_check.sh's for the same)


def say(figure: str, **values):
    print(json.dumps(dict(figure=figure, **values)), flush=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeat: int = 3, warmup: int = 0) -> float:
    """The median seconds of `fn()`, the device synchronised around each, after `warmup` calls not timed."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def exists(dotted: str) -> bool:
    """Whether `dotted` (torch.x.y) is there: its longest importable module (a submodule is an attribute of its
    package only once imported), then attributes."""
    names = dotted.split(".")
    for i in range(len(names), 0, -1):
        try:
            obj = importlib.import_module(".".join(names[:i]))
            break
        except ImportError:
            continue
    for name in names[i:]:
        obj = getattr(obj, name, None)
        if obj is None:
            return False
    return True


def gigabytes(n):
    return None if n is None else n / 1e9


# --- apis ------------------------------------------------------------------------------------------------------------
def api_report(state, device, reduced):
    """Which of APIS this torch has; on a GPU, whether its allocator settings take `pinned_max_round_threshold_mb`
    (set beside the current settings, then the current ones put back)."""
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    put = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    current = get() if get else None
    if device.type != "cuda":
        pinned = "not tried: no GPU"
    elif get is None or put is None:
        pinned = "not tried: no getter or setter of the allocator settings"
    else:
        try:
            put(",".join(filter(None, [current, "pinned_max_round_threshold_mb:0"])))
            pinned = "accepted"
        except Exception as e:  # noqa: BLE001 - what this torch says is the figure
            pinned = f"refused: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        finally:
            put(current)
    say("torch APIs", present={name: exists(name) for name in APIS}, allocator_settings=current,
        env={k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")},
        pinned_max_round_threshold_mb=pinned)


# --- write, host ------------------------------------------------------------------------------------------------------
def named_weights(state, shape, device):
    """write and host: the bf16 weights as a few large tensors of the model's total size (one block's shapes
    repeated), made once for both parts."""
    if "named" not in state:
        h, f, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
        block = {"q": (h, h), "kv": (2 * h // 7 if h % 7 == 0 else h // 2, h), "o": (h, h), "up": (2 * f, h),
                 "down": (h, f)}
        per_block = sum(a * b for a, b in block.values())
        layers = max(1, int((shape["params"] - 2 * v * h) / per_block))
        named = [("embed", torch.randn(v, h, dtype=torch.bfloat16, device=device)),
                 ("head", torch.randn(v, h, dtype=torch.bfloat16, device=device))]
        named += [(f"{i}.{k}", torch.randn(s, dtype=torch.bfloat16, device=device)) for i in range(layers)
                  for k, s in block.items()]
        state["named"] = named
    return state["named"]


def weight_write(state, device, reduced):
    import multiprocessing as mp
    from runtime import weights
    named = named_weights(state, TOY if reduced else QWEN, device)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    shared = weights.create(mp.get_context("spawn"))
    weights.allocate(shared, named, {}, device, torch.bfloat16)
    write = timed(lambda: weights.write(shared, named, 1, lambda: None, 600), device)
    flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    source = torch.empty_like(flat)
    copy = timed(lambda: flat.copy_(source), device)
    del flat, source, shared
    say("weight write into the shared copy", seconds=write, plain_copy_seconds=copy, ratio=write / copy,
        gigabytes=nbytes / 1e9, note="write computes each tensor's fingerprint as it copies")


def host_stats() -> dict | None:
    """torch's pinned (host) allocator statistics, flat ("allocated_bytes.current", ...), where this torch has them."""
    stats = getattr(torch.cuda.memory, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return None
    return dict(stats())


def host_allocated():
    """Bytes of pinned blocks torch's host allocator holds (in use and cached), each as rounded; None if unknown."""
    return (host_stats() or {}).get("allocated_bytes.current")


def empty_host_cache() -> str | None:
    """Give the host allocator's cached pinned blocks back (a cached block is reused for any request of its
    power-of-two bucket, so a block measured after it would read 0 bytes); the API used, or None."""
    for name in ("_accelerator_emptyHostCache", "_host_emptyCache"):
        if hasattr(torch._C, name):
            getattr(torch._C, name)()
            return f"torch._C.{name}"
    return None


def pinned_block(nbytes: int, exact: bool):
    """A page-locked block from torch's caching host allocator, its bytes as that allocator counts them (each block
    rounded up to a power of two unless `pinned_max_round_threshold_mb` says otherwise: torch/include/ATen/core/
    CachingHostAllocator.h in the wheel, lines 300-309), then given back. `exact`: with pinned_max_round_threshold_mb:0
    set around the allocation through torch._C's setter (the current settings put back after), where this torch takes
    it. Returns (bytes or None, how the setting went)."""
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    put = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    how, current = "not asked", None
    if exact:
        if get is None or put is None:
            return None, "not tried: no getter or setter of the allocator settings"
        current = get()
        try:
            put(",".join(filter(None, [current, "pinned_max_round_threshold_mb:0"])))
            how = "set"
        except Exception as e:  # noqa: BLE001 - what this torch says is the figure
            return None, f"refused: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    try:
        empty_host_cache()
        before = host_allocated()
        block = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        got = None if before is None else host_allocated() - before
        del block
        empty_host_cache()
    finally:
        if how == "set":
            put(current)
    return got, how


def lag_to_host(state, device, reduced):
    from runtime import weights
    named = named_weights(state, TOY if reduced else QWEN, device)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    pin = device.type == "cuda"
    pageable = timed(lambda: [t.to("cpu", copy=True) for _, t in named], device, repeat=1 if pin else 2)
    shapes = {n: (t.shape, t.dtype) for n, t in named}
    requested = sum(-(-t.numel() * t.element_size() // 64) * 64 for _, t in named)  # flat_slot's 64-byte offsets
    # one block of the slot's size from torch's pinned allocator, as it is and with the rounding turned off
    plain, _ = pinned_block(requested, False) if pin else (None, None)
    exact, how = pinned_block(requested, True) if pin else (None, "not tried: no GPU")
    # the project's slot (weights.flat_slot): page-locked by torch's allocator or registered in place, the bytes
    # locked are the allocator's count or else the block's own
    before = host_allocated()
    slot = weights.flat_slot(shapes, pin)
    counted = None if before is None else host_allocated() - before
    first = next(iter(slot.values()))
    block, pinned = first.untyped_storage().nbytes(), pin and first.is_pinned()
    locked = counted if counted else (block if pinned else 0)
    say("lag: pinned blocks", tensor_bytes=nbytes, requested_bytes=requested, plain_block_bytes=plain,
        threshold_block_bytes=exact, threshold_setting=how,
        threshold_exact=None if exact is None else exact == requested,
        flat_slot_block_bytes=block, flat_slot_pinned=pinned, flat_slot_allocator_bytes=counted,
        flat_slot_locked_bytes=locked, flat_slot_exact=locked == requested if pinned else None,
        note=None if pin else "the CPU: nothing page-locked")

    def to_pinned():
        for n, t in named:
            slot[n].copy_(t, non_blocking=True)
    ring = timed(to_pinned, device, repeat=2)
    keep = ("allocated_bytes.current", "allocated_bytes.peak", "active_bytes.current", "num_host_alloc",
            "num_host_free", "host_alloc_time.total", "host_free_time.total")
    stats = host_stats()
    say("lag: weights to the host", pageable_seconds=pageable, pinned_seconds=ring, speedup=pageable / ring,
        gigabytes=nbytes / 1e9, host_stats=None if stats is None else {k: stats.get(k) for k in keep},
        host_cache_emptied_by=empty_host_cache() if pin else None)
    del slot, first
    state.pop("named", None)  # the last part that needs them


# --- math, gsm8k: training steps -------------------------------------------------------------------------------------
def real_rotary(model, device):
    """A model built on the meta device and given memory by to_empty has its rotary embeddings' buffers (inv_freq and
    original_inv_freq) allocated but never computed: garbage positions. Each rotary module is built again by its own
    constructor from its config on the CPU (where transformers computes them when it loads a model), then moved."""
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            parent, _, attr = name.rpartition(".")
            with torch.device("cpu"):
                fresh = type(module)(config=getattr(module, "config", model.config)).to(device)
            if not torch.isfinite(fresh.inv_freq).all():
                raise RuntimeError(f"{name}: inv_freq not finite after rebuilding")
            setattr(model.get_submodule(parent) if parent else model, attr, fresh)


def build(kind: str, shape: dict, blocks: int, device, dtype):
    """A Qwen2 or Llama model of `shape` with `blocks` decoder blocks, random weights (no download), `dtype` weights,
    its rotary buffers computed (real_rotary)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    config_class, model_class = (Qwen2Config, Qwen2ForCausalLM) if kind == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    config = config_class(**{k: v for k, v in shape.items() if k not in NOT_CONFIG}, num_hidden_layers=blocks)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = model_class(config)
    # the dtype before the rotary buffers are computed: a cast after would round inv_freq to bf16, as a loaded model's
    # never is
    model = model.to_empty(device=device).to(dtype)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    real_rotary(model, device)
    model.config.use_cache = False
    return model


def shard(model, block: str, device, param_dtype):
    """FSDP2 per decoder block, then the whole, on the one-rank group, as policy.load_policy does."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for m in [m for m in model.modules() if type(m).__name__ == block]:
        fully_shard(m, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def peaks(device):
    if device.type != "cuda":
        return None, None  # the CPU keeps no allocator statistics
    return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)


def two_steps(model, opt, backward, device, clip: float) -> dict:
    """A warm-up step (forward and backward, clip, AdamW: its state is made here), then one measured: the peaks of
    allocated and reserved memory of its pass alone (forward and backward, before the update) and of its update
    (clip and AdamW), each from a reset of the peaks, and their seconds. The first step's peak would hold AdamW's
    state being made (8 bytes a parameter more), which a trainer's steady state already holds."""
    cuda = device.type == "cuda"

    def update():
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync(device)
    t0 = time.perf_counter()
    backward()
    update()
    sync(device)
    first = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    held = torch.cuda.memory_allocated(device) if cuda else None
    t0 = time.perf_counter()
    backward()
    sync(device)
    pass_s = time.perf_counter() - t0
    pass_alloc, pass_res = peaks(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    update()
    sync(device)
    update_s = time.perf_counter() - t0
    update_alloc, update_res = peaks(device)
    top = lambda a, b: None if a is None else max(a, b)
    return dict(held_before_gb=gigabytes(held), pass_allocated_gb=gigabytes(pass_alloc),
                pass_reserved_gb=gigabytes(pass_res), update_allocated_gb=gigabytes(update_alloc),
                update_reserved_gb=gigabytes(update_res), step_allocated_gb=gigabytes(top(pass_alloc, update_alloc)),
                step_reserved_gb=gigabytes(top(pass_res, update_res)), first_step_seconds=first, pass_seconds=pass_s,
                update_seconds=update_s)


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def math_blocks(device, blocks: int, reduced: bool) -> dict:
    """One MATH step at `blocks` blocks (two_steps): one group of K responses (prompt 256 tokens, responses up to
    3,840: the 4,096 of --context), --micro-batch 1, TBA′'s loss, clip 1, AdamW as run_math.sh's."""
    import tba
    from buffer import Trajectory
    from runtime import policy
    from runtime.config import Config
    shape = TOY if reduced else QWEN
    tokens, K = (32, 4) if reduced else (4096 - 256, 16)
    model = build("qwen2", shape, blocks, device, torch.float32)  # run_math.sh: --trainer-dtype float32
    policy.recompute_blocks(model, {"Qwen2DecoderLayer"})  # --activation-checkpointing, before fully_shard
    shard(model, "Qwen2DecoderLayer", device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    opt = policy.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01, betas=(0.9, 0.99))
    rng = np.random.default_rng(0)
    v = shape["vocab_size"]
    lengths = np.linspace(tokens // 2, tokens, K).astype(int)
    group = [Trajectory(0, rng.integers(4, v, int(n)).astype(np.int32), float(i % 2), -5.0, -5.0, 0,
                        behaviour_logps=np.full(int(n), -2.0, np.float32), ref_logps=np.full(int(n), -2.0, np.float32))
             for i, n in enumerate(lengths)]
    prompts = [rng.integers(4, v, 256).tolist()]
    cfg = Config(samples_per_prompt=K, micro_batch=1, loss="tbprime", norm="sequence", max_new_tokens=tokens,
                 temperature=1.0)
    out = two_steps(model, opt, lambda: tba.backward(model, [group], 1, prompts, 0, device, cfg, 0.005), device, 1.0)
    del model, opt
    free(device)
    return out


def math_step(state, device, reduced):
    shape = TOY if reduced else QWEN
    got = {}
    for blocks in (1, 3):
        got[blocks] = math_blocks(device, blocks, reduced)
        say("MATH step peak memory", blocks=blocks, unit="GB", **got[blocks])
    if device.type != "cuda":
        say("MATH step peak memory per block", note="ran; the CPU keeps no allocator statistics")
        return
    per = {k: (got[3][k] - got[1][k]) / 2 for k in ("pass_allocated_gb", "pass_reserved_gb", "step_allocated_gb",
                                                     "step_reserved_gb", "held_before_gb")}
    say("MATH step peak memory per block", unit="GB", per_block=per,
        at_all_blocks={k: got[1][k] + (shape["layers"] - 1) * v for k, v in per.items()},
        note="one rank, unsharded: on 4 ranks its weights, gradients and AdamW are a quarter of their share")


def gsm8k_step(state, device, reduced):
    import tba
    from buffer import Trajectory
    from runtime import policy
    from runtime.config import Config
    shape = TOY_LLAMA if reduced else RHO
    B, K, micro, prompt, response = (2, 4, 4, 8, 12) if reduced else (7, 20, 20, 238, 512)  # run_gsm8k.sh's
    model = build("llama", shape, shape["layers"], device, torch.bfloat16)  # --trainer-dtype bfloat16
    shard(model, "LlamaDecoderLayer", device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    opt = policy.AdamW(model.parameters(), lr=1e-5)
    rng = np.random.default_rng(0)
    v = shape["vocab_size"]
    groups = [[Trajectory(p, rng.integers(4, v, response).astype(np.int32), float((p + i) % 2), -50.0, -50.0, 0)
               for i in range(K)] for p in range(B)]
    prompts = [rng.integers(4, v, prompt).tolist() for _ in range(B)]
    cfg = Config(prompts_per_step=B, samples_per_prompt=K, micro_batch=micro, loss="tb", max_new_tokens=response,
                 temperature=0.7, grad_clip=0.0)
    out = two_steps(model, opt, lambda: tba.backward(model, groups, B, prompts, 0, device, cfg, 0.014), device, 0.0)
    say("GSM8K training step", prompts=B, K=K, micro_batch=micro, tokens_a_sequence=prompt + response,
        params=sum(p.numel() for p in model.parameters()), unit="GB", **out)
    del model, opt


# --- seeded ----------------------------------------------------------------------------------------------------------
def seeded_sampling(state, device, reduced, rows: int = 256):
    """vLLM's random_sample with a generator a request against none."""
    shape = TOY if reduced else QWEN
    probs = torch.rand(rows, shape["vocab_size"], device=device).softmax(-1)
    gens = [torch.Generator(device=device).manual_seed(i) for i in range(rows)]
    q = torch.empty_like(probs)

    def seeded():
        for i, g in enumerate(gens):
            q[i].exponential_(generator=g)
        return probs.div(q).argmax(-1)
    plain = timed(lambda: probs.div(q.exponential_()).argmax(-1), device, repeat=5)
    looped = timed(seeded, device, repeat=5)
    say("seeded sampling a decoding step", sequences=rows, seeded_seconds=looped, unseeded_seconds=plain,
        extra_seconds=looped - plain)


# --- decode-rho, decode-qwen ------------------------------------------------------------------------------------------
def rms(x, w):
    if hasattr(torch.nn.functional, "rms_norm"):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-6)
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def attend(q, keys, values):
    """Grouped-query attention of one new token a sequence: q (n, H, d) over keys and values (n, Hk, T, d) -> (n, H, d).
    The H / Hk query heads that share a key/value head (Llama's order: head j uses key/value head j // (H / Hk)) are
    that head's queries, every position visible (no mask): no key/value head is repeated in memory. (reshape, not
    view: a fused kernel may return its output in another memory layout, whose head dimensions no view can merge.)"""
    n, H, d = q.shape
    Hk = keys.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(q.view(n, Hk, H // Hk, d), keys, values).reshape(n, H, d)


class Decoder:
    """A decoder of `shape` in plain torch, random bf16 weights, and a KV cache for `seqs` sequences of `context`
    tokens, preallocated: (blocks, 2, seqs, key/value heads, context + 1, head width)."""

    def __init__(self, shape, device, seqs: int, context: int):
        h, f, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
        self.H, self.Hk = shape["num_attention_heads"], shape["num_key_value_heads"]
        self.d = h // self.H
        qkv = (self.H + 2 * self.Hk) * self.d
        w = lambda *s: torch.empty(*s, dtype=torch.bfloat16, device=device).normal_(0, 0.02)
        ones = lambda n: torch.ones(n, dtype=torch.bfloat16, device=device)
        self.layers = [dict(n1=ones(h), qkv=w(qkv, h), bias=w(qkv) if shape["qkv_bias"] else None, o=w(h, h),
                            n2=ones(h), gate_up=w(2 * f, h), down=w(h, f)) for _ in range(shape["layers"])]
        self.embed, self.norm, self.head = w(v, h), ones(h), w(v, h)
        self.cache = w(shape["layers"], 2, seqs, self.Hk, context + 1, self.d)
        inv = 1.0 / (shape["rope_theta"] ** (torch.arange(0, self.d, 2, dtype=torch.float32) / self.d))
        self.inv_freq = inv.to(device)
        self.tokens = torch.randint(4, v, (seqs,), device=device)
        self.weight_bytes = sum(t.numel() * 2 for L in self.layers for t in L.values() if t is not None) + 2 * v * h * 2

    def step(self, seqs: int, context: int):
        """One decoding step: each of the first `seqs` sequences holds `context` tokens and gets one more (its key and
        value written at position `context`); attention over context + 1 positions; the greedy next tokens."""
        F = torch.nn.functional
        angle = torch.cat([context * self.inv_freq] * 2)
        cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
        x = self.embed[self.tokens[:seqs]]
        for i, L in enumerate(self.layers):
            q, k, v = F.linear(rms(x, L["n1"]), L["qkv"], L["bias"]).split(
                [self.H * self.d, self.Hk * self.d, self.Hk * self.d], -1)
            q, k = rope(q.view(seqs, self.H, self.d), cos, sin), rope(k.view(seqs, self.Hk, self.d), cos, sin)
            keys, values = self.cache[i, 0, :seqs], self.cache[i, 1, :seqs]
            keys[:, :, context] = k
            values[:, :, context] = v.view(seqs, self.Hk, self.d)
            o = attend(q, keys[:, :, :context + 1], values[:, :, :context + 1])
            x = x + F.linear(o.reshape(seqs, self.H * self.d), L["o"])
            gate, up = F.linear(rms(x, L["n2"]), L["gate_up"]).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, L["down"])
        return F.linear(rms(x, self.norm), self.head).argmax(-1)


def graphed(fn):
    """`fn` captured as a CUDA graph (warmed up on a side stream first, as torch asks); returns its replay and the
    graph (kept alive by the caller)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay, graph


def fit(xs, ys) -> dict:
    """Least squares a + b x; b / a is the per-sequence share."""
    if len(xs) < 2:
        return dict(a=None, b=None, per_sequence=None)
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return dict(a=float(a), b=float(b), per_sequence=float(b / a) if a > 0 else None)


def decode(name: str, shape: dict, device, reduced: bool, budget: float | None):
    grid = DECODE_TOY if reduced else DECODE
    seqs, contexts = max(grid["sequences"]), max(grid["contexts"])
    cuda = device.type == "cuda"
    if cuda:  # the cache for the largest point, or fewer sequences where it would not fit beside the weights
        free_bytes = torch.cuda.mem_get_info(device)[0] - 2.2 * shape["params"] - 4e9
        per_seq = shape["layers"] * 2 * shape["num_key_value_heads"] * (contexts + 1) * (
            shape["hidden_size"] // shape["num_attention_heads"]) * 2
        while seqs > 1 and seqs * per_seq > free_bytes:
            seqs //= 2
    t_start = time.perf_counter()
    model = Decoder(shape, device, seqs, contexts)
    say("decode model", shape=name, weight_gigabytes=model.weight_bytes / 1e9,
        kv_cache_gigabytes=model.cache.numel() * 2 / 1e9, cache_sequences=seqs,
        kv_bytes_a_token=shape["layers"] * 2 * shape["num_key_value_heads"] * model.d * 2)
    for context in grid["contexts"]:
        for mode in ("eager", "graph") if cuda else ("eager",):
            done, times, note = [], [], None
            for n in grid["sequences"]:
                if n > seqs:
                    note = f"{n} sequences: their KV cache would not fit"
                    break
                if budget is not None and time.perf_counter() - t_start > budget:
                    note = f"stopped at the part's budget of {budget:g} s"
                    break
                with torch.no_grad():
                    fn = lambda: model.step(n, context)
                    try:
                        if mode == "graph":
                            fn, graph = graphed(fn)
                        times.append(timed(fn, device, repeat=10 if mode == "graph" else 5, warmup=2))
                    except Exception as e:  # noqa: BLE001 - a mode that fails is reported, the other still runs
                        note = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                        break
                    finally:
                        graph = None
                done.append(n)
            say("decode step", shape=name, context=context, mode=mode, sequences=done, seconds=times,
                **fit(done, times), note=note)
    del model
    free(device)


def decode_rho(state, device, reduced):
    decode("rho-math-1b", TOY_LLAMA if reduced else RHO, device, reduced, None if reduced else DECODE_BUDGET["rho"])


def decode_qwen(state, device, reduced):
    decode("Qwen2.5-7B", TOY if reduced else QWEN, device, reduced, None if reduced else DECODE_BUDGET["qwen"])


# --- the parts, each on its own ---------------------------------------------------------------------------------------
def parts() -> list:
    """(key, figure, function) in the order they run; looked up when called, so a test can replace one."""
    return [("apis", "torch APIs", api_report), ("write", "weight write into the shared copy", weight_write),
            ("host", "lag: weights to the host", lag_to_host), ("math", "MATH step peak memory", math_step),
            ("seeded", "seeded sampling a decoding step", seeded_sampling),
            ("decode-rho", "decode step", decode_rho), ("decode-qwen", "decode step", decode_qwen),
            ("gsm8k", "GSM8K training step", gsm8k_step)]


def main(argv=None) -> int:
    keys = [key for key, _, _ in parts()]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reduced", action="store_true", help="a toy's shapes (any machine, the CPU too)")
    p.add_argument("--parts", default=",".join(keys), help=f"the parts to run, comma-separated: {', '.join(keys)}")
    args = p.parse_args(argv)
    chosen = [k.strip() for k in args.parts.split(",") if k.strip()]
    unknown = [k for k in chosen if k not in keys]
    if unknown or not chosen:
        print(f"tools/gpu_probe.py: --parts {args.parts!r}: {'unknown ' + ', '.join(unknown) if unknown else 'none'} "
              f"(the parts: {', '.join(keys)})", file=sys.stderr)
        return 2
    if not args.reduced and not torch.cuda.is_available():  # Qwen2.5-7B's tensors on the CPU: the OOM killer, silently
        print("tools/gpu_probe.py: no CUDA device here; pass --reduced to run the same code at a toy's shapes on the "
              "CPU", file=sys.stderr)
        return NO_CUDA
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    import transformers
    say("machine", device=str(device), name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        memory_gigabytes=torch.cuda.get_device_properties(device).total_memory / 1e9 if device.type == "cuda" else None,
        torch=torch.__version__, cuda=torch.version.cuda, transformers=transformers.__version__,
        shapes="toy" if args.reduced else "Qwen2.5-7B, rho-math-1b", parts=chosen)
    import torch.distributed as dist
    from runtime import ranks
    made = not dist.is_initialized()  # a group of one, as the trainer has (FSDP2 needs one); a caller's is kept
    ranks.init_distributed(600, device.type)
    t0, state, failed = time.time(), {}, []
    for key, figure, run in parts():
        if key not in chosen:
            continue
        t = time.time()
        try:
            run(state, device, args.reduced)
        except Exception as e:  # noqa: BLE001 - one part's failure is its figure; the next part runs
            traceback.print_exc()
            first = str(e).splitlines()[0] if str(e) else ""
            say(figure, part=key, error=f"{type(e).__name__}: {first}")
            failed.append(key)
            state.clear()  # what it left (part 1's weights) is not trusted by the next
        free(device)
        say("timing", part=key, seconds=time.time() - t, ok=key not in failed)
    say("done", seconds=time.time() - t0, failed=failed)
    if made:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
