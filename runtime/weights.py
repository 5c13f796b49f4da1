"""Weights from the trainer to the searchers: one shared copy, a version counter and a lock.

The protocol (every wait polls, checks that the other side lives and has a timeout):
1. Trainer rank 0 makes `SharedWeights` before spawning the searchers, then allocates the tensors
   once it has loaded its model (`allocate`): in shared memory on the CPU, on its own GPU on a GPU
   node (sent to other processes as CUDA IPC handles, so the bytes are never copied to the host).
   It hands them to each searcher through the `handoff` queue (`receive`).
2. Publishing (`write`, trainer): every rank gathers each parameter in turn on its device (`gather`: FSDP2's
   all-gather, so memory holds one full parameter at a time); rank 0, holding the lock, copies it into its
   shared tensor, waits for the copies to finish, then moves `version`. The other ranks call `write` too, with
   no shared copy: they only take part in the all-gathers (`join_gathers`). Over several nodes each node's
   first trainer process does what rank 0 does here (nodes.py).
3. Reading (`reading`, searcher): when `version` has moved, the searcher takes the lock only to flag itself in
   `reading` (no writer is inside: it holds the lock while it writes), loads the shared tensors into its engine
   beside the other searchers, and waits for its devices to finish those copies before its flag goes. The writer
   (`write`) takes the lock, so that no reader can begin, then waits for the flagged readers to leave
   (`no_readers`), so that a publish can never overwrite weights still being read. A searcher stopped while it
   read is named after --timeout (`Reading`); one that died, at once (the trainer's `alive()`).
4. Checking (`fingerprint`, searcher.Engine.verify; what fails and how: docs/faults.md): each version
   carries each tensor's sum, sum of absolute values and sum of squares in float64, blind to the order of the
   elements, so that a searcher checks its engine's copy in the engine's own layout (fused q, k and v,
   transposed Conv1D, padded vocabulary, repacked CPU linears: vllm_env.held_fingerprints). Equal values in
   another order differ by float64 rounding alone, while one step's update (Adam moves every weight by about
   lr) moves a sum by far more. Version 0's also identify --model's weights on --resume (`identity`).
TBA′ (reference-policy resetting, `--ref-reset-every`) adds a second set of tensors, `pi_ref`, with
its own `pi_ref_version`: pi_ref after the latest reset, published the same way.
With --lag each searcher says in `wants` which version its next round needs and waits for it (`Inbox.wait_for`);
runtime.fleet.Fleet.serve publishes a version once no searcher needs the one before, from the trainer's
history of the last L steps' weights (`Outbox`).
"""

import contextlib
import math
import os
import time
import weakref
from dataclasses import dataclass
from queue import Empty

import torch

from runtime import lora
from runtime.errors import WrongWeights

WAIT = 1.0  # s: every blocking wait polls at this period and checks that the other side lives


@dataclass
class SharedWeights:
    tensors: dict | None  # Hugging Face parameter name -> shared tensor (tied names share one tensor)
    pi_ref: dict | None   # the same for pi_ref after the latest reset (TBA′ only; else None)
    version: object       # mp.Value("q"): trainer step of the weights in `tensors` (0 = initial model)
    pi_ref_version: object  # mp.Value("q"): trainer step whose weights `pi_ref` holds (0 = initial model)
    lock: object          # mp.Lock: held while the tensors are written, and by a reader while it flags itself
    handoff: object       # mp.Queue: (tensors, pi_ref, prints), once per searcher, for those started before them
    wants: object = None  # mp.Array("q"): --lag, the version each of this node's searchers needs next (-1: none)
    prints: object = None  # (distinct names, float64 (n, 3) shared tensor): the published version's `fingerprint`s
    reading: object = None  # mp.Array("q"): 1 while that searcher of this node reads the tensors (`reading`)


def create(ctx, searchers: int = 0) -> SharedWeights:
    """The counters, lock and handoff queue, and an entry a searcher in `wants` and `reading`, made before the searchers
    are spawned; those arrays have no lock (one writer an entry): none that a stopped searcher could hold."""
    flags = lambda: ctx.Array("q", [0] * max(1, searchers), lock=False)
    return SharedWeights(None, None, ctx.Value("q", 0), ctx.Value("q", 0), ctx.Lock(), ctx.Queue(), wants=flags(),
                         reading=flags())


# --- trainer side ------------------------------------------------------------------------------------
def gather(model, dtype=None):
    """(Hugging Face name, full tensor) for each distinct tensor (a tied name once: `aliases`), one at a time, each an
    all-gather (every rank iterates it to the end), cast to `dtype` first; with LoRA the merged weights."""
    if lora.active(model):
        yield from lora.merged_names(model, lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t, dtype)
        return
    seen = set()
    for name, t in model.state_dict(keep_vars=True).items():  # keep_vars: tied names are one object
        if id(t) not in seen:
            seen.add(id(t))
            # cast before the all-gather: a DTensor casts its local shard only
            t = t.detach().to(dtype) if dtype is not None and t.is_floating_point() else t.detach()
            yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t)


def aliases(model) -> dict:
    """Tied names of the state dict: {name: the name `gather` yields for the same tensor}."""
    first, out = {}, {}
    name_of = lora.plain_name if lora.active(model) else str
    for name, t in model.state_dict(keep_vars=True).items():
        if not lora.is_adapter(name):  # LoRA's A and B are merged into their base weight by `gather`
            out[name_of(name)] = first.setdefault(id(t), name_of(name))
    return {n: f for n, f in out.items() if n != f}


def every_name(model, dtype=None) -> list:
    """`gather(model, dtype)` with the tied names too ((name, tensor) pairs; a tied tensor under each of
    its names, as in the shared copy): what a vLLM engine is given to load the model's weights directly.
    Given the embeddings' name alone, vLLM 0.32's reload keeps a tied LM head stale: a layer that gets
    no weights in a reload keeps its old tensors (vllm/model_executor/model_loader/reload/layerwise.py:255-266);
    seen on the CPU (tests/test_weight_sync.py). Every trainer rank calls it (all-gathers)."""
    named = dict(gather(model, dtype))
    return [*named.items(), *((name, named[first]) for name, first in aliases(model).items())]


def join_gathers(named):
    """What a trainer rank that holds no shared copy (not its node's leader) does with `gather(model)`:
    join each of its all-gathers, and drop the result. `allocate`, `write` and `Outbox.keep` do this
    when they are given no shared copy, so every rank calls them alike."""
    for _ in named:
        pass


def allocate(weights: SharedWeights | None, named, tied: dict, device, dtype, with_pi_ref: bool = False):
    """Allocate the shared copies (each node's leader, once), filled from `named` (name, tensor) pairs;
    `tied` names ({name: name in `named`}) share their tensor. Every trainer rank calls it with
    `gather(model)`; `weights` is None on the ranks that only take part in the all-gathers."""
    if weights is None:
        return join_gathers(named)
    with allocator_settings(device, expandable_segments=False):
        tensors = {name: share(torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype,
                                           device=device).copy_(t)) for name, t in named}
        pi_ref = {name: share(t.clone()) for name, t in tensors.items()} if with_pi_ref else None
    prints = torch.stack([fingerprint(t) for t in tensors.values()]).cpu().share_memory_()  # (n, 3), on the host
    weights.prints = (list(tensors), prints)
    for name, first in tied.items():
        tensors[name] = tensors[first]
        if pi_ref is not None:
            pi_ref[name] = pi_ref[first]
    synchronize(tensors.values())
    weights.tensors, weights.pi_ref = tensors, pi_ref


def fingerprint(t) -> torch.Tensor:
    """A tensor's (sum, sum of |x|, sum of x^2) in float64, on its device: blind to the elements' order, so that an
    engine's copy is checked in its own layout (the module docstring)."""
    return torch.stack(held(t.detach()))


def identity(weights: SharedWeights, dtype, weights_dtype) -> dict:
    """What identifies --model's weights on --resume (runtime.checkpoint.check_model): the fingerprints of the shared
    copy's floating-point tensors at version 0, in no order, and the casts that made them (the trainer's weights'
    dtype, then the copy's), so that a model folder's files give the same figures (`file_fingerprints`)."""
    names, prints = weights.prints
    rows = [i for i, n in enumerate(names) if weights.tensors[n].is_floating_point()]
    return dict(prints=prints[rows].clone(), dtypes=[str(d).removeprefix("torch.") for d in (weights_dtype, dtype)])


def file_fingerprints(path: str, dtypes: list[str], device="cpu") -> torch.Tensor:
    """`fingerprint` of each floating-point tensor of a model folder's weight files (runtime.hub.weight_files), cast
    through `dtypes` as the trainer casts them (`identity`), one tensor in memory at a time, summed on `device` (a
    GPU sums a 7B model's 15 GB in well under a second; two busy CPU cores take minutes): (n, 3) on the CPU."""
    from safetensors import safe_open

    from runtime.hub import weight_files
    rows = []

    def add(t):
        if t.is_floating_point():
            t = t.to(device)
            for d in dtypes:
                t = t.to(getattr(torch, d))
            rows.append(fingerprint(t).cpu())
    for f in weight_files(path):
        if f.endswith(".safetensors"):
            with safe_open(f, "pt") as tensors:
                for name in tensors.keys():
                    add(tensors.get_tensor(name))
        else:  # a pytorch_model.bin: tensors only (weights_only), read lazily (mmap)
            for t in torch.load(f, map_location="cpu", weights_only=True, mmap=True).values():
                add(t)
    return torch.stack(rows) if rows else torch.zeros(0, 3, dtype=torch.float64)


def covers(held: torch.Tensor, prints: torch.Tensor) -> bool:
    """Whether each fingerprint of `prints` is among `held`'s, within the float64 rounding of one set of values
    (searcher.Engine.verify's bound): blind to names, which a file and a state dict may spell apart, to a tied tensor
    held once or twice, and to a file's extra tensors (a buffer the model does not keep)."""
    if not len(held):
        return not len(prints)
    a, b = prints[:, None, :], held[None, :, :]                                          # (n, 1, 3), (1, m, 3)
    return bool(((a - b).abs() <= 1e-9 * a[..., [1, 1, 2]] + 1e-12).all(-1).any(1).all())


@torch.no_grad()  # (a parameter's, read back in the engine: runtime.vllm_env.held_fingerprints)
def held(t, chunk: int = 2**24) -> list:
    """`fingerprint`'s three sums of `t`, as float64 scalars on its device, a float64 chunk of 2^24 elements at a time
    (128 MiB: a 7B model's embeddings whole would take 4.4 GB)."""
    sums = torch.zeros(3, dtype=torch.float64, device=t.device)
    for x in (part.double() for part in t.reshape(-1).split(chunk)):
        sums += torch.stack([x.sum(), x.abs().sum(), x.dot(x)])
    return list(sums)


def arrival_plan(version: int, names: list[str], groups: dict) -> tuple[list, torch.Tensor]:
    """How each arrival is checked, found at the first (the names published never change): `groups` ({the
    engine's parameter: the published names loaded into it}) as a list, and the (P, n) 0/1 matrix that sums
    each one's published rows (a fused parameter holds its parts' sums). WrongWeights if a name went into no
    parameter."""
    row, checked = {n: i for i, n in enumerate(names)}, {n for members in groups.values() for n in members}
    if unchecked := [n for n in names if n not in checked]:
        raise WrongWeights(f"the weights of step {version} could not all be checked: {len(unchecked)} of the "
                           f"{len(names)} tensors published map to no parameter of vLLM's engine "
                           f"({', '.join(unchecked[:3])}{', ...' if len(unchecked) > 3 else ''})")
    parts = torch.zeros(len(groups), len(names), dtype=torch.float64)
    for i, members in enumerate(groups.values()):
        parts[i, [row[n] for n in members]] = 1.0
    return list(groups.items()), parts


def check_arrival(version: int, prints, groups: list, parts: torch.Tensor, held_back: list):
    """Each parameter's three sums read back at version `version` (`held_back`, in `groups`' order) against
    the trainer's (`prints`, summed by `parts`: `arrival_plan`, whose groups hold every name): WrongWeights
    naming the first off by more than float64 rounding (1e-9 of its sum of |x| or of x^2)."""
    want, got = parts @ prints, torch.tensor(held_back, dtype=torch.float64)                 # (P, 3) each
    if len(wrong := ((got - want).abs() > 1e-9 * want[:, [1, 1, 2]] + 1e-12).any(1).nonzero()):
        (_, members), got, want = groups[int(wrong[0])], got[int(wrong[0])], want[int(wrong[0])]
        raise WrongWeights(f"the weights of step {version} did not arrive intact: {' + '.join(members)} holds sum "
                           f"{got[0]:.9g} (|x| {got[1]:.9g}, x^2 {got[2]:.9g}) in vLLM's engine, where the "
                           f"trainer published {want[0]:.9g} ({want[1]:.9g}, {want[2]:.9g})")


def on_host(sums: dict, like) -> torch.Tensor:
    """The fingerprints `sums` ({row: on its tensor's device}) in their rows of a float64 host tensor, as
    `like`, the others 0: ONE copy to the host, so a publish waits for its device once, not once a tensor."""
    out = torch.zeros_like(like)
    if sums:
        out[list(sums)] = torch.stack(list(sums.values())).cpu()
    return out


class Slot(dict):
    """A dict of tensors that are views into one block of host memory (`flat_slot`), which it keeps page-locked for
    as long as it lives."""


def flat_slot(shapes: dict, pin: bool) -> Slot:
    """Tensors of the given {name: (shape, dtype)} as views into ONE block of host memory, each at an offset aligned to
    64 bytes; with `pin`, the block is page-locked where it lies (cudaHostRegister), so copies from a GPU run at the
    bus's speed. Not torch's pinned allocator: its caching host allocator rounds each block up to a power of two
    (ATen/core/CachingHostAllocator.h:302-309), and made a Qwen2.5-7B copy allocated tensor by tensor take about 29 GB
    for its 15.2; one block of it would still take 16. Registered memory is exact, and leaves that allocator's free
    lists alone."""
    offsets, total = {}, 0
    for name, (shape, dtype) in shapes.items():
        offsets[name] = total
        total += -(-math.prod(shape) * dtype.itemsize // 64) * 64
    block = torch.empty(max(total, 1), dtype=torch.uint8)
    slot = Slot({name: block[offsets[name]:offsets[name] + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                 for name, (shape, dtype) in shapes.items()})
    if pin:
        cudart = torch.cuda.cudart()
        error = cudart.cudaHostRegister(block.data_ptr(), block.numel(), 0)
        if int(error) != 0:
            raise RuntimeError(f"cudaHostRegister of {block.numel() / 1e9:.1f} GB of host memory failed (CUDA error "
                               f"{int(error)}): the host is short of memory it can lock (ulimit -l)")
        weakref.finalize(slot, cudart.cudaHostUnregister, block.data_ptr())
    return slot


def share(t):
    return t.share_memory_() if t.device.type == "cpu" else t  # CUDA tensors travel as IPC handles


def allocator_for_sharing(device):
    """CUDA tensors sent to other processes must not live in expandable segments (why: docs/gpu.md, "CUDA IPC
    traps"; c10/cuda/CUDACachingAllocator.cpp, ExpandableSegment::fromShared; vllm/device_allocator/cumem.py)."""
    return allocator_settings(device, expandable_segments=False)


@contextlib.contextmanager
def allocator_settings(device, **changes):
    """The CUDA allocator's settings changed around a block (nothing on the CPU): `expandable_segments=False` turns
    that setting off where it is on. The setter resets options it is not given: the whole string is rewritten, then
    restored (torch/cuda/memory.py:1191 deprecates _set_allocator_settings for torch._C's setter). A torch without
    torch._C's getter and setter (before 2.9) reads the environment's string and sets through torch.cuda.memory's."""
    if torch.device(device).type != "cuda":
        yield
        return
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    put = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
        torch.cuda.memory, "_set_allocator_settings", None)
    conf = get() if get else os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", ""))
    fields = [f.strip() for f in conf.split(",") if f.strip()]
    key = lambda f: f.split(":")[0].strip()
    on = lambda f: f.split(":", 1)[-1].strip().lower() in ("true", "1")
    new = [f"{key(f)}:False" if key(f) in changes and changes[key(f)] is False and on(f) else f for f in fields]
    changed = new != fields and put is not None
    if changed:
        put(",".join(new))
    try:
        yield
    finally:
        if changed:
            put(conf)


def write(weights: SharedWeights | None, named, version: int, alive, timeout: float, to=("policy",), prints=None):
    """Copy `named` (`gather(model)`, consumed under the lock) into the shared tensors of `to`, with their
    fingerprints (queued on the device; the host waits once, after the loop) or --lag's kept `prints`; then
    move the version(s). `weights` None: a rank that only joins the all-gathers."""
    if weights is None:
        return join_gathers(named)
    targets = [t for key, t in (("policy", weights.tensors), ("pi_ref", weights.pi_ref)) if key in to]
    row, sums = {n: i for i, n in enumerate(weights.prints[0])}, {}  # {row of the fingerprints: its sums}
    acquire(weights.lock, alive, timeout)  # while it is held no reader begins; those inside leave first
    try:
        no_readers(weights, alive, timeout)
        for name, t in named:  # tied names share a tensor: `named` gives it once
            for target in targets:
                target[name].copy_(t, non_blocking=True)
            if prints is None and name in row:
                sums[row[name]] = fingerprint(t)  # on t's device, queued behind its copies: no wait here
        synchronize([t for target in targets for t in target.values()])  # done before the version moves
        if "policy" in to:
            weights.prints[1].copy_(on_host(sums, weights.prints[1]) if prints is None else prints)
            weights.version.value = version
        if "pi_ref" in to:
            weights.pi_ref_version.value = version
    finally:
        weights.lock.release()


class Outbox:
    """The trainer's side of the weight path, on every rank (each node's leader holds the shared copy; the other
    ranks, `shared` None, only join the all-gathers): the shared copy allocated once (`share`), written
    (`write`), and with --lag the weights of the last L steps kept on the CPU (`keep`, `history`) until the
    searchers' rounds need them; what a checkpoint keeps of them (`saved`)."""

    def __init__(self, shared: SharedWeights | None, lag: int | None, timeout: float):
        self.shared, self.lag, self.timeout = shared, lag, timeout
        self.history = {}  # --lag: step -> the weights of that step (CPU), L steps back and those still to serve
        self.prints = {}   # --lag: step -> their fingerprints, computed where they were gathered (the GPU)
        self.model_prints = None  # --model's weights' `identity` (a leader's), carried by checkpoints

    def share(self, model, version: int, dtype, with_pi_ref: bool, saved: dict | None = None, weights_dtype=None):
        """Allocate the shared copy from `model` (every rank gathers) at `version`; with `saved` (a checkpoint's)
        the older weights the searchers held, --lag's history and TBA′'s pi_ref. `model_prints`: --model's identity,
        the version-0 fingerprints of a fresh run (`weights_dtype`: the trainer's), or a checkpoint's."""
        allocate(self.shared, gather(model, dtype), aliases(model), next(model.parameters()).device, dtype,
                 with_pi_ref=with_pi_ref)
        if self.shared is None:
            return
        self.model_prints = saved.get("model_prints") if saved else identity(self.shared, dtype, weights_dtype)
        self.shared.version.value = version
        if self.lag is not None:  # the weights the next rounds need: the checkpoint's L steps, and these
            names = {n: t for n, t in self.shared.tensors.items() if n not in aliases(model)}
            pin = next(iter(names.values())).is_cuda  # page-locked host memory: copies at the bus's speed
            self.ring = [flat_slot({n: (t.shape, t.dtype) for n, t in names.items()}, pin)
                         for _ in range(self.lag + 1)]  # allocated once, reused: step v's weights in slot v % (L + 1)
            for v, w in sorted((saved or {}).get("history", {}).items()):
                if int(v) >= version - self.lag:
                    self.keep(w.items(), int(v))
            self.keep(names.items(), version)
            first = max(0, version - self.lag)  # round `version`'s, where the searchers begin
            if first != version:
                self.write(self.history[first].items(), first, lambda: None)
        elif saved and saved["synced"] is not None:  # the searchers held older weights
            self.write(saved["synced"].items(), saved["synced_version"], lambda: None)
        if saved and saved["pi_ref"] is not None:  # TBA′: pi_ref of the latest reset
            self.write(saved["pi_ref"].items(), saved["pi_ref_version"], lambda: None, to=("pi_ref",))

    def write(self, named, version: int, alive, to=("policy",)):
        """`write` into the shared copy (under its lock; `alive()` checks the searchers while waiting for it); --lag's
        history carries the fingerprints its weights had where they were gathered."""
        write(self.shared, named, version, alive, self.timeout, to=to, prints=self.prints.get(version))

    def keep(self, named, version: int) -> dict | None:
        """--lag: the weights of step `version` into the history, in its slot of the ring of L + 1 host buffers
        (every rank joins the all-gathers; the leader's copies and fingerprints are queued on the device without
        waiting, so the next all-gather follows at once, and the host waits once, after the loop, when the
        fingerprints come to it: `on_host`). The slot held step `version` - L - 1's, which no round needs any more:
        the batch just trained was sampled by the weights of step `version` - 1 - L. Returns the copy on a leader,
        else None."""
        if self.shared is None:
            return join_gathers(named)
        slot = self.ring[version % len(self.ring)]
        names, shared = self.shared.prints
        row, sums = {n: i for i, n in enumerate(names)}, {}
        for n, t in named:
            slot[n].copy_(t.detach(), non_blocking=True)
            sums[row[n]] = fingerprint(t)
        prints = on_host(sums, shared)  # the copies before them on the stream done too
        synchronize([t for t in self.shared.tensors.values()])  # and those of every device (no-op on the CPU)
        self.history = {v: w for v, w in self.history.items() if w is not slot}
        self.history[version] = slot
        self.prints = {v: p for v, p in self.prints.items() if v in self.history}
        self.prints[version] = prints
        return slot

    def forget(self, before: int):
        """Drop the history's weights older than step `before`."""
        for v in [v for v in self.history if v < before]:
            del self.history[v]
            self.prints.pop(v, None)

    def saved(self, step: int) -> dict:
        """What a checkpoint keeps (a leader): the weights the searchers hold if older than step `step`'s, TBA′'s
        pi_ref, and --lag's history from step - L on."""
        cpu = lambda tensors: {n: t.cpu() for n, t in tensors.items()}
        s = self.shared
        return dict(synced=cpu(s.tensors) if s.version.value != step else None, synced_version=s.version.value,
                    model_prints=self.model_prints,
                    pi_ref=cpu(s.pi_ref) if s.pi_ref is not None else None, pi_ref_version=s.pi_ref_version.value,
                    history={v: dict(w) for v, w in self.history.items() if v >= step - self.lag} if self.lag is not None
                    else {})


# --- searcher side -----------------------------------------------------------------------------------
class Inbox:
    """A searcher's side of the weight path: the shared copy once the trainer has handed it over (`receive`), the
    wait for one version (--lag: `wait_for`) and the lock around a read (`read`). `alive()` raises Dead once the
    trainer is gone; every wait polls, checks it and has a timeout, and ends once `stop` is set (None: never)."""

    def __init__(self, shared: SharedWeights, me: int, stop, alive, timeout: float):
        self.shared, self.me, self.stop, self.alive, self.timeout = shared, me, stop, alive, timeout
        receive(shared, stop, alive)

    def wait_for(self, version: int | None, beat=lambda: None, pi_ref: bool = False):
        """--lag: say which version the next round needs (`wants`) and wait for it, beating every 5 s; None:
        streaming, the newest, no wait. `pi_ref`: wait for pi_ref of that version instead (TBA′ with
        --lag)."""
        if version is None:  # streaming: the newest, whichever it is
            return
        counter = self.shared.pi_ref_version if pi_ref else self.shared.version
        if not pi_ref:
            self.shared.wants[self.me] = version
        deadline, last_beat = time.time() + self.timeout, time.time()
        while counter.value != version and not (self.stop and self.stop.is_set()):
            if counter.value > version:
                raise RuntimeError(f"the {'pi_ref' if pi_ref else 'weights'} of step {counter.value} were published "
                                   f"while this searcher needed those of step {version}")
            self.alive()
            if time.time() > deadline:
                raise TimeoutError(f"the weights of step {version} did not come in {self.timeout:g} s (--timeout)")
            if time.time() - last_beat > 5:  # alive to the trainer's watch
                beat()
                last_beat = time.time()
            time.sleep(0.01)

    def announce(self, version: int | None):
        """--lag: the version this searcher's next round needs, said as soon as it holds this round's, so that the
        trainer may publish it while this round is made (a searcher needs a version only until it has loaded it)."""
        self.shared.wants[self.me] = -1 if version is None else version

    def versions(self) -> tuple[int, int]:
        """(the policy's version, pi_ref's) in the shared copy now."""
        return self.shared.version.value, self.shared.pi_ref_version.value

    @contextlib.contextmanager
    def read(self, *devices):
        """This searcher's hold of the shared copy while it reads (`reading`), beside the other searchers: what it
        holds then (`Held`), which the searcher loads and checks; nothing else of the shared copy is its to touch."""
        with reading(self.shared, self.me, self.alive, self.timeout, *devices):
            s = self.shared
            yield Held(s.version.value, list((s.tensors or {}).items()), s.prints, s.pi_ref_version.value, s.pi_ref)


@dataclass
class Held:
    """What the shared copy holds while a searcher reads it: the policy's version, its (name, tensor) pairs and the
    trainer's fingerprints of them (`fingerprint`: the arrival check's), pi_ref's version and tensors (TBA′)."""
    version: int
    tensors: list
    prints: tuple
    pi_ref_version: int
    pi_ref: dict


def receive(weights: SharedWeights, stop, parent_alive):
    """Wait for the trainer's handoff (unless the tensors came at spawn), polling, never on a stopped
    or dead trainer."""
    while weights.tensors is None and not stop.is_set():
        try:
            weights.tensors, weights.pi_ref, weights.prints = weights.handoff.get(timeout=WAIT)
        except Empty:
            parent_alive()


# --- the lock and its synchronisation ----------------------------------------------------------------
def acquire(lock, alive, timeout: float):
    """Take `lock`, polling; `alive()` raises Dead if the process we wait for has died."""
    deadline = time.monotonic() + timeout
    while not lock.acquire(timeout=WAIT):
        alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"weight-sync lock not free after {timeout:.0f} s")


@contextlib.contextmanager
def reading(weights: SharedWeights, me: int, alive, timeout: float, *devices):
    """Searcher `me`'s hold of the shared copy while it reads (the module docstring, 3): flagged in `reading`
    under the lock, and its CUDA copies waited for before the flag goes (vLLM's reload never synchronises)."""
    acquire(weights.lock, alive, timeout)
    weights.reading[me] = 1
    weights.lock.release()
    try:
        yield
        synchronize([*(weights.tensors or {}).values(), *(weights.pi_ref or {}).values()], *devices)
    finally:
        weights.reading[me] = 0


class Reading(TimeoutError):
    """A reader still flagged after --timeout: searcher `reader` (of this node) stopped while it read the weights."""

    def __init__(self, reader: int, timeout: float):
        super().__init__(f"searcher {reader} has read the weights for {timeout:g} s")
        self.reader = reader


def no_readers(weights: SharedWeights, alive, timeout: float):
    """The writer, holding the lock: wait until no searcher reads the copy, polling; `alive()` raises Dead at once for
    one that died (its flag stays up), and one still reading after `timeout` stopped while it read (`Reading`)."""
    deadline = time.monotonic() + timeout
    while any(weights.reading[:]):
        alive()
        if time.monotonic() > deadline:
            raise Reading(next(i for i, flag in enumerate(weights.reading[:]) if flag), timeout)
        time.sleep(0.001)


def synchronize(tensors, *devices):
    """Wait for all work queued on the CUDA devices of `tensors` and `devices` (no-op on the CPU)."""
    cuda = {t.device for t in tensors if t.is_cuda} | {torch.device(d) for d in devices if torch.device(d).type == "cuda"}
    for d in cuda:
        torch.cuda.synchronize(d)
