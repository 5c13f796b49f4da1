"""Stress test of the weight-sync protocol (weights.py): a trainer publishing many versions while a
spawned searcher-like reader keeps copying them out must never leave the reader with a mix of two
versions, nor with weights other than the version it read while flagged (`weights.reading`), and the reader must
end on the last version. Then the lock's own rules, in threads (no engine): readers share the copy, the writer waits
for those inside and excludes new ones, and names one that stopped while it read.

Each shared tensor is filled with its version number, so a correct copy is uniform and equal to
the version read while flagged. The reader gets the tensors the way searchers do: spawned before
they exist, then `weights.receive` from `SharedWeights.handoff` (CPU: shared memory; GPU: CUDA IPC
handles of tensors on cuda:0, read from cuda:1 when there is one, else cuda:0).

Negative controls (they must DETECT a violation, which shows the check can fail):
- CPU, "nolock": a reader that ignores the lock and its flag. Being flagged is then the whole protocol on the
  CPU: a CPU copy_ is done when it returns (non_blocking means nothing for CPU-to-CPU copies), so
  a reader flagged while it copies cannot race, with or without `synchronize`; the
  "nosync" race below cannot occur on the CPU.
- GPU, "nosync": a reader flagged while it enqueues its copies that lowers its flag without
  waiting for them (`unsynced`: `reading` without its `synchronize`; through `reading` itself, which waits
  for the shared tensors' devices whatever it is given, the control could never fail). On the CPU the same
  path, its copies queued on a thread standing in for a stream, is seen to tear
  (test_the_nosync_path_can_tear_where_the_locked_one_cannot). vLLM's reload enqueues copies and
  never synchronises (vllm/model_executor/model_loader/reload/): a copy between GPUs runs on the
  source GPU's current stream and `copy_` returns before the bytes move (upstream aten/src/ATen/
  native/cuda/Copy.cu, copy_device_to_device). To make "still in flight" certain rather than a
  matter of copy sizes, the reader queues a spin kernel (`torch.cuda._sleep`, torch/cuda/
  __init__.py:238) ahead of its copies on that stream, as busy streams or slow links would; the
  same delay is used in the "locked" mode, where `reading` must wait it out (torch.cuda.synchronize
  = all streams of this process on that device, torch/cuda/__init__.py:1209-1219). Detection needs
  the GPU to run the writer's copies (another process: time-sliced, or concurrent under MPS)
  before or among the reader's late ones; a GPU that ran them strictly in submission order would
  hide the race, not make the protocol safe.

CUDA IPC lifetimes: the producer (this test process) keeps the shared tensors alive until the
reader has been joined, so the consumer never outlives them (the reader maps the producer's memory,
torch/multiprocessing/reductions.py:153-219; torch keeps a sent block until the consumer's reference
counter drops, torch/include/torch/csrc/CudaIPCTypes.h:22-75). Every wait here has a deadline and
checks that the other process lives.
"""

import contextlib
import queue
import threading
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from runtime import weights
from conftest import get_report
from runtime.errors import Dead

TIMEOUT = 60.0  # s: any wait on the other process (lock, queue, join)
VERSIONS = 200
DETECT_SECONDS = 30.0  # negative controls: publish until the reader reports a violation, at most this long
# (it stops at the first: seconds; the bound only matters when other processes share the cores or, on a GPU, when
# the control fails: it must not take the lease's tests stage with it)
SLEEP_LOCKED = 10**7      # GPU clock cycles (~5 ms) queued ahead of each read's copies
SLEEP_NOSYNC = 2 * 10**8  # ~100 ms: the writer publishes several versions while the copies wait
# s between publishes. CPU: none, back to back is the most contention, and filling the writer's
# tensors leaves the reader time to take the lock. GPU: filling is only a kernel launch, so the
# writer would take the lock straight back and starve the reader; 2 ms lets it in.
PACE = {"cpu": 0.0, "cuda": 0.002}
# (name, elements): a few tensors, so that a read can straddle two versions
SHAPES = {"cpu": [(f"w{i}", 2**16) for i in range(4)],   # 256 KiB each: fast, still a race without the lock
          "cuda": [(f"w{i}", 2**23) for i in range(4)]}  # 32 MiB each: copies take measurable time


def parent_alive():
    parent = mp.parent_process()
    if parent is not None and not parent.is_alive():
        raise Dead("the test process is gone")


def reader_device(kind: str) -> torch.device:
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device("cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0")


@contextlib.contextmanager
def unsynced(shared, me, alive, timeout):
    """The "nosync" defect: `weights.reading` without its wait for the devices, so the flag goes while the reader's
    copies may still be queued behind other work on a stream, and the writer may overwrite what they read."""
    weights.acquire(shared.lock, alive, timeout)
    shared.reading[me] = 1
    shared.lock.release()
    try:
        yield
    finally:
        shared.reading[me] = 0


def reader(shared, mode, kind, ready, detected, stop, results):
    """The searcher side: sync whenever the version moves (every loop in "nolock"), then check the
    copy; report {"seen", "syncs", "bad", "examples", "last"} or {"error"} on `results`."""
    try:
        torch.set_num_threads(1)  # small copies; OpenMP threads spinning on a shared CPU only slow both sides
        device = reader_device(kind)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # as vLLM's worker does before anything is received
        weights.receive(shared, stop, parent_alive)
        if shared.tensors is None:
            raise RuntimeError("stopped before the handoff")
        names = sorted(shared.tensors)
        sources = sorted({t.device for t in shared.tensors.values()}, key=str)
        mine = {n: torch.empty(shared.tensors[n].shape, dtype=shared.tensors[n].dtype, device=device) for n in names}
        version, seen, syncs, bad, examples = 0, set(), 0, 0, []
        deadline = time.monotonic() + TIMEOUT

        def copy():
            v = shared.version.value
            if device.type == "cuda":  # the copies wait behind other work on the source GPU's stream
                for d in sources:
                    with torch.cuda.device(d):
                        torch.cuda._sleep(SLEEP_NOSYNC if mode == "nosync" else SLEEP_LOCKED)
            for n in names:  # as vLLM's reload: param.data.copy_(loaded_weight), non-blocking
                mine[n].copy_(shared.tensors[n], non_blocking=True)
            return v

        ready.set()
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reader: no new version in {TIMEOUT:.0f} s (version {version}, {syncs} syncs)")
            parent_alive()
            final = stop.is_set()  # before reading the version: after stop, this read is the last
            if shared.version.value == version and mode != "nolock":
                if final:
                    break
                time.sleep(0.0005)
                continue
            if mode == "locked":
                with weights.reading(shared, 0, parent_alive, TIMEOUT, device):
                    v = copy()
            elif mode == "nosync":  # the defect: the flag goes before the copies are done
                with unsynced(shared, 0, parent_alive, TIMEOUT):
                    v = copy()
            else:  # "nolock"
                v = copy()
            # after the lock is released: the check runs on the reader's device, ordered after its copies
            ranges = [tuple(x.item() for x in torch.aminmax(mine[n])) for n in names]
            syncs += 1
            seen.add(v)
            deadline = time.monotonic() + TIMEOUT  # a bound on a stall, not on the whole run (slow on loaded cores)
            if any(lo != v or hi != v for lo, hi in ranges):
                bad += 1
                if len(examples) < 5:
                    examples.append({"version": v, "ranges": ranges})
                detected.set()
            version = v
            if mode == "nolock" and final:
                break
        results.put({"seen": sorted(seen), "syncs": syncs, "bad": bad, "examples": examples, "last": version})
    except BaseException:
        results.put({"error": traceback.format_exc()})
    # no cancel_join_thread: at exit the queue's feeder thread must flush the report into the pipe


def run_protocol(kind: str, mode: str) -> dict:
    """Trainer side: spawn the reader, allocate and hand off the shared tensors, publish versions
    1..VERSIONS (fewer once a negative control has detected a violation), stop; the reader's report."""
    ctx = mp.get_context("spawn")
    shared = weights.create(ctx)
    ready, detected, stop, results = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=reader, args=(shared, mode, kind, ready, detected, stop, results), daemon=True)
    proc.start()  # before the tensors exist, as tba.run spawns its searchers

    def alive():
        if proc.exitcode is not None:
            raise Dead(f"reader died with exit code {proc.exitcode}")


    device = torch.device("cuda:0" if kind == "cuda" else "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the reader; restored below
    try:
        named = [(n, torch.zeros(size, device=device)) for n, size in SHAPES[kind]]
        weights.allocate(shared, named, {}, device, torch.float32)  # version 0: all zeros
        shared.handoff.put((shared.tensors, shared.pi_ref, shared.prints))
        deadline = time.monotonic() + TIMEOUT
        while not ready.wait(timeout=0.5):  # the reader holds the tensors before the first publish
            alive()
            if not results.empty():
                get_report(results, [proc], 1)
            assert time.monotonic() < deadline, "the reader never got the tensors"
        src = dict(named)  # the writer's own tensors, refilled with each version
        v, budget = 0, time.monotonic() + DETECT_SECONDS
        more = ((lambda: v < VERSIONS) if mode == "locked"
                else lambda: not detected.is_set() and time.monotonic() < budget)
        while more():
            v += 1
            for t in src.values():
                t.fill_(v)  # same stream as publish's copies: ordered before them
            weights.write(shared, src.items(), v, alive, TIMEOUT)
            time.sleep(PACE[kind])
        stop.set()
        out = get_report(results, [proc], TIMEOUT)
        out["published"] = shared.version.value
        proc.join(timeout=TIMEOUT)
        return out
    finally:
        stop.set()
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
        shared.handoff.cancel_join_thread()
        torch.set_num_threads(threads)
        # only now may the shared tensors go: the consumer is gone (CUDA IPC: the producer keeps them alive)
        shared.tensors = shared.pi_ref = None


KINDS = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.engine
@pytest.mark.parametrize("kind", KINDS)
def test_reader_never_sees_mixed_versions(kind):
    out = run_protocol(kind, "locked")
    assert out["bad"] == 0, f"{out['bad']} of {out['syncs']} reads were not one version: {out['examples']}"
    assert out["published"] == VERSIONS and out["last"] == VERSIONS
    assert len(out["seen"]) >= 3, f"the reader read too few versions to stress anything: {out['seen']}"


@pytest.mark.engine
def test_check_detects_a_reader_that_ignores_the_lock():
    """CPU negative control: without the lock, reads straddle publishes and the check sees it."""
    out = run_protocol("cpu", "nolock")
    assert out["bad"] >= 1, f"no mixed or mislabelled read in {out['syncs']} unlocked reads"


@pytest.mark.engine
@pytest.mark.cuda
def test_releasing_the_lock_before_the_copies_finish_is_detected():
    """GPU negative control: the flag up only while the copies are enqueued (what `reading` does
    without its synchronize) lets the trainer overwrite tensors still being read."""
    out = run_protocol("cuda", "nosync")
    assert out["bad"] >= 1, (f"no violation in {out['syncs']} reads: the GPU ran the reader's copies before the "
                             f"writer's although the flag went first")


class Stream:
    """A CPU stand-in for a CUDA stream: work queued on it runs later, in order, on a thread of its own, and `wait`
    is torch.cuda.synchronize (a CPU copy_ is done when it returns: only a queue can leave it in flight)."""

    def __init__(self):
        self.work = queue.Queue()
        threading.Thread(target=self.run, daemon=True).start()

    def run(self):
        while True:
            self.work.get()()
            self.work.task_done()

    def wait(self):
        self.work.join()


def test_the_nosync_path_can_tear_where_the_locked_one_cannot(monkeypatch):
    """The GPU negative control's path on the CPU, in threads: a writer publishes versions back to back (`write`,
    tensor by tensor, under the lock); a reader flagged while it queues its copies on a busy stream (a spin ahead of
    them, as the GPU reader's `torch.cuda._sleep`) and lowers its flag without waiting for them (`unsynced`) reads a
    mix of versions, or another than it was flagged for, within a few hundred tries. The same reader through
    `reading`, whose `synchronize` waits for the reader's stream here as torch.cuda.synchronize waits for the
    device's, never does; nor would the control, were it to go through `reading`."""
    shared, noop = weights.create(mp.get_context("spawn"), 1), lambda: None
    names = [f"w{i}" for i in range(8)]
    weights.allocate(shared, [(n, torch.zeros(2**14)) for n in names], {}, "cpu", torch.float32)
    mine, stream, stop = {n: torch.empty(2**14) for n in names}, Stream(), threading.Event()
    me = threading.get_ident()  # the reader; the writer's synchronize waits for its own device, not this stream
    monkeypatch.setattr(weights, "synchronize", lambda *_: stream.wait() if threading.get_ident() == me else None)

    def publish():
        v = 0
        while not stop.is_set():
            v += 1
            weights.write(shared, [(n, torch.full((2**14,), float(v))) for n in names], v, noop, TIMEOUT)
    writer, box = in_thread(publish)

    def read(path) -> tuple[int, bool]:
        """One read through `path`: (the version flagged, whether the copy is that version alone)."""
        with path(shared, 0, noop, TIMEOUT):
            v = shared.version.value
            stream.work.put(lambda: time.sleep(0.002))  # the stream busy: the copies wait behind other work
            for n in names:
                stream.work.put(lambda n=n: mine[n].copy_(shared.tensors[n]))
        stream.wait()  # the check after the copies, as the GPU reader's runs on its stream after them
        return v, all(bool((mine[n] == v).all()) for n in names)
    try:
        locked = [read(weights.reading) for _ in range(200)]
        tries, torn = 0, False
        while not torn and tries < 2000:
            tries, torn = tries + 1, not read(unsynced)[1]
    finally:
        stop.set()
        writer.join(TIMEOUT)
    assert "error" not in box, box
    assert all(intact for _, intact in locked) and len({v for v, _ in locked}) >= 3, locked[-5:]
    assert torn, f"the nosync path never read a torn or mislabelled copy in {tries} tries: the control cannot fail"


def test_a_publish_copies_its_fingerprints_to_the_host_once(monkeypatch):
    """`write` and `Outbox.keep` keep each tensor's fingerprint on the device it was computed on and copy them to the
    host once after the loop (on a GPU one wait a publish, not one a tensor: 339 for Qwen2.5-7B); the fingerprints
    written are each tensor's own, as when each was copied alone; `Outbox.write` of a kept step copies none."""
    import multiprocessing
    g = torch.Generator().manual_seed(0)
    named = [(f"w{i}", torch.randn(5, 3, generator=g)) for i in range(6)]
    shared = weights.create(multiprocessing.get_context("spawn"))
    weights.allocate(shared, named, {}, "cpu", torch.float32)
    outbox = weights.Outbox(shared, 1, TIMEOUT)
    outbox.ring = [weights.flat_slot({n: (t.shape, t.dtype) for n, t in named}, False) for _ in range(2)]
    calls, cpu = [0], torch.Tensor.cpu

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return cpu(self, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "cpu", counted)
    for version, publish in ((1, lambda new: weights.write(shared, iter(new), 1, lambda: None, TIMEOUT)),
                             (2, lambda new: outbox.keep(iter(new), 2))):
        new = [(n, t + version) for n, t in named]
        calls[0] = 0
        publish(new)
        assert calls[0] == 1, f"{calls[0]} copies of fingerprints to the host for one publish"
        got = shared.prints[1] if version == 1 else outbox.prints[2]
        assert torch.equal(got, torch.stack([weights.fingerprint(t) for _, t in new]))
    calls[0] = 0
    outbox.write(outbox.history[2].items(), 2, lambda: None)
    assert calls[0] == 0 and torch.equal(shared.prints[1], outbox.prints[2]) and shared.version.value == 2



# --- the lock's rules, in threads -------------------------------------------------------------------------------------
def shared_copy(searchers: int = 2):
    """SharedWeights with one small tensor, as the trainer makes them (no handoff needed in one process)."""
    shared = weights.create(mp.get_context("spawn"), searchers)
    weights.allocate(shared, [("w", torch.zeros(4))], {}, "cpu", torch.float32)
    return shared


def in_thread(fn):
    """fn() in a daemon thread; its result or exception in `box` once `thread` ends."""
    import threading
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def test_readers_share_the_copy_and_the_writer_waits_for_them():
    """Two searchers read at once (neither waits for the other); a publish waits until both have left, and no reader
    begins while it writes. Before, one lock held through every read made four searchers load one after another."""
    import threading
    shared, noop = shared_copy(), lambda: None
    inside, leave, order = threading.Barrier(3, timeout=10), threading.Event(), []

    def read(me):
        with weights.reading(shared, me, noop, TIMEOUT):
            inside.wait()  # both readers inside at once, or the barrier breaks
            leave.wait(10)
            order.append(f"read {me}")
    readers = [in_thread(lambda me=me: read(me)) for me in (0, 1)]
    inside.wait()
    assert list(shared.reading) == [1, 1]
    writer, box = in_thread(lambda: weights.write(shared, [("w", torch.ones(4))], 1, noop, TIMEOUT))
    time.sleep(0.3)
    assert writer.is_alive() and shared.version.value == 0  # waiting for the readers inside
    def late_read():  # a reader that comes while the writer waits: it may not begin before the write is done
        with weights.reading(shared, 0, noop, TIMEOUT):
            return shared.version.value
    late, late_box = in_thread(late_read)
    time.sleep(0.1)
    leave.set()
    writer.join(10)
    order.append("written")
    late.join(10)
    assert not writer.is_alive() and "error" not in box and shared.version.value == 1
    assert sorted(order[:2]) == ["read 0", "read 1"] and order[2] == "written"
    assert late_box == {"value": 1} and list(shared.reading) == [0, 0]  # it began once the write was done


def test_a_reader_that_stopped_inside_is_named_and_a_dead_one_stops_the_writer_at_once():
    """A searcher's flag that never goes down (it stopped while it read): the writer gives up after the timeout with
    `Reading`, naming it, the version unmoved; a dead one (alive() raises): Dead at once, no wait for the timeout.
    A lock never given back (stopped while it took it): a plain TimeoutError, as before."""
    shared = shared_copy(3)
    shared.reading[2] = 1
    t0 = time.monotonic()
    with pytest.raises(weights.Reading, match="^searcher 2 has read the weights for 0.3 s$") as e:
        weights.write(shared, [("w", torch.ones(4))], 1, lambda: None, 0.3)
    assert e.value.reader == 2 and 0.3 <= time.monotonic() - t0 < 5 and shared.version.value == 0

    def dead():
        raise Dead("searcher 2 (pid 9) died with exit code -9")
    t0 = time.monotonic()
    with pytest.raises(Dead, match="died"):
        weights.write(shared, [("w", torch.ones(4))], 1, dead, 60)
    assert time.monotonic() - t0 < 5 and shared.version.value == 0
    shared.reading[2] = 0
    shared.lock.acquire()  # a searcher stopped between taking the lock and flagging itself
    with pytest.raises(TimeoutError) as e:
        weights.write(shared, [("w", torch.ones(4))], 1, lambda: None, 0.3)
    assert not isinstance(e.value, weights.Reading) and shared.version.value == 0
