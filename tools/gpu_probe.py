"""What the GPU path costs at the paper's models' shapes, on one CUDA GPU with PyTorch and no vLLM (tests/gpu_lease.sh's
`probe` stage; not yet run on one); one JSON line a figure, printed as it is measured, each naming the torch, CUDA and
card that produced it ("on"; docs/gpu.md says what each means and what it cannot show).

    python tools/gpu_probe.py                    # on a GPU: Qwen2.5-7B's and rho-math-1b's shapes
    python tools/gpu_probe.py --reduced          # anywhere, the CPU too: the same code at a toy's shapes (tested)
    python tools/gpu_probe.py --parts gsm8k,math # some parts only, in the order given

Each part runs on its own: one that fails prints {"figure": its figure, "error": "<type>: <first line>"} (its
traceback on stderr) and the next one runs; one still running past its limit on a GPU (`parts`: a hang) has the
stacks of every thread dumped on stderr and ends the process (status 1), so that tests/gpu_lease.sh starts the parts
after it again. The exit status is 1 if any part failed (11: no CUDA device and no --reduced, refused before anything
is allocated). After each part a "timing" line gives its seconds. tools/gpu_checks.py runs the GPU path's own checks
through the same harness (`main`).

apis    Which torch APIs the GPU path calls exist on this torch (a lent GPU may have another torch than the pinned
        2.13): APIS.
write   runtime/weights.py's `write` of Qwen2.5-7B's 339 bf16 tensors into the shared copy on the GPU, against one
        device-to-device copy of the same bytes (`allocate` first: it goes through `allocator_settings`).
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
import faulthandler
import gc
import importlib
import json
import os
import signal
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

# what the GPU path calls of torch (runtime/weights.py, ranks.py, policy.py, nodes.py, this probe): a lent GPU may have
# another torch. "()" calls what is before it (torch.cuda.cudart() loads CUDA's runtime: a CUDA build only)
APIS = ("torch.cuda.cudart().cudaHostRegister", "torch.cuda.cudart().cudaHostUnregister",
        "torch.distributed.ProcessGroup._get_sequence_number_for_group",
        "torch.distributed.distributed_c10d._world.pg_map",
        "torch.distributed.distributed_c10d._set_pg_timeout", "torch.distributed.TCPStore",
        "torch.distributed.device_mesh.DeviceMesh.from_group", "torch.distributed.fsdp.fully_shard",
        "torch.distributed.fsdp.MixedPrecisionPolicy", "torch.distributed.fsdp.FSDPModule.reshard",
        "torch.distributed.fsdp.FSDPModule.set_reshard_after_forward", "torch.distributed.tensor.DTensor.full_tensor",
        "torch.distributed.tensor.DTensor.to_local", "torch.distributed._composable.checkpoint",
        "torch.distributed.checkpoint.state_dict.set_model_state_dict", "torch.optim.adam.adam",
        "torch._C._accelerator_getAllocatorSettings", "torch._C._accelerator_setAllocatorSettings",
        "torch.cuda.memory._set_allocator_settings", "torch.cuda._sleep", "torch.cuda.CUDAGraph",
        "torch.nn.functional.rms_norm")

NO_CUDA = 11  # the exit status of a run refused for want of a GPU (tests/gpu_lease.sh's for the same)


ON = None  # "torch X, CUDA Y, card": what produced the figures, named in each line once main knows it


def say(figure: str, **values):
    print(json.dumps(dict(figure=figure, **values, **({"on": ON} if ON else {}))), flush=True)


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


def exists(dotted: str) -> bool | str:
    """Whether `dotted` (torch.x.y) is there: its longest importable module (a submodule is an attribute of its
    package only once imported), then attributes; a name ending in "()" is called (what it raises is said instead)."""
    names = dotted.split(".")
    for i in range(len(names), 0, -1):
        try:
            obj = importlib.import_module(".".join(names[:i]))
            break
        except ImportError:
            continue
    for name in names[i:]:
        obj = getattr(obj, name.removesuffix("()"), None)
        if obj is None:
            return False
        if name.endswith("()"):
            try:
                obj = obj()
            except Exception as e:  # noqa: BLE001 - what this machine says is the figure
                return f"not checked: {name} raised {type(e).__name__}"
    return True


def gigabytes(n):
    return None if n is None else n / 1e9


# --- apis ------------------------------------------------------------------------------------------------------------
def api_report(state, device, reduced):
    """Which of APIS this torch has."""
    say("torch APIs", present={name: exists(name) for name in APIS})


# --- write ------------------------------------------------------------------------------------------------------------
def hf_shapes(shape: dict) -> dict:
    """{Hugging Face name: shape} of every tensor of a Qwen2 model of `shape` (a Llama's where it has no q/k/v
    biases): Qwen2.5-7B's 339."""
    h, f, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    d = h // shape["num_attention_heads"]
    rows = dict(q=shape["num_attention_heads"] * d, k=shape["num_key_value_heads"] * d,
                v=shape["num_key_value_heads"] * d)
    out = {"model.embed_tokens.weight": (v, h)}
    for i in range(shape["layers"]):
        at = f"model.layers.{i}."
        out[at + "input_layernorm.weight"] = (h,)
        for x, n in rows.items():
            out[at + f"self_attn.{x}_proj.weight"] = (n, h)
            if shape["qkv_bias"]:
                out[at + f"self_attn.{x}_proj.bias"] = (n,)
        out.update({at + "self_attn.o_proj.weight": (h, rows["q"]), at + "post_attention_layernorm.weight": (h,),
                    at + "mlp.gate_proj.weight": (f, h), at + "mlp.up_proj.weight": (f, h),
                    at + "mlp.down_proj.weight": (h, f)})
    out["model.norm.weight"] = (h,)
    if not shape["tie_word_embeddings"]:
        out["lm_head.weight"] = (v, h)
    return out


def named_weights(state, shape, device):
    """The model's bf16 weights, random (N(0, 0.02)), every tensor of its own shape (hf_shapes), made once for the
    parts that read them."""
    if "named" not in state:
        state["named"] = [(name, torch.empty(s, dtype=torch.bfloat16, device=device).normal_(0, 0.02))
                          for name, s in hf_shapes(shape).items()]
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
    state.pop("named")  # (15 GB on the GPU) no later part of this probe reads them
    say("weight write into the shared copy", tensors=len(named), seconds=write, plain_copy_seconds=copy,
        ratio=write / copy, gigabytes=nbytes / 1e9, note="write computes each tensor's fingerprint as it copies")


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
    out = two_steps(model, opt, lambda: tba.gradient(cfg)(model, [group], 0, 1, prompts, 0, device, cfg, beta=0.005), device, 1.0)
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
    out = two_steps(model, opt, lambda: tba.gradient(cfg)(model, groups, 0, 1, prompts, 0, device, cfg, beta=0.014), device, 0.0)
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
    """(key, figure, function, limit) of each part; looked up when called, so a test can replace one. The limit: the
    seconds a part may run on a GPU before it is taken for hung (its stacks dumped, the process ended), about three
    times what it is estimated to take on an H100 or H200, at least a minute; none with --reduced (any CPU)."""
    return [("apis", "torch APIs", api_report, 60), ("write", "weight write into the shared copy", weight_write, 60),
            ("math", "MATH step peak memory", math_step, 150),
            ("seeded", "seeded sampling a decoding step", seeded_sampling, 60),
            ("decode-rho", "decode step", decode_rho, 90), ("decode-qwen", "decode step", decode_qwen, 120),
            ("gsm8k", "GSM8K training step", gsm8k_step, 120)]


def main(argv=None, table=parts, limits=None, name="tools/gpu_probe.py") -> int:
    """Run the parts of `table()` that --parts names, in the order it names them, each under its limit (on a GPU:
    `limits` where given, {key: seconds}, for a test)."""
    global ON
    rows = {key: (figure, run, limit) for key, figure, run, limit in table()}
    p = argparse.ArgumentParser(prog=name)
    p.add_argument("--reduced", action="store_true", help="a toy's shapes (any machine, the CPU too)")
    p.add_argument("--parts", default=",".join(rows), help=f"the parts to run, in this order: {', '.join(rows)}")
    args = p.parse_args(argv)
    chosen = list(dict.fromkeys(k.strip() for k in args.parts.split(",") if k.strip()))
    limits = limits if limits is not None else {} if args.reduced else {key: row[2] for key, row in rows.items()}
    unknown = [k for k in chosen if k not in rows]
    if unknown or not chosen:
        print(f"{name}: --parts {args.parts!r}: {'unknown ' + ', '.join(unknown) if unknown else 'none'} "
              f"(the parts: {', '.join(rows)})", file=sys.stderr)
        return 2
    if not args.reduced and not torch.cuda.is_available():  # Qwen2.5-7B's tensors on the CPU: the OOM killer, silently
        print(f"{name}: no CUDA device here; pass --reduced to run the same code at a toy's shapes on the CPU",
              file=sys.stderr)
        return NO_CUDA
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    import transformers
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    ON = f"torch {torch.__version__}, CUDA {torch.version.cuda}, {card}"
    say("machine", device=str(device), name=card,
        memory_gigabytes=torch.cuda.get_device_properties(device).total_memory / 1e9 if device.type == "cuda" else None,
        torch=torch.__version__, cuda=torch.version.cuda, transformers=transformers.__version__,
        shapes="toy" if args.reduced else "Qwen2.5-7B, rho-math-1b", parts=chosen)
    import torch.distributed as dist
    from runtime import ranks
    made = not dist.is_initialized()  # a group of one, as the trainer has (FSDP2 needs one); a caller's is kept
    ranks.init_distributed(600, device.type)
    # stopped by `timeout`: where it was, then the end (the process's own stderr: faulthandler writes to a descriptor)
    faulthandler.register(signal.SIGTERM, file=sys.__stderr__, all_threads=True, chain=True)
    t0, state, failed = time.time(), {}, []
    try:
        for key in chosen:
            figure, run, _ = rows[key]
            t = time.time()
            if key in limits:
                faulthandler.dump_traceback_later(limits[key], exit=True, file=sys.__stderr__)  # a hang: stacks, exit 1
            try:
                run(state, device, args.reduced)
            except Exception as e:  # noqa: BLE001 - one part's failure is its figure; the next part runs
                traceback.print_exc()
                first = str(e).splitlines()[0] if str(e) else ""
                say(figure, part=key, error=f"{type(e).__name__}: {first}")
                failed.append(key)
                state.clear()  # what it left (part 1's weights) is not trusted by the next
            finally:
                faulthandler.cancel_dump_traceback_later()
            free(device)
            say("timing", part=key, seconds=time.time() - t, ok=key not in failed)
    finally:
        faulthandler.unregister(signal.SIGTERM)
    say("done", seconds=time.time() - t0, failed=failed)
    if made:
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
