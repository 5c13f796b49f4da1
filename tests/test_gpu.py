"""The GPU path without vLLM: FSDP2 over NCCL in bf16 (float32 or bf16 weights, with or without activation
checkpointing), the on-device gather into shared CUDA tensors, their CUDA IPC handoff, the leaders' gloo
group beside NCCL, AdamW's float32 moments under bf16 weights, chunked log-probs on the GPU, the GPU
refusals of `gpu.check_gpus`, a searcher GPU's memory split, and `weights.allocator_for_sharing` under
expandable segments.

Tests marked `needs_gpu` (pytest's `cuda` marker, and the "cuda" cases of the others) are skipped when no CUDA
device is visible (tests/conftest.py); they need PyTorch with CUDA, transformers where a model is built, and never vLLM. The rest runs on
the CPU too, in CI: the refusals of `check_gpus`, the memory split and the allocator-settings rewrite
(CUDA queries faked), and the "cpu" cases of the handoff, FSDP2 (one gloo rank), the leaders' group
(two gloo ranks), AdamW and chunked log-prob tests, and a CPU run where CUDA looks present (it stays on the
CPU: gloo, FSDP2's mesh on the CPU).
On a GPU `bash tests/gpu_lease.sh` runs the `cuda` ones (`pytest -m cuda`).

Every spawned process reports through a queue and every wait has a deadline; the processes that
hold CUDA IPC tensors (producers) outlive their consumers, which are joined first (torch keeps a
sent block until the consumer's reference counter drops: torch/include/torch/csrc/CudaIPCTypes.h:
22-75; it is the consumer's mapping of the producer's memory, torch/multiprocessing/reductions.py:
153-219, so it is only valid while the producer lives).
"""

import copy
import os
import shutil
import socket
import subprocess
import time
import traceback
import types

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from runtime import checkpoint
from runtime import checks
from runtime import gpu
from runtime import ranks
from runtime import policy
import tba
from runtime.config import Config
from runtime import weights
from runtime.errors import ConfigError, Dead
from loss import collate, sequence_logprobs
from conftest import get_report

needs_gpu = pytest.mark.cuda  # skipped without a CUDA device (tests/conftest.py)
TIMEOUT = 120.0  # s: any wait on a spawned process (first CUDA/NCCL start-up included)


def parent_alive():
    parent = mp.parent_process()
    if parent is not None and not parent.is_alive():
        raise Dead("the test process is gone")


def finish(procs, stop=None):
    if stop is not None:
        stop.set()
    for p in procs:
        p.join(timeout=30)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=10)


def reader_device(kind="cuda") -> str:
    """Where a searcher's engine would be: another GPU when there is one (searcher i on GPU ranks + i)."""
    if kind == "cpu":
        return "cpu"
    return "cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0"


KINDS = ["cpu", pytest.param("cuda", marks=needs_gpu)]


# ===== gpu.check_gpus: refusals (CUDA queries faked: runs anywhere) ==============================
def fake_gpus(monkeypatch, capabilities, mode=0):
    """torch sees len(capabilities) GPUs with these compute capabilities; NVML says GPU 0 is in
    compute mode `mode`. Returns the indices compute_mode was asked about."""
    asked = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(capabilities))
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: capabilities[0 if device is None else int(device)])
    monkeypatch.setattr(gpu, "compute_mode", lambda index: asked.append(index) or mode)
    return asked


def test_bfloat16_is_refused_below_compute_capability_8(monkeypatch):
    fake_gpus(monkeypatch, [(7, 0), (7, 0)])
    cfg = types.SimpleNamespace(searchers=1, dtype="bfloat16")
    with pytest.raises(ConfigError, match=r"--dtype: bfloat16 needs compute capability 8\.0 .*GPU 0 has 7\.0"):
        gpu.check_gpus(cfg, local=1)


def test_auto_dtype_follows_the_oldest_gpu_used(monkeypatch):
    fake_gpus(monkeypatch, [(7, 0), (7, 0)])
    cfg = types.SimpleNamespace(searchers=1, dtype="auto")
    assert gpu.check_gpus(cfg, local=1) == "float16"
    fake_gpus(monkeypatch, [(9, 0), (7, 5), (9, 0)])  # the searcher's GPU 1 is the old one
    cfg = types.SimpleNamespace(searchers=1, dtype="auto")
    assert gpu.check_gpus(cfg, local=1) == "float16"
    with pytest.raises(ConfigError, match=r"GPU 1 has 7\.5"):
        gpu.check_gpus(types.SimpleNamespace(searchers=1, dtype="bfloat16"), local=1)
    fake_gpus(monkeypatch, [(9, 0), (8, 0)])
    cfg = types.SimpleNamespace(searchers=1, dtype="auto")
    assert gpu.check_gpus(cfg, local=1) == "bfloat16"


def test_exclusive_process_gpu0_is_refused_with_searchers(monkeypatch):
    asked = fake_gpus(monkeypatch, [(9, 0), (9, 0)], mode=3)  # NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    with pytest.raises(ConfigError, match="EXCLUSIVE_PROCESS"):
        gpu.check_gpus(types.SimpleNamespace(searchers=1, dtype="auto"), local=1)
    assert asked == [0]  # the trainer's GPU, where the searchers open the shared weights
    asked.clear()
    cfg = types.SimpleNamespace(searchers=0, dtype="auto")  # the trainer alone on GPU 0: allowed
    assert gpu.check_gpus(cfg, local=1) == "bfloat16" and asked == []
    fake_gpus(monkeypatch, [(9, 0), (9, 0)], mode=None)  # no NVML: nothing to refuse
    gpu.check_gpus(types.SimpleNamespace(searchers=1, dtype="auto"), local=1)


def test_too_few_gpus_are_refused(monkeypatch):
    fake_gpus(monkeypatch, [(9, 0), (9, 0)])
    with pytest.raises(ConfigError, match=r"1 searcher\(s\) \+ 2 trainer rank\(s\) on this node need 3 GPUs on it, 2 visible"):
        gpu.check_gpus(types.SimpleNamespace(searchers=1, dtype="auto"), local=2)


@pytest.mark.engine
@needs_gpu
def test_compute_mode_finds_the_gpu_by_uuid():
    """compute_mode maps a torch ordinal to NVML by UUID, prefixing torch's bare UUID with "GPU-":
    the result must be one of nvidia-smi's UUIDs, and (with nvidia-ml-py installed, never importing
    vLLM here) the mode must be nvidia-smi's."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        pytest.skip("nvidia-smi not found")
    if "MIG-" in subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60).stdout:
        pytest.skip("MIG instances: torch sees MIG devices, nvidia-smi --query-gpu lists their parent GPUs")
    rows = subprocess.run([smi, "--query-gpu=uuid,compute_mode", "--format=csv,noheader"], capture_output=True,
                          text=True, timeout=60, check=True).stdout.splitlines()
    modes = {u.strip(): m.strip() for u, m in (row.split(",") for row in rows if row.strip())}
    for i in range(torch.cuda.device_count()):
        uuid = str(torch.cuda.get_device_properties(i).uuid)
        uuid = uuid if uuid.startswith("GPU-") else "GPU-" + uuid  # as gpu.compute_mode does
        assert uuid in modes, f"torch device {i}: {uuid} is not among nvidia-smi's {sorted(modes)}"
    try:
        import pynvml  # noqa: F401  (compute_mode would fall back to vllm.third_party.pynvml: not here)
    except ImportError:
        return
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    mode = modes[uuid if uuid.startswith("GPU-") else "GPU-" + uuid]
    assert gpu.compute_mode(0) == {"Default": 0, "Prohibited": 2, "Exclusive_Process": 3}[mode]


# ===== weights.allocator_for_sharing ===========================================================
def fake_allocator(monkeypatch, conf):
    """The allocator settings read `conf`; returns the list of strings written."""
    written = []
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: conf)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", written.append)
    return written


@pytest.mark.engine
@pytest.mark.parametrize("conf,inside", [
    ("expandable_segments:True", "expandable_segments:False"),
    ("expandable_segments:True,max_split_size_mb:256", "expandable_segments:False,max_split_size_mb:256"),
    (" garbage_collection_threshold:0.6 , expandable_segments : true ,max_split_size_mb:64",
     "garbage_collection_threshold:0.6,expandable_segments:False,max_split_size_mb:64"),
    ("max_split_size_mb:128,expandable_segments:1", "max_split_size_mb:128,expandable_segments:False"),
])
def test_allocator_settings_are_rewritten_whole_and_restored(monkeypatch, conf, inside):
    """The setter resets every option it is not given (notes: vllm/device_allocator/alloc_conf.py),
    so the whole string is written back with only expandable_segments flipped, then the original."""
    written = fake_allocator(monkeypatch, conf)
    with weights.allocator_for_sharing("cuda:0"):
        assert written == [inside]
    assert written == [inside, conf]
    written.clear()
    with pytest.raises(KeyError):
        with weights.allocator_for_sharing(torch.device("cuda", 1)):
            raise KeyError("inside")
    assert written == [inside, conf]  # restored on an error too


@pytest.mark.parametrize("conf", ["", "expandable_segments:False", "max_split_size_mb:256,expandable_segments:false"])
def test_allocator_settings_untouched_without_expandable_segments(monkeypatch, conf):
    written = fake_allocator(monkeypatch, conf)
    with weights.allocator_for_sharing("cuda:0"):
        pass
    assert written == []


def test_allocator_settings_not_read_for_the_cpu(monkeypatch):
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: pytest.fail("read for the CPU"))
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda s: pytest.fail("written for the CPU"))
    with weights.allocator_for_sharing("cpu"):
        pass


def expandable_producer(tensors, done, report):
    """Under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (from the environment, read before
    CUDA starts): a tensor allocated inside allocator_for_sharing lives in a plain cudaMalloc
    segment, one allocated outside in an expandable one; send the first to a consumer."""
    try:
        def expandable(t):  # is the allocator's segment holding t expandable? (None: not found)
            ptr = t.data_ptr()  # SegmentInfo.is_expandable, torch/include/c10/core/CachingDeviceAllocator.h:106,
            # is the snapshot's "is_expandable" (torch/csrc/cuda/Module.cpp, not in the wheel)
            for seg in torch.cuda.memory_snapshot():
                if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
                    return seg["is_expandable"]
            return None

        conf = torch._C._accelerator_getAllocatorSettings()
        outside = torch.ones(2**20, device="cuda:0")  # 4 MiB: large pool
        with weights.allocator_for_sharing("cuda:0"):
            inside_conf = torch._C._accelerator_getAllocatorSettings()
            shared = torch.arange(2**20, dtype=torch.float32, device="cuda:0")
        torch.cuda.synchronize()
        report.put(dict(conf=conf, inside_conf=inside_conf, after_conf=torch._C._accelerator_getAllocatorSettings(),
                        outside_expandable=expandable(outside), inside_expandable=expandable(shared),
                        any_expandable=any(seg["is_expandable"] for seg in torch.cuda.memory_snapshot())))
        tensors.put(shared)
        deadline = time.monotonic() + TIMEOUT
        while not done.wait(timeout=1.0):  # the producer keeps `shared` alive while the consumer reads it
            parent_alive()
            assert time.monotonic() < deadline, "the consumer never finished"
    except BaseException:
        report.put({"error": traceback.format_exc()})


def expandable_consumer(tensors, report, device):
    try:
        torch.cuda.set_device(device)
        t = tensors.get(timeout=TIMEOUT)
        same = torch.equal(t.to(device).cpu(), torch.arange(2**20, dtype=torch.float32))
        report.put(dict(device=str(t.device), equal=same))
        del t
    except BaseException:
        report.put({"error": traceback.format_exc()})


@pytest.mark.engine
@needs_gpu
def test_tensors_allocated_for_sharing_avoid_expandable_segments(monkeypatch):
    ctx = mp.get_context("spawn")
    tensors, done, report = ctx.Queue(), ctx.Event(), ctx.Queue()
    # in the children's environment from their start, before CUDA reads it
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    producer = ctx.Process(target=expandable_producer, args=(tensors, done, report), daemon=True)
    consumer = ctx.Process(target=expandable_consumer, args=(tensors, report, reader_device()), daemon=True)
    producer.start()
    try:
        r = get_report(report, [producer], TIMEOUT)
        assert "expandable_segments:True" in r["conf"] and r["after_conf"] == r["conf"]
        assert "expandable_segments:False" in r["inside_conf"]
        assert r["outside_expandable"] or (r["outside_expandable"] is None and r["any_expandable"]), \
            "the environment did not turn expandable segments on: the check proves nothing"
        assert r["inside_expandable"] is False, "a tensor allocated for sharing lives in an expandable segment"
        consumer.start()
        r = get_report(report, [consumer], TIMEOUT)
        assert r == dict(device="cuda:0", equal=True)
        consumer.join(timeout=30)  # the consumer goes first: then the producer may free the tensor
    finally:
        done.set()
        finish([consumer, producer] if consumer.pid else [producer])


# ===== the CUDA IPC handoff to a searcher ========================================================
def exact(shape, seed):
    """Values exactly representable in bf16 (k / 4 for integers |k| <= 256: at most 8 significant
    bits, bf16's precision): comparisons are exact."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-256, 257, shape, generator=g).float() / 4


def handoff_reader(shared, stop, out, device):
    """A searcher's side without vLLM: receive the tensors, then report what it reads under the lock
    each time the policy or reference version moves (3 reports), then wait to be stopped."""
    try:
        torch.set_num_threads(1)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        weights.receive(shared, stop, parent_alive)
        assert shared.tensors is not None, "stopped before the handoff"
        last, deadline = None, time.monotonic() + TIMEOUT
        for _ in range(3):
            while (shared.version.value, shared.pi_ref_version.value) == last:
                if stop.is_set():
                    return
                parent_alive()
                assert time.monotonic() < deadline, "no new version"
                time.sleep(0.01)
            with weights.reading(shared, 0, parent_alive, TIMEOUT, device):
                last = (shared.version.value, shared.pi_ref_version.value)
                read = lambda ts: {n: t.to(device).float().cpu().tolist() for n, t in ts.items()}  # noqa: E731
                # tied names: pickled once, and a handle already open maps to the same storage
                # (torch/multiprocessing/reductions.py:173-196): one tensor, as in the trainer
                tied = shared.tensors["lm_head.weight"].data_ptr() == shared.tensors["embed.weight"].data_ptr()
                out.put(dict(version=last[0], pi_ref_version=last[1], values=read(shared.tensors), ref=read(shared.pi_ref),
                             devices=sorted({str(t.device) for t in [*shared.tensors.values(), *shared.pi_ref.values()]}),
                             dtypes=sorted({str(t.dtype) for t in shared.tensors.values()}), tied=tied))
        while not stop.wait(timeout=1.0):
            parent_alive()
            assert time.monotonic() < deadline, "never stopped"
    except BaseException:
        out.put({"error": traceback.format_exc()})


@pytest.mark.engine
@pytest.mark.parametrize("kind", KINDS)
def test_handoff_of_shared_tensors_to_a_spawned_reader(kind):
    """As tba.run: the reader is spawned first, the tensors (bf16 as on GPUs, with a tied name and
    TBA′'s ref set) go through `handoff`, on a GPU as CUDA IPC handles of tensors on cuda:0 (CPU:
    shared memory); the reader sees each publish."""
    device = torch.device("cuda:0" if kind == "cuda" else "cpu")
    ctx = mp.get_context("spawn")
    shared = weights.create(ctx)
    stop, out = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=handoff_reader, args=(shared, stop, out, reader_device(kind)), daemon=True)
    proc.start()

    def alive():
        if proc.exitcode is not None:
            raise Dead(f"reader died with exit code {proc.exitcode}")

    def expected(named):
        return {**{n: t.tolist() for n, t in named}, "lm_head.weight": dict(named)["embed.weight"].tolist()}

    try:
        first = [("embed.weight", exact((16, 8), 0)), ("norm.weight", exact((8,), 1))]
        weights.allocate(shared, [(n, t.to(device)) for n, t in first], {"lm_head.weight": "embed.weight"},
                         device, torch.bfloat16, with_pi_ref=True)
        shared.handoff.put((shared.tensors, shared.pi_ref, shared.prints))
        r = get_report(out, [proc], TIMEOUT)
        assert (r["version"], r["pi_ref_version"]) == (0, 0)
        assert r["values"] == expected(first) and r["ref"] == expected(first)
        assert r["devices"] == [str(device)] and r["dtypes"] == ["torch.bfloat16"] and r["tied"]

        second = [("embed.weight", exact((16, 8), 2)), ("norm.weight", exact((8,), 3))]
        weights.write(shared, [(n, t.to(device)) for n, t in second], 5, alive, TIMEOUT)
        r = get_report(out, [proc], TIMEOUT)
        assert (r["version"], r["pi_ref_version"]) == (5, 0)
        assert r["values"] == expected(second) and r["ref"] == expected(first)  # the tied name moved with its tensor

        weights.write(shared, [(n, t.to(device)) for n, t in second], 5, alive, TIMEOUT, to=("pi_ref",))
        r = get_report(out, [proc], TIMEOUT)
        assert (r["version"], r["pi_ref_version"]) == (5, 5) and r["ref"] == expected(second)
    finally:
        finish([proc], stop)  # the consumer first; only then may the shared tensors go
        shared.handoff.cancel_join_thread()
        shared.tensors = shared.pi_ref = None


# ===== FSDP2 in bf16 (NCCL on GPUs), and the on-device gather into the shared tensors ===========
def compare(shared: weights.SharedWeights, full: dict, dtype, device) -> list[str]:
    """Names whose shared tensor differs from the full state dict (float32: exactly; bf16: by more
    than its rounding, half an ulp = 2^-9 relative, bound taken as 2^-8)."""
    bad = []
    for name, want in full.items():
        have = shared.tensors.get(name)
        if have is None or have.dtype != dtype or have.device != device or have.shape != want.shape:
            bad.append(f"{name}: {None if have is None else (have.dtype, have.device, tuple(have.shape))}")
            continue
        have, want = have.cpu().float(), want.float()
        ok = (torch.equal(have, want) if dtype == torch.float32
              else bool(((have - want).abs() <= want.abs() * 2**-8).all()))
        if not ok:
            bad.append(f"{name}: max |diff| {(have - want).abs().max().item():.3g}")
    return bad


def fsdp_rank(kind, rank, world, port, path, results, weights_dtype="float32", recompute=False):
    """One trainer rank: tba's own init, load_policy (FSDP2, bf16 compute; `weights_dtype` weights, activation
    checkpointing if `recompute`), one backward/clip/policy.AdamW step on a batch of trajectories, and the
    gather into shared tensors on rank 0 (float32 and bf16), compared with checkpoint.full_state_dict before
    and after the step; the AdamW moments' dtype and kind."""
    import torch.distributed as dist
    from buffer import Trajectory
    try:
        torch.set_num_threads(1)  # a tiny model: OpenMP threads only spin on a shared CPU
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cfg = Config(model=path, prompts_per_step=2 * world, samples_per_prompt=4, temperature=0.7,
                         micro_batch=4, timeout=TIMEOUT)
        got = ranks.init_distributed(cfg.timeout, kind)  # "cpu": gloo, even on a GPU node
        assert got == (rank, world, rank), got
        device = torch.device(f"cuda:{rank}" if kind == "cuda" else "cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)  # as tba.run, after init_distributed
        model = policy.load_policy(path, device, "bfloat16", weights_dtype, recompute)
        out = {"rank": rank}

        ctx = mp.get_context("spawn")
        dtypes = (torch.float32, torch.bfloat16)
        shared = {dt: weights.create(ctx) for dt in dtypes} if rank == 0 else {}
        for dt in dtypes:  # the initial weights, as tba.run allocates them
            named = weights.gather(model)
            if rank == 0:
                weights.allocate(shared[dt], named, weights.aliases(model), device, dt)
            for _ in named:  # ranks > 0 take part in every all-gather
                pass
        before = {k: v.clone() for k, v in checkpoint.full_state_dict(model).items()}  # all ranks; rank 0 gets it
        # (cloned: on the CPU with one rank the "copy" would be the parameters themselves)
        if rank == 0:
            out["aliases"] = weights.aliases(model)
            out["initial"] = {str(dt): compare(shared[dt], before, dt, device) for dt in dtypes}

        rng = np.random.default_rng(0)  # the same batch on every rank; each takes its slice
        prompts = [rng.integers(4, 90, size=int(n)).tolist() for n in rng.integers(5, 12, size=8)]
        B, K = cfg.prompts_per_step, cfg.samples_per_prompt
        batch = [[Trajectory(int(p), rng.integers(4, 90, size=int(rng.integers(2, 7))).astype(np.int32),
                             float(rng.integers(2)), -5.0, -5.0, 0) for _ in range(K)]
                 for p in rng.choice(len(prompts), B, replace=False)]
        # the logits' dtype, seen inside the training forward. (Not a separate forward under no_grad just
        # before the step: FSDP2 keeps the root group's parameters, embeddings and final norm, gathered after
        # one (torch/distributed/fsdp/_fully_shard/_fully_shard.py:453-466), and with 2 gloo ranks the
        # following AdamW step left them unchanged. tba's own forwards without gradient, tba.backward's
        # statistics passes, pooled or not, come before passes with gradient, whose backward reshards;
        # policy.LaggedCopy's (--behaviour-logprobs trainer) run on its own copy, resharded after each.)
        seen = []
        hook = model.lm_head.register_forward_hook(lambda module, args, output: seen.append(str(output.dtype)))
        # as the Trainer's (torch's own AdamW for float32 weights); 1e-2: bf16 norm weights of 1 move
        opt = policy.AdamW.for_weights(list(model.parameters()), lr=1e-2, weight_decay=0.0)
        sums = tba.gradient(cfg)(model, batch, rank, world, prompts, 0, device, cfg, beta=cfg.beta)
        hook.remove()
        out["logits_dtype"] = sorted(set(seen))
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor under FSDP2
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["moments"] = sorted({f"{type(v).__name__} {v.dtype}" for s in opt.state.values()
                                 for k, v in s.items() if k.startswith("exp_avg")})
        out["weights"] = sorted({f"{type(p).__name__} {p.dtype}" for p in model.parameters()})
        out.update(loss=sums["loss"] / sums["prompts"], grad_norm=float(norm), prompts=sums["prompts"])

        for dt in dtypes:  # publish: every rank gathers, rank 0 copies under the lock
            named = weights.gather(model)
            if rank == 0:
                weights.write(shared[dt], named, 1, lambda: None, TIMEOUT)
            for _ in named:
                pass
        after = checkpoint.full_state_dict(model)
        if rank == 0:
            out["published"] = {str(dt): compare(shared[dt], after, dt, device) for dt in dtypes}
            out["versions"] = [shared[dt].version.value for dt in dtypes]
            out["unmoved"] = [k for k in after if torch.equal(before[k], after[k])]
            out["tied"] = all(shared[dt].tensors[a].data_ptr() == shared[dt].tensors[f].data_ptr()
                              for dt in dtypes for a, f in out["aliases"].items())
        results.put(out)
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.engine
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recomputed"])
@pytest.mark.parametrize("weights_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
def test_fsdp2_bf16_step_and_gather_into_shared_tensors(kind, weights_dtype, recompute, tmp_path):
    """GPU: NCCL (tba's "cpu:gloo,cuda:nccl"), 2 ranks with 2+ GPUs. CPU: one gloo rank, the same checks. Over
    --trainer-dtype and --activation-checkpointing; AdamW's moments are float32 DTensors either way."""
    pytest.importorskip("transformers")
    from runtime import tiny
    path = str(tmp_path / "model")
    tiny.make_model(path, hidden=64, layers=2, heads=2)  # a tied Llama
    world = min(2, torch.cuda.device_count()) if kind == "cuda" else 1  # NCCL: one GPU per rank
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=fsdp_rank, args=(kind, r, world, port, path, results, weights_dtype, recompute),
                         daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        outs = sorted((get_report(results, procs, 300) for _ in procs), key=lambda o: o["rank"])
    finally:
        finish(procs)
    for o in outs:
        assert np.isfinite(o["loss"]) and np.isfinite(o["grad_norm"]) and o["grad_norm"] > 0, o
        assert o["logits_dtype"] == ["torch.bfloat16"], o  # FSDP2's MixedPrecisionPolicy computes in bf16
        assert o["prompts"] == 2
        assert o["moments"] == ["DTensor torch.float32"] and o["weights"] == [f"DTensor torch.{weights_dtype}"], o
    head = outs[0]
    assert head["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert head["initial"] == {"torch.float32": [], "torch.bfloat16": []}
    assert head["published"] == {"torch.float32": [], "torch.bfloat16": []}
    assert head["versions"] == [1, 1] and head["tied"]
    assert head["unmoved"] == [], f"the step left these tensors unchanged: {head['unmoved']}"
    assert [p.exitcode for p in procs] == [0] * world


# ===== a CPU run on a GPU node stays on the CPU ======================================================
def look_like_a_gpu_node():
    """What a CUDA build on a GPU node tells this process: CUDA is the accelerator torch was built for, and it
    is available (one device). fully_shard without a mesh takes that accelerator and moves a CPU model to
    cuda (runtime/policy.py cites the lines); letting FSDP2 choose its own mesh at all fails here."""
    from torch.distributed.fsdp._fully_shard import _fully_shard
    torch._C._get_accelerator = lambda check=False: torch.device("cuda")
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1

    def chose(*args, **kwargs):
        raise AssertionError("fully_shard was given no mesh: it would take the accelerator's")
    _fully_shard._init_default_mesh = chose


def cpu_rank_on_a_gpu_node(port, path, results):
    """One rank of a CPU run where CUDA looks present: its group's backend, where load_policy leaves the
    model (bf16 compute), and where a training forward and backward run."""
    import torch.distributed as dist
    try:
        torch.set_num_threads(1)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        look_like_a_gpu_node()  # before anything of torch.distributed starts, as a spawned rank there would be
        assert torch._C._get_accelerator().type == "cuda" and torch.cuda.is_available()
        ranks.init_distributed(TIMEOUT, "cpu")
        model = policy.load_policy(path, torch.device("cpu"), "bfloat16", recompute=True)
        logits = model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits
        logits.float().sum().backward()
        results.put(dict(backend=str(dist.get_backend()), mesh=next(model.parameters()).device_mesh.device_type,
                         params=sorted({p.to_local().device.type for p in model.parameters()}),
                         grads=sorted({p.grad.to_local().device.type for p in model.parameters()}),
                         logits=(str(logits.device), str(logits.dtype))))
    except BaseException:
        results.put({"error": traceback.format_exc()})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.engine
def test_a_cpu_run_stays_on_the_cpu_where_cuda_is_the_accelerator(tmp_path):
    """On a GPU node the "cpu" cases of these tests (and tools/memory.py) ran on cuda:0: fully_shard without a
    mesh took CUDA, torch's accelerator there, and the backend came from torch.cuda.is_available(). Faked
    here in the spawned rank: the group is gloo, FSDP2's mesh is the CPU's, and the model, its gradients and
    its logits stay on the CPU."""
    from runtime import tiny
    path = str(tmp_path / "model")
    tiny.make_model(path, hidden=64, layers=2, heads=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=cpu_rank_on_a_gpu_node, args=(port, path, results), daemon=True)
    proc.start()
    try:
        out = get_report(results, [proc], 300)
    finally:
        finish([proc])
    assert out == dict(backend="gloo", mesh="cpu", params=["cpu"], grads=["cpu"], logits=("cpu", "torch.bfloat16"))
    assert proc.exitcode == 0


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu-machine", "gpu-node"])
def test_the_backend_follows_the_runs_device_not_the_machine(monkeypatch, cuda):
    """init_distributed's backend is the run's device's: gloo for "cpu" even where torch.cuda.is_available()
    says True, NCCL beside gloo for "cuda"; a device it does not know is refused."""
    import torch.distributed as dist
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: int(cuda))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: asked.append(backend))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(dist.distributed_c10d, "_set_pg_timeout", lambda timeout: None)
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
        monkeypatch.setenv(name, value)
    assert ranks.init_distributed(60, "cpu") == (0, 1, 0)
    assert ranks.init_distributed(60, "cuda") == (0, 1, 0)
    assert asked == ["gloo", "cpu:gloo,cuda:nccl"]
    assert ranks.machine_device() == ("cuda" if cuda else "cpu")
    with pytest.raises(ValueError, match="device 'cuda:0'"):
        ranks.init_distributed(60, "cuda:0")


# ===== several nodes: the leaders' gloo group beside the default group's NCCL ======================
def node_rank(kind, rank, port, path, results):
    """A node of one trainer rank (two on this machine: GPU `rank` each): tba's init ("cpu:gloo,cuda:nccl"),
    nodes.Nodes' gloo group of the leaders, and in turn FSDP2's all-gathers (NCCL on GPUs), the leaders'
    gather of trajectories (gloo, CPU tensors), and the default group's CPU all-gather (first_refusal: gloo),
    twice, as a run interleaves them at each sync and collect."""
    import torch.distributed as dist
    from runtime import nodes
    from buffer import Trajectory
    try:
        torch.set_num_threads(1)
        os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="1",
                          GROUP_RANK=str(rank), GROUP_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cfg = Config(model=path, timeout=TIMEOUT)
        ranks.init_distributed(cfg.timeout, kind)
        device = torch.device(f"cuda:{rank}" if kind == "cuda" else "cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        model = policy.load_policy(path, device, "bfloat16")
        multi = nodes.Nodes(2, 1, TIMEOUT)
        out = {"rank": rank, "backend": str(dist.get_backend()), "leaders": str(dist.get_backend(multi.group)),
               "gathered": [], "said": [], "refusals": []}
        for turn in range(2):
            named = weights.gather(model)
            out["gathered"].append(sum(float(t.float().sum()) for _, t in named))  # every rank gathers them all
            mine = [Trajectory(turn, np.array([rank + 5, 6], np.int32), float(rank), -1.0, -2.0, turn)]
            parts = multi.gather(nodes.encode(mine, said=[f"node {rank} turn {turn}"]))
            if rank == 0:
                out["said"].append([nodes.decode(p)[1]["said"] for p in parts])
            out["refusals"].append(ranks.first_refusal(f"rank {rank} refuses" if turn else None))
        results.put(out)
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.engine
@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 GPUs (one per node's rank)")])])
def test_the_leaders_gloo_group_beside_nccl(kind, tmp_path):
    """Two nodes' leaders on this machine: NCCL all-gathers of the default group and gloo gathers of the
    leaders' group and of the default group's CPU side, interleaved, agree on both ranks (GPU: 2 GPUs)."""
    from runtime import tiny
    path = str(tmp_path / "model")
    tiny.make_model(path, hidden=64, layers=2, heads=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=node_rank, args=(kind, r, port, path, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        outs = sorted((get_report(results, procs, 300) for _ in procs), key=lambda o: o["rank"])
    finally:
        finish(procs)
    assert outs[0]["backend"] == ("cpu:gloo,cuda:nccl" if kind == "cuda" else "gloo") and outs[0]["leaders"] == "gloo"
    assert outs[0]["gathered"] == outs[1]["gathered"]  # the same full weights on both ranks
    assert outs[0]["said"] == [[["node 0 turn 0"], ["node 1 turn 0"]], [["node 0 turn 1"], ["node 1 turn 1"]]]
    assert [o["refusals"] for o in outs] == [[None, "rank 0 refuses"]] * 2  # the first rank's, on every rank
    assert [p.exitcode for p in procs] == [0, 0]


# ===== AdamW's moments under bf16 weights (--trainer-dtype bfloat16) ================================
@pytest.mark.parametrize("device", KINDS)
def test_adamw_moments_decay_as_in_float32_under_bf16_weights(device):
    """policy.AdamW on bf16 weights keeps float32 moments: after 100 steps of gradients and 600 ten times smaller,
    its v is a float32 AdamW's (torch's, on float32 weights fed the same gradients), and its first update is
    that AdamW's rounded to bf16. torch's AdamW on the bf16 weights keeps v in bf16, where v x 0.999 rounds back
    to v: its v stays far above."""
    gen = torch.Generator().manual_seed(0)
    start = (torch.randn(4096, generator=gen) * 0.02).bfloat16().float()  # the same start in either dtype
    grads = [(torch.randn(4096, generator=gen) * (1.0 if i < 100 else 0.1)).bfloat16().to(device) for i in range(700)]
    runs = {}
    for name, dtype, cls in (("float32", torch.float32, torch.optim.AdamW), ("ours", torch.bfloat16, policy.AdamW),
                             ("bf16", torch.bfloat16, torch.optim.AdamW)):
        w = torch.nn.Parameter(start.to(device, dtype, copy=True))
        opt = cls([w], lr=1e-3, weight_decay=0.01, foreach=False)
        for i, g in enumerate(grads):
            w.grad = g.to(dtype)
            opt.step()
            if i == 0:
                first = w.detach().clone()
        runs[name] = first, w.detach(), opt.state[w]["exp_avg_sq"]
    ref, ours, bf16 = runs["float32"][2], runs["ours"][2], runs["bf16"][2]
    assert ours.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    assert torch.equal(runs["ours"][0], runs["float32"][0].bfloat16())  # one update: float32's, rounded
    assert ((ours - ref).abs() <= 1e-5 * ref).all()
    ratio = (bf16.float() / ref).median().item()
    assert ratio > 1.5, ratio  # measured: 1.75 (docs/departures.md)


# ===== chunked log-probs on the device ==========================================================
class Recorder:
    """Calls the model and keeps its logits: the reference is computed from the very same logits."""

    def __init__(self, model):
        self.model, self.logits = model, None

    def __call__(self, **kw):
        out = self.model(**kw)
        self.logits = out.logits
        return out


def plain_logprobs(logits, input_ids, response_mask, temperature, upcast=True):
    """One log_softmax over the whole (N, T, V): the definition sequence_logprobs chunks."""
    x = logits[:, :-1]
    x = (x.float() if upcast else x) / temperature
    lp = x.log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return (lp * response_mask[:, 1:].to(lp.dtype)).sum(1)


@pytest.mark.parametrize("device", KINDS)
def test_chunked_logprobs_match_one_log_softmax(device, tmp_path):
    pytest.importorskip("transformers")
    from runtime import tiny
    model, _ = tiny.make_model(str(tmp_path / "model"), hidden=64, layers=2, heads=2)
    model = model.to(device).eval()
    g = torch.Generator().manual_seed(0)
    pairs = [(torch.randint(4, 90, (n,), generator=g).tolist(), torch.randint(4, 90, (m,), generator=g).numpy())
             for n, m in ((5, 3), (9, 7), (4, 12))]
    ids, attention, response = collate(pairs, 0, device)
    N, V, T = len(pairs), model.config.vocab_size, 0.7
    small = 4 * N * V * 2  # two positions a chunk

    # Tolerance, float32 and bf16 alike (both compute the log-softmax in float32): 1e-5 + 1e-6 |log p|.
    # The two sides differ only by float32 rounding: logsumexp + gather against log_softmax + gather
    # (a few ulps of |log p| per token, about log V = 4.6 here: ulp 5e-7), and the order of the sum
    # over at most 11 response positions (chunk by chunk against at once; each addition rounds by
    # half an ulp of the running sum: under 11 x 2^-24 < 1e-6 of the total, which reaches -55 here,
    # where one float32 ulp is 3.8e-6). Measured on the CPU: 1.1e-5 at -55.
    tol = dict(rtol=1e-6, atol=1e-5)

    # float32: the chunks against one log-softmax of the same logits, and against one chunk (gradients too)
    rec = Recorder(model)
    chunked = sequence_logprobs(rec, ids, attention, response, T, chunk_bytes=small)
    assert torch.allclose(chunked, plain_logprobs(rec.logits.detach(), ids, response, T), **tol)
    plain = sequence_logprobs(model, ids, attention, response, T, chunk_bytes=2**40)
    assert torch.allclose(chunked, plain, **tol)
    params = list(model.parameters())
    g_chunked = torch.autograd.grad(chunked.sum(), params)
    g_plain = torch.autograd.grad(plain.sum(), params)
    scale = max(a.abs().max().item() for a in g_plain)
    assert scale > 0
    for a, b in zip(g_chunked, g_plain):  # the chunks' log-softmax is recomputed in backward
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * scale)

    # bf16 model: logits in bf16, log-softmax in float32 on the exactly upcast logits, so the same
    # tolerance holds against a float32 reference from the same bf16 logits. A log-softmax left in
    # bf16 is off by up to half a bf16 ulp of |log p| per token (2^-6 = 0.016 at 4.6) and its bf16
    # sum by more (ulp 0.25 at 55): checked below to exceed the tolerance tenfold, so the check
    # would catch a lost upcast.
    rec16 = Recorder(copy.deepcopy(model).to(torch.bfloat16))
    with torch.no_grad():
        chunked16 = sequence_logprobs(rec16, ids, attention, response, T, chunk_bytes=small)
        assert rec16.logits.dtype == torch.bfloat16 and chunked16.dtype == torch.float32
        reference = plain_logprobs(rec16.logits, ids, response, T)
        assert torch.allclose(chunked16, reference, **tol)
        in_bf16 = plain_logprobs(rec16.logits, ids, response, T, upcast=False).float()
        assert ((in_bf16 - reference).abs() - 10 * (tol["atol"] + tol["rtol"] * reference.abs())).max() > 0


# ===== a searcher GPU's memory: vLLM's share from the models' sizes (card sizes faked: runs anywhere) ===========
def pythia(folder, size: str, head: str = "causal") -> str:
    """A Pythia-shaped config.json (the published dimensions; 6.9B pads its vocabulary to 50,432), no weights:
    the sizes come from it alone."""
    from transformers import GPTNeoXConfig
    hidden, layers, heads = {"410m": (1024, 24, 16), "1b": (2048, 16, 8), "2.8b": (2560, 32, 32),
                             "6.9b": (4096, 32, 32)}[size]
    c = GPTNeoXConfig(vocab_size=50432 if size == "6.9b" else 50304, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      intermediate_size=4 * hidden, rotary_pct=0.25, max_position_embeddings=2048,
                      tie_word_embeddings=False, num_labels=1)
    c.architectures = ["GPTNeoXForCausalLM" if head == "causal" else "GPTNeoXForSequenceClassification"]
    path = os.path.join(folder, f"{size}-{head}")
    c.save_pretrained(path)
    return path


def tldr_searcher(folder, size: str):
    """run_tldr.sh's searcher 0 at SIZE: policy and reward model of that size, the 6.9B judge, bf16, 512-token
    prompts and 128 new tokens, 8 x 20 a step, 20 sequences a pass."""
    return Config(task="tldr", dtype="bfloat16", model_path=pythia(folder, size), max_model_len=640,
                      prompts_per_step=8, search_samples_per_prompt=20, micro_batch=20, score_batch=20, ref_reset_every=0,
                      reward_model_path=pythia(folder, size, "reward"), searchers=3, searcher_memory=None,
                      eval_reward_model_path=pythia(folder, "6.9b", "reward"))


def test_tldr_searchers_fit_a_40_gb_card_with_the_computed_share(tmp_path, monkeypatch):
    """run_tldr.sh's searcher 0 holds, beside vLLM, pi_ref, the reward model, the evaluation's policy copy and
    the 6.9B judge (12.4 GiB in bf16). On a 40 GB card a fixed --searcher-memory 0.7 leaves 11.2 GiB, too little
    at 410M and 1B; the computed share leaves them room and still holds the engine; 2.8B fits 48 and 80 GB
    cards, and on a 40 GB one it is refused in one line naming the models."""
    gpus = lambda total: monkeypatch.setattr(torch.cuda, "get_device_properties",
                                             lambda i: types.SimpleNamespace(total_memory=total))
    import dataclasses
    import tasks
    tldr = tasks.get("tldr")
    for size, card, share in (("410m", 40e9, 0.50), ("1b", 40e9, 0.41), ("2.8b", 48e9, 0.29), ("2.8b", 80e9, 0.57)):
        cfg = tldr_searcher(tmp_path, size)
        engines, beside = gpu.memory_needs(cfg, tldr)
        assert beside["the judge"] == 2 * (6_857_302_016 - 50432 * 4096 + 4096)  # Pythia 6.9B, a one-output head
        assert beside["pi_ref"] == beside["the evaluation's policy copy"] == 2 * {
            "410m": 405_334_016, "1b": 1_011_781_632, "2.8b": 2_775_208_960}[size]  # the published totals
        gpus(int(card))
        got = gpu.check_memory(cfg, tldr, 1)
        assert got == share, (size, card, got)
        assert sum(beside.values()) <= (1 - share) * card and sum(engines["policy"][:2]) <= share * card
        if card == 40e9:  # run_tldr.sh's old setting
            with pytest.raises(ConfigError, match=r"^--searcher-memory: 0.7 of this GPU's 37.3 GiB leaves less than "
                                                  r"the [\d.]+ GiB of the models beside the engines \(pi_ref .*the "
                                                  r"judge 12.4, the CUDA context 1.0, a reload's largest layer "
                                                  r"0.[12]\); give the engines at most 0.[45]\d?$"):
                gpu.check_memory(dataclasses.replace(cfg, searcher_memory=0.7), tldr, 1)
    cfg = tldr_searcher(tmp_path, "2.8b")
    gpus(int(40e9))
    with pytest.raises(ConfigError) as e:
        gpu.check_memory(cfg, tldr, 1)
    line = str(e.value)
    assert line.startswith("--searcher-memory: the policy engine's ") and line.endswith("need more than this GPU's 37.3 GiB")
    assert "pi_ref 5.2, its logits 2.4, a float32 chunk 0.2, the reward model 4.9, the evaluation's policy copy 5.2, " \
           "the judge 12.4, the CUDA context 1.0, a reload's largest layer 0.2: 31.5 GiB" in line and "\n" not in line


@pytest.mark.engine
def test_a_gpu_run_gets_the_computed_share_or_a_refusal(tmp_path, monkeypatch):
    """Through config.check on faked GPUs: the share is computed for this node's searcher GPUs (the smallest),
    unless --searcher-memory is given; a card too small is refused in one line; a share outside (0, 1) too."""
    fake_gpus(monkeypatch, [(9, 0)] * 3)
    sizes = [80 * 2**30, 80 * 2**30, 4 * 2**30]  # trainer on GPU 0, searchers on GPUs 1 and 2
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=sizes[i]))
    monkeypatch.chdir(tmp_path)
    from runtime import tiny
    model = str(tmp_path / "model")
    tiny.make_model(model, max_len=1024)  # untrained: only its config and tokenizer are read (the warm-started
    # fixture's CPU minutes would count against tests/gpu_lease.sh's time limit)
    check = lambda *args: checks.check(checks.parse(Config, ["--model", model, "--searchers", "2", *args]), 1)[0]
    import tasks
    cfg = check("--out", "a")
    beside = gpu.memory_needs(cfg, tasks.get("arith"))[1]  # pi_ref's pass: 256 sequences' logits; the CUDA context
    assert cfg.searcher_memory == gpu.memory_share(4 * 2**30, beside) < 0.9 == gpu.memory_share(80 * 2**30, beside)
    assert check("--searcher-memory", "0.5", "--out", "b").searcher_memory == 0.5
    sizes[2] = 2**30
    with pytest.raises(ConfigError, match=r"^--searcher-memory: the policy engine's [\d.]+ GiB and the models beside "
                                          r"it \(pi_ref 0.0, .*\) need more than this GPU's 1.0 GiB$"):
        check("--out", "c")
    with pytest.raises(ConfigError, match=r"^--searcher-memory: must be a fraction in \(0, 1\), got 1.5$"):
        check("--searcher-memory", "1.5", "--out", "d")


# ===== a GPU engine's step budget: passed to vLLM, and the one the memory estimate assumes ========================
@pytest.mark.engine
def test_gpu_engines_get_the_step_budget_the_estimate_assumes(tmp_path, monkeypatch):
    """vLLM would pick its step budget by card (8,192 tokens and 256 sequences on an A100, 16,384 and 1,024 on an
    H100 or H200): on a GPU llm_options passes gpu.BATCH_TOKENS and gpu.BATCH_SEQS (a whole sequence if longer),
    and engine_needs' working memory is computed from the same constants; vLLM's CPU engine keeps its own."""
    import sys
    from runtime import vllm_env
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))  # llm_options sets its own under it
    fake = types.ModuleType("vllm")  # all llm_options reads of vLLM on a GPU: runs where vLLM is not installed
    fake.envs = types.SimpleNamespace(VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"))
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.envs", fake.envs)
    monkeypatch.setattr(torch._dynamo.config, "disable", torch._dynamo.config.disable)  # the CPU branch sets it
    path = pythia(tmp_path, "1b")
    cfg = types.SimpleNamespace(dtype="bfloat16", seed=0)

    def budget(max_model_len, device="cuda:1"):
        options = vllm_env.llm_options(cfg, path, torch.device(device), 0.5, max_model_len)
        return options.get("max_num_batched_tokens"), options.get("max_num_seqs")

    def work(longest):  # engine_needs' first part less the weights
        return gpu.engine_needs(path, "bfloat16", longest, longest, 1)[0] - gpu.model_bytes(path, "bfloat16")

    assert (gpu.BATCH_TOKENS, gpu.BATCH_SEQS) == (8192, 256)  # the A100's defaults, as before
    assert budget(640) == (8192, 256) and budget(10_000) == (10_000, 256)
    assert work(640) == 8192 * (4 * 2048 + 2 * 8192) * 2 + 3 * 256 * 50304 * 4 + 2**29
    before = work(640)
    monkeypatch.setattr(gpu, "BATCH_TOKENS", 16384)  # an H100's: both sides follow
    monkeypatch.setattr(gpu, "BATCH_SEQS", 1024)
    assert budget(640) == (16384, 1024)
    assert work(640) - before == 8192 * (4 * 2048 + 2 * 8192) * 2 + 3 * 768 * 50304 * 4
    token = gpu.kv_bytes_per_token(path, "bfloat16")
    assert gpu.engine_needs(path, "bfloat16", 640, 600, 5000)[2] == token * 1024 * 600  # at once: BATCH_SEQS
    assert os.environ["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm-cache" / "tba-cuda1")
    assert budget(640, "cpu") == (None, None)  # the CPU engine: vLLM's CPU defaults, unchanged


# ===== --searchers 0: the trainer's own state on the GPU that holds the engine (card sizes faked) ===============
def test_the_synchronous_trainer_counts_its_own_state_beside_the_engine(tmp_path, monkeypatch):
    """With --searchers 0 the trainer's GPU holds the engine, pi_ref and the trainer itself: its weights,
    gradients and AdamW moments (16 bytes a parameter with float32 weights, 12 with bf16; LoRA: the frozen
    weights and the adapter's state) and the shared copy in --dtype (two with TBA′'s pi_ref). Pythia 1B, the
    engine at --trainer-memory 0.2: refused on a 24 GB card with float32 weights (it passed before, the trainer
    uncounted), held with bf16 weights or LoRA."""
    import dataclasses
    import tasks
    gsm8k = tasks.get("gsm8k")
    P = 1_011_781_632  # Pythia 1B's published total
    cfg = Config(task="gsm8k", dtype="bfloat16", model_path=pythia(tmp_path, "1b"), max_model_len=640,
                 prompts_per_step=8, search_samples_per_prompt=20, micro_batch=20, score_batch=20, searchers=0, trainer_memory=0.2,
                 trainer_dtype="float32", ref_reset_every=0)
    state = "the trainer's weights, gradients and AdamW state"
    beside = gpu.memory_needs(cfg, gsm8k)[1]
    assert beside[state] == 16 * P and beside["the shared copy"] == 2 * P == beside["pi_ref"]
    assert gpu.memory_needs(dataclasses.replace(cfg, trainer_dtype="bfloat16"), gsm8k)[1][state] == 12 * P
    assert gpu.memory_needs(dataclasses.replace(cfg, ref_reset_every=50), gsm8k)[1]["the shared copy"] == 4 * P
    adapter = 16 * 32 * (2048 + 3 * 2048)  # r 32 on each layer's query_key_value (peft's default for GPT-NeoX)
    lora = dataclasses.replace(cfg, lora_rank=32, lora_alpha=16, seed=0)
    assert gpu.trainer_parameters(lora) == (P + adapter, adapter)
    assert gpu.memory_needs(lora, gsm8k)[1][state] == 4 * (P + adapter) + 12 * adapter
    assert state not in gpu.memory_needs(dataclasses.replace(cfg, searchers=1), gsm8k)[1]  # searchers: their GPUs

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=int(24e9)))
    with pytest.raises(ConfigError, match=r"^--trainer-memory: the policy engine's [\d.]+ GiB and the models beside it "
                                          r"\(pi_ref 1.9, .*the trainer's weights, gradients and AdamW state 15.1, "
                                          r"the shared copy 1.9, the CUDA context 1.0, a reload's largest layer 0.2: 21.5 GiB\) need more "
                                          r"than this GPU's 22.4 GiB$"):
        gpu.check_memory(cfg, gsm8k, 1)
    assert gpu.check_memory(dataclasses.replace(cfg, trainer_dtype="bfloat16"), gsm8k, 1) == 0.2
    assert gpu.check_memory(lora, gsm8k, 1) == 0.2
