"""The GPU path's own code run where it was written for, one CUDA GPU with PyTorch and no vLLM, at Qwen2.5-7B's
shapes (tests/gpu_lease.sh's `checks` stage; not yet run on one): each check a part of its own, one JSON line of
figures each, through tools/gpu_probe.py's harness (its order, limits, error lines and hang time-outs; each line names
the torch, CUDA and card that produced it). docs/gpu.md says what each would prove.

    python tools/gpu_checks.py                       # on a GPU
    python tools/gpu_checks.py --reduced             # anywhere, the CPU too: the same code at a toy's shapes (tested)
    python tools/gpu_checks.py --parts slot,keep     # some checks only, in the order given

fingerprint  runtime/weights.fingerprint's arithmetic against check_arrival's tolerance (`excess`: above 1 fails,
             searcher.Engine.verify's): a fused qkv and gate_up against their parts' sums, each on the GPU; the GPU's
             sums against the CPU's of the same tensors; the 1.1 GB embedding (its seconds on each); and whether a
             copy one AdamW step behind (lr 1e-6, run_math.sh's, every float32 weight moved by lr, then bf16) is
             caught.
watchdog     runtime.ranks.Watchdog's inputs on this torch's NCCL, one rank (NCCL refuses two ranks on one GPU): whether
             its `sequence()` moves after a collective of CUDA tensors and after one of CPU tensors (on
             "cpu:gloo,cuda:nccl" the group's number is its default backend's, NCCL's: torch/distributed/
             distributed_c10d.py:2086-2087, and ProcessGroup.hpp's getSequenceNumberForGroup, in torch's include
             folder, lines 771-785), and what its `where()` sees while the host waits behind a NCCL collective held
             back by a spinning kernel: at a synchronisation, at `.item()`, in `dist.barrier()`.
lagged       runtime.policy.LaggedCopy at rho-math-1b's shape with 2 blocks, bf16: each step's rescored log-probs
             against the trainer's own at the same weights a step before (and, as a control that the comparison can
             fail, at the weights after), every parameter sharded (a DTensor) after each rescore, the memory allocated
             after each and its peak.
slot         runtime.weights.flat_slot at Qwen2.5-7B's 339 tensors: the seconds of its registration (cudaHostRegister),
             is_pinned, every view 64-byte aligned, the block exactly the bytes asked for, the copy from the GPU into
             it against one into pageable memory, the copy's bytes, the seconds to let it go.
keep         runtime.weights.Outbox.keep of those 339 tensors (copies and fingerprints, one wait) against the bare
             copies into the same slot; its fingerprints against each tensor's own, computed alone.
arrival      runtime.weights.Outbox.write of the kept step from its slot into the shared copy on the GPU, then the
             arrival check without vLLM (check_arrival: the shared copy read back against the fingerprints kept, so
             the slot's bytes too): every name counted; a tensor altered after and a name that maps to nothing both
             caught.
"""

import gc
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for gpu_probe (which adds the repository)

import numpy as np
import torch

from gpu_probe import QWEN, RHO, TOY, TOY_LLAMA, build, hf_shapes, main, named_weights, say, sync, timed


# --- fingerprint ------------------------------------------------------------------------------------------------------
def fingerprints(state, device, reduced):
    from runtime.weights import fingerprint
    shape = TOY if reduced else QWEN
    shapes = hf_shapes(dict(shape, layers=1))
    g = torch.Generator(device=device).manual_seed(0)
    w = lambda name: torch.randn(shapes[name], generator=g, device=device).mul_(0.02).to(torch.bfloat16)
    at = "model.layers.0."
    q, k, v, gate, up = (w(at + n) for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                             "self_attn.v_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight"))
    embed = w("model.embed_tokens.weight")
    own = lambda *ts: torch.stack([fingerprint(t) for t in ts]).sum(0).cpu()  # each alone, on its device, summed
    fused = dict(qkv=excess(fingerprint(torch.cat([q, k, v])).cpu(), own(q, k, v)),
                 gate_up=excess(fingerprint(torch.cat([gate, up])).cpu(), own(gate, up)))
    sync(device)
    t0 = time.perf_counter()
    on_device = fingerprint(embed).cpu()
    device_s = time.perf_counter() - t0
    host = embed.cpu()
    t0 = time.perf_counter()
    on_cpu = fingerprint(host)
    cpu_s = time.perf_counter() - t0
    across = max(excess(fingerprint(t.cpu()), fingerprint(t).cpu()) for t in (q, k, v, gate, up))
    # one AdamW step behind: its first step moves every weight by lr (m / sqrt(v) = +-1), on float32 master weights
    master = embed.float()
    step = master.add(torch.randn(master.shape, generator=g, device=device).sign_().mul_(1e-6)).to(torch.bfloat16)
    moved = float((step != embed).float().mean())
    behind = excess(fingerprint(embed).cpu(), fingerprint(step).cpu())
    say("fingerprints against the tolerance", unit="excess: above 1 fails the check", fused=fused,
        gpu_against_cpu=across, embedding=dict(gigabytes=embed.numel() * 2 / 1e9, excess=excess(on_cpu, on_device),
                                               device_seconds=device_s, cpu_seconds=cpu_s),
        one_step_behind=dict(lr=1e-6, bf16_elements_moved=moved, excess=behind, caught=behind > 1))


# --- watchdog ---------------------------------------------------------------------------------------------------------
def watchdog(state, device, reduced):
    import torch.distributed as dist
    from runtime import ranks
    cuda = device.type == "cuda"
    # one rank: only signals are watched (its thread), and sequence() and where() are what is measured
    dog = ranks.Watchdog(0, 1, 600.0, lambda: 0, lambda: [], ".")
    try:
        moved = {}
        for kind in ("cpu", "cuda") if cuda else ("cpu",):
            x = torch.ones(1, device=kind)
            before = dog.sequence()
            dist.all_reduce(x)
            sync(device)
            after = dog.sequence()
            moved[kind] = None if before is None or after is None else after - before
        seen, spin = {}, None

        def during(key, wait):
            """What where() and sequence() read from another thread half a second into `wait()` of this one, and when:
            a wait that held the GIL would let it read only after (so would the watchdog's own thread)."""
            got, t0 = {}, time.perf_counter()
            timer = threading.Timer(0.5, lambda: got.update(where=dog.where(), sequence=dog.sequence(),
                                                            read_at_seconds=time.perf_counter() - t0))
            timer.start()
            wait()
            waited = time.perf_counter() - t0
            timer.join()
            seen[key] = dict(got, waited_seconds=waited)
        if cuda:  # a spinning kernel of about 2 s ahead of the collective holds it back
            # calibrated after a warm-up: a first launch that loads the kernel would make the spin too
            # short, and "nothing seen" would mean a wait that ended before the look, not a wait unseen
            per = timed(lambda: torch.cuda._sleep(10**8), device, warmup=1)
            cycles = int(1e8 * 2.0 / per)
            spin = dict(cycles=cycles, seconds_per_1e8_cycles=per)
            x = torch.ones(1, device=device)

            def behind(then):
                torch.cuda._sleep(cycles)
                dist.all_reduce(x)
                then()
            during("synchronize", lambda: behind(torch.cuda.synchronize))
            during("item", lambda: behind(x.item))
            during("barrier", lambda: (torch.cuda._sleep(cycles), dist.barrier()))
        else:
            during("sleep", lambda: time.sleep(1.0))
    finally:
        dog.close()
    say("watchdog's inputs", backend=str(dist.get_backend()), sequence_moved_by=moved, seen_while_waiting=seen,
        spin=spin, note="one rank: NCCL refuses two ranks on one GPU, so no stall between ranks is staged")


# --- lagged -----------------------------------------------------------------------------------------------------------
def lagged(state, device, reduced):
    import transformers
    from torch.distributed.tensor import DTensor
    from buffer import Trajectory
    from loss import collate, response_logprobs
    from runtime import policy
    shape, cuda = TOY_LLAMA if reduced else RHO, device.type == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    prompt, response, B, K = (6, 8, 2, 2) if reduced else (64, 192, 4, 4)
    micro = B * K // 2
    transformers.utils.logging.disable_progress_bar()  # no loading bars among the figures
    with tempfile.TemporaryDirectory() as path:
        build("llama", shape, 2, device, torch.float32).save_pretrained(path)
        trainer = policy.load_policy(path, device, dtype)  # float32 weights, `dtype` compute: the trainer's
        copy = policy.LaggedCopy(path, device, dtype, lag=1)
    rng, v = np.random.default_rng(0), shape["vocab_size"]
    prompts = [rng.integers(4, v, prompt).tolist() for _ in range(B)]

    def logps(groups) -> list:
        """The trainer's log-probs of each response, in the passes of `micro` sequences the rescore makes."""
        pairs, out = [(prompts[t.prompt_id], t.response) for g in groups for t in g], []
        for i in range(0, len(pairs), micro):
            part = pairs[i:i + micro]
            with torch.no_grad():
                per = response_logprobs(trainer, *collate(part, 0, device), 1.0, [len(p) for p, _ in part],
                                        [len(r) for _, r in part]).float().cpu().numpy()
            out += [row[:len(r)] for row, (_, r) in zip(per, part)]
        trainer.reshard()  # as after a backward pass
        return out
    gaps, controls, sharded, allocated, peak, previous = [], [], [], [], [], None
    for step in range(4):
        groups = [[Trajectory(p, rng.integers(4, v, response).astype(np.int32), 0.0, -5.0, -5.0, 0)
                   for _ in range(K)] for p in range(B)]
        copy.record(trainer, step)
        if previous is not None:  # the batch of the step before, rescored under its weights: the trainer's then
            old, own = previous
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            copy.rescore(old, step, prompts, 0, device, 1.0, micro)
            got = [t.behaviour_logps for g in old for t in g]
            gaps.append(max(float(np.abs(a - b).max()) for a, b in zip(got, own)))
            controls.append(max(float(np.abs(a - b).max()) for a, b in zip(got, logps(old))))  # today's weights
            sharded.append(all(isinstance(p, DTensor) for p in copy.model.parameters()))
            allocated.append(torch.cuda.memory_allocated(device) / 1e9 if cuda else None)
            peak.append(torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None)
        previous = (groups, logps(groups))
        with torch.no_grad():  # the step's update: every weight moves
            for p in trainer.parameters():
                policy.local(p).add_(torch.randn_like(policy.local(p)), alpha=1e-2)
    say("LaggedCopy", dtype=dtype, sequences=B * K, tokens=prompt + response, max_gap=max(gaps), gaps=gaps,
        control_gaps=controls, sharded_after_each=sharded, allocated_gb_after_each=allocated, peak_gb_each=peak)
    del trainer, copy


# --- slot, keep, arrival ----------------------------------------------------------------------------------------------
def slot(state, device, reduced):
    from runtime import weights
    named = named_weights(state, TOY if reduced else QWEN, device)
    shapes, pin = {n: (t.shape, t.dtype) for n, t in named}, device.type == "cuda"
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    asked = sum(-(-t.numel() * t.element_size() // 64) * 64 for _, t in named)
    t0 = time.perf_counter()
    held = weights.flat_slot(shapes, pin)
    register_s = time.perf_counter() - t0
    views = list(held.values())

    def into_slot():
        for n, t in named:
            held[n].copy_(t, non_blocking=True)
    slot_s = timed(into_slot, device, repeat=2)
    pageable_s = timed(lambda: [t.to("cpu", copy=True) for _, t in named], device, repeat=1)
    equal = all(torch.equal(held[n], t.cpu()) for n, t in (named[0], named[len(named) // 2], named[-1]))
    block = views[0].untyped_storage().nbytes()
    figures = dict(tensors=len(named), gigabytes=nbytes / 1e9, register_seconds=register_s,
                   pinned=all(x.is_pinned() for x in views) if pin else None,
                   aligned_64=all(x.data_ptr() % 64 == 0 for x in views), block_bytes=block, asked_bytes=asked,
                   exact=block == asked, copy_seconds=slot_s, copy_gb_per_s=nbytes / 1e9 / slot_s,
                   pageable_seconds=pageable_s, pageable_gb_per_s=nbytes / 1e9 / pageable_s, copies_equal=equal)
    t0 = time.perf_counter()
    del held, views  # the slot's finaliser unregisters the block, and the block goes
    gc.collect()
    say("flat_slot", **figures, release_seconds=time.perf_counter() - t0,
        note=None if pin else "the CPU: nothing page-locked")


def kept(state, device, reduced):
    """The shared copy allocated from the 339 tensors, and an Outbox whose one slot holds step 1's (made once)."""
    from runtime import weights
    if "outbox" not in state:
        named = named_weights(state, TOY if reduced else QWEN, device)
        shared = weights.create(mp.get_context("spawn"))
        weights.allocate(shared, named, {}, device, torch.bfloat16)
        outbox = weights.Outbox(shared, 0, 600)  # a ring of one slot (--lag 0's size)
        outbox.ring = [weights.flat_slot({n: (t.shape, t.dtype) for n, t in named}, device.type == "cuda")]
        outbox.keep(named, 1)
        state["outbox"] = outbox
    return state["outbox"]


def read_back(tensors: dict, names) -> dict:
    """Each name's three sums of `tensors` (fingerprints on their device, one copy to the host)."""
    from runtime.weights import fingerprint
    sums = torch.stack([fingerprint(tensors[n]) for n in names]).cpu().tolist()
    return dict(zip(names, sums))


def keep(state, device, reduced):
    from runtime.weights import fingerprint, synchronize
    named = named_weights(state, TOY if reduced else QWEN, device)
    outbox = kept(state, device, reduced)
    keep_s = timed(lambda: outbox.keep(named, 1), device, repeat=2)

    def bare():
        for n, t in named:
            outbox.ring[0][n].copy_(t, non_blocking=True)
        synchronize([t for _, t in named])
    bare_s = timed(bare, device, repeat=2)
    own = torch.stack([fingerprint(t) for _, t in named]).cpu()
    say("Outbox.keep", tensors=len(named), keep_seconds=keep_s, bare_copies_seconds=bare_s,
        extra_seconds=keep_s - bare_s, prints_equal_each_tensors=torch.equal(outbox.prints[1], own))


def arrival(state, device, reduced):
    from runtime.errors import WrongWeights
    from runtime.weights import arrival_plan, check_arrival, synchronize
    outbox = kept(state, device, reduced)
    shared = outbox.shared
    names, published = shared.prints
    sync(device)
    t0 = time.perf_counter()
    outbox.write(outbox.history[1].items(), 1, lambda: None)  # the kept step, from the slot into the shared copy
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    back, plan = read_back(shared.tensors, names), arrival_plan(1, names, {n: [n] for n in names})
    check_arrival(1, published, *plan, [back[n] for n in names])
    checked = plan[1].shape[1]  # every name published: arrival_plan refuses one that no group holds
    check_s = time.perf_counter() - t0

    def caught(check, *args) -> bool:
        try:
            check(1, *args)
        except WrongWeights:
            return True
        return False
    unmapped = caught(arrival_plan, names, {n: [n] for n in names[1:]})
    victim = next(n for n in names if n.endswith("q_proj.weight"))
    with torch.no_grad():
        shared.tensors[victim][0] += 1e-3  # one row moved, after its fingerprint
    synchronize(shared.tensors.values())
    altered = caught(check_arrival, published, *plan, [read_back(shared.tensors, names)[n] for n in names])
    say("arrival check without vLLM", tensors=len(names), write_seconds=write_s, check_seconds=check_s,
        checked=checked, version=shared.version.value, altered_caught=altered, unmapped_caught=unmapped)
    state.clear()  # the last check that reads them: the shared copy, the slot and the weights go


def excess(got, want) -> float:
    """How far the three sums `got` are from `want`, in units of what runtime.weights.check_arrival lets pass: 1e-9
    of the sum of |x| (for the sum and itself) or of the sum of x^2; above 1 is a mismatch."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float((np.abs(got - want) / (1e-9 * want[[1, 1, 2]] + 1e-12)).max())


def checks() -> list:
    """(key, figure, function, limit) of each check (tools/gpu_probe.py's `parts` says what the limit is)."""
    return [("fingerprint", "fingerprints against the tolerance", fingerprints, 60),
            ("watchdog", "watchdog's inputs", watchdog, 60), ("lagged", "LaggedCopy", lagged, 90),
            ("slot", "flat_slot", slot, 90), ("keep", "Outbox.keep", keep, 60),
            ("arrival", "arrival check without vLLM", arrival, 60)]


if __name__ == "__main__":
    sys.exit(main(table=checks, name="tools/gpu_checks.py"))
