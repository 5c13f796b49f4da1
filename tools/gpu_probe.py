"""What the GPU path costs at Qwen2.5-7B's shapes, on one CUDA GPU with PyTorch and no vLLM, in under 4 minutes;
one JSON line a figure (docs/gpu.md says what each means and what it cannot show).

    python tools/gpu_probe.py               # on a GPU: Qwen2.5-7B's shapes (about 70 GB of GPU memory at its peak)
    python tools/gpu_probe.py --reduced     # anywhere, the CPU too: the same code at a toy's shapes (a test runs it)

1. The weight path (runtime/weights.py): `write` of the bf16 weights into the shared copy on the trainer's GPU,
   against one device-to-device copy of the same bytes; and --lag's copy of them to the host, into pageable
   memory (a fresh tensor, as before the ring) against pinned memory allocated once (`Outbox.keep`'s ring).
2. One MATH training step (tba.backward, --micro-batch 1, the group's statistics pass too, AdamW) of a model of
   Qwen2.5-7B's width with 1 and 3 decoder blocks (random weights from its published config: no download), on
   one rank: the peak of allocated GPU memory, and its growth a block (tools/memory.py's formula, measured).
3. vLLM's per-request seeded sampling: it draws each seeded request's exponential noise one row at a time
   (vllm/v1/sample/ops/topk_topp_sampler.py:555-577); that loop at 256 sequences of Qwen's vocabulary, against
   one draw for all rows (unseeded), per decoding step.
"""

import argparse
import json
import os
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

import numpy as np
import torch

QWEN = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
            vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=False,
            params=7.62e9, layers=28)  # Qwen/Qwen2.5-7B's config.json
TOY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
           max_position_embeddings=512, rope_theta=1e4, tie_word_embeddings=False, params=2e6, layers=2)


def say(figure: str, **values):
    print(json.dumps(dict(figure=figure, **values)), flush=True)


def timed(fn, device, repeat: int = 3) -> float:
    """The median seconds of `fn()`, the device synchronised around each."""
    times = []
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weight_path(shape: dict, device):
    """1: the bf16 weights as a few large tensors of the model's total size (one block's shapes repeated)."""
    import multiprocessing as mp
    from runtime import weights
    h, f, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    block = {"q": (h, h), "kv": (2 * h // 7 if h % 7 == 0 else h // 2, h), "o": (h, h), "up": (2 * f, h), "down": (h, f)}
    per_block = sum(a * b for a, b in block.values())
    layers = max(1, int((shape["params"] - 2 * v * h) / per_block))
    named = [("embed", torch.randn(v, h, dtype=torch.bfloat16, device=device)),
             ("head", torch.randn(v, h, dtype=torch.bfloat16, device=device))]
    named += [(f"{i}.{k}", torch.randn(s, dtype=torch.bfloat16, device=device)) for i in range(layers)
              for k, s in block.items()]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    shared = weights.create(mp.get_context("spawn"))
    weights.allocate(shared, named, {}, device, torch.bfloat16)
    write = timed(lambda: weights.write(shared, named, 1, lambda: None, 600), device)
    flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    source = torch.empty_like(flat)
    copy = timed(lambda: flat.copy_(source), device)
    del flat, source
    say("weight write into the shared copy", seconds=write, plain_copy_seconds=copy, ratio=write / copy,
        gigabytes=nbytes / 1e9)
    pinned = {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=device.type == "cuda") for n, t in named}

    def to_pinned():
        for n, t in named:
            pinned[n].copy_(t, non_blocking=True)
    pageable = timed(lambda: [t.to("cpu", copy=True) for _, t in named], device, repeat=2)
    ring = timed(to_pinned, device, repeat=2)
    say("lag: weights to the host", pageable_seconds=pageable, pinned_seconds=ring, speedup=pageable / ring,
        gigabytes=nbytes / 1e9)
    del named, shared, pinned


def math_step(shape: dict, device, blocks: int, tokens: int, K: int) -> int:
    """2: one step of --micro-batch 1 over one group of K responses (prompt 256 tokens, responses up to `tokens`),
    TBA′'s loss, AdamW; the peak of allocated memory in bytes."""
    import dataclasses
    import tba
    from buffer import Trajectory
    from runtime import policy
    from runtime.config import Config
    from transformers import Qwen2Config, Qwen2ForCausalLM
    config = Qwen2Config(**{k: v for k, v in shape.items() if k not in ("params", "layers")}, num_hidden_layers=blocks)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model = model.to_empty(device=device).float()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model.config.use_cache = False
    policy.recompute_blocks(model, {"Qwen2DecoderLayer"})
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    import torch.distributed as dist
    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                                     reduce_dtype=torch.float32)
    for m in [m for m in model.modules() if type(m).__name__ == "Qwen2DecoderLayer"]:
        fully_shard(m, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    opt = policy.AdamW(model.parameters(), lr=1e-6)
    rng = np.random.default_rng(0)
    v = shape["vocab_size"]
    lengths = np.linspace(tokens // 2, tokens, K).astype(int)
    group = [Trajectory(0, rng.integers(4, v, int(n)).astype(np.int32), float(i % 2), -5.0, -5.0, 0,
                        behaviour_logps=np.full(int(n), -2.0, np.float32), ref_logps=np.full(int(n), -2.0, np.float32))
             for i, n in enumerate(lengths)]
    prompts = [rng.integers(4, v, 256).tolist()]
    cfg = dataclasses.replace(Config(samples_per_prompt=K, micro_batch=1, loss="tbprime", norm="sequence",
                                     max_new_tokens=tokens), temperature=1.0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tba.backward(model, [group], 1, prompts, 0, device, cfg, 0.005)
    opt.step()
    opt.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None  # no allocator on the CPU
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return peak


def seeded_sampling(shape: dict, device, rows: int = 256):
    """3: vLLM's random_sample with a generator a request against none."""
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reduced", action="store_true", help="a toy's shapes (any machine, the CPU too)")
    args = p.parse_args(argv)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shape = TOY if args.reduced else QWEN
    say("machine", device=str(device), name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__, shapes="toy" if args.reduced else "Qwen2.5-7B")
    with socket.socket() as s:  # a process group of one, as the trainer has (FSDP2 needs one)
        s.bind(("127.0.0.1", 0))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(s.getsockname()[1]))
    from runtime import ranks
    ranks.init_distributed(600, device.type)
    t0 = time.time()
    weight_path(shape, device)
    tokens, K = (32, 4) if args.reduced else (4096 - 256, 16)
    peaks = {blocks: math_step(shape, device, blocks, tokens, K) for blocks in (1, 3)}
    if device.type == "cuda":
        per_block = (peaks[3] - peaks[1]) / 2
        say("MATH step peak memory", blocks={str(b): peaks[b] / 1e9 for b in peaks}, per_block_gigabytes=per_block / 1e9,
            at_all_blocks_gigabytes=(peaks[1] + (shape["layers"] - 1) * per_block) / 1e9, unit="GB",
            note="one rank, unsharded: on 4 ranks its weights, gradients and AdamW are a quarter of their share")
    else:
        say("MATH step peak memory", blocks={"1": None, "3": None}, note="ran; the CPU keeps no allocator statistics")
    seeded_sampling(shape, device)
    say("done", seconds=time.time() - t0)
    import torch.distributed as dist
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
