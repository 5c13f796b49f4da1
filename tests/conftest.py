"""Shared fixtures: tiny models made here (no downloads; tests/models.py), a runner for `tba.py` as a subprocess,
runs that several tests read made once a session (`shared_run`), and refusals checked in-process (`refusal`)."""

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from queue import Empty

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.join(ROOT, "tools"))  # bench, plot and trl_grpo, imported by their tests
DATA = os.path.join(ROOT, "tests", "data", "gsm8k")
TLDR = os.path.join(ROOT, "tests", "data", "tldr")
MATH = os.path.join(ROOT, "tests", "data", "math")
# the device of the Engine tests (tests/test_weight_sync.py, test_lag.py, test_slowdown.py): the CPU here, a GPU
# where vLLM's CUDA build is installed (tests/gpu_engine_check.sh sets it)
DEVICE = os.environ.get("TBA_TEST_DEVICE", "cpu")
SMALL = ["--prompts-per-step", "4", "--samples-per-prompt", "4", "--max-new-tokens", "6", "--lr", "1e-3"]  # a toy run


BUILD_WAIT = 1800  # s a worker waits for another's build of a cached model (a warm start: minutes on busy cores)


@contextlib.contextmanager
def locked(path: str, what: str):
    """Hold the file lock at `path` (polled: it goes with its holder's death, and a holder that stops answering
    meets BUILD_WAIT's deadline, `what` it was doing named in the error)."""
    import fcntl
    with open(path, "w") as lock:
        deadline = time.time() + BUILD_WAIT
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.time() > deadline:
                    raise TimeoutError(f"another worker has {what} for over {BUILD_WAIT} s") from None
                time.sleep(1)
        yield


def cached_model(name: str, recipe: str, build) -> str:
    """The folder of a model that `build(path)` makes and saves there, returning what its warm start did (kept
    as warm_start.json, for tests/test_tiny.py); under $TBA_TEST_CACHE (default ~/.cache/tba/tests) by a name
    that changes with `recipe` (the code and settings it is made by): made once, by whichever pytest worker asks
    first while the others wait on its lock, and reused by later sessions."""
    import hashlib
    root = os.environ.get("TBA_TEST_CACHE", os.path.expanduser("~/.cache/tba/tests"))
    cache = os.path.join(root, f"{name}-{hashlib.sha256(recipe.encode()).hexdigest()[:16]}")
    done = os.path.join(cache, "warm_start.json")  # written last: complete
    os.makedirs(root, exist_ok=True)
    with locked(cache + ".lock", f"built {cache}"):
        if not os.path.isfile(done):
            part = cache + f".{os.getpid()}"
            shutil.rmtree(part, ignore_errors=True)
            warm = build(part)
            with open(os.path.join(part, "warm_start.json"), "w") as f:
                json.dump(warm, f)
            shutil.rmtree(cache, ignore_errors=True)
            os.replace(part, cache)
    return cache


@pytest.fixture(scope="session")
def tiny_model():
    """The `tiny` model's shape (0.65M parameters, character tokenizer) with room for GSM8K prompts,
    warm-started (about 15 s, once: cached_model) until about 20% of arith answers are right: rewards vary, so
    training has a signal (with all rewards 0 and the policy equal to pi_ref, the TB gradient is exactly zero).
    Smaller models plateau below 10% here, too rarely right for runs of 4 prompts x 4 samples."""
    from runtime import tiny
    r = tiny.RECIPE

    def build(path):
        model, tokenizer = tiny.make_model(path, r["hidden"], r["layers"], r["heads"], r["ffn"], max_len=1024)  # GSM8K fits
        done = tiny.warm_start(model, tokenizer, steps=600, batch=64, lr=r["sft_lr"], seed=0, target=0.2)
        model.save_pretrained(path)
        return done
    return cached_model("tiny", open(tiny.__file__).read() + json.dumps(r, sort_keys=True) + "600 64 0.2 1024", build)


@pytest.fixture(scope="session")
def tiny_neox(tmp_path_factory):
    """A tiny GPT-NeoX (Pythia's architecture; vLLM 0.32 serves it through its Transformers backend)
    with a byte-level BPE tokenizer (512 subword tokens), randomly initialised."""
    import models
    path = str(tmp_path_factory.mktemp("neox") / "model")
    models.make_model(path, hidden=64, layers=2, heads=2, max_len=1024, arch="gpt_neox", tokenizer=models.make_bpe_tokenizer())
    return path


@pytest.fixture(scope="session")
def tiny_rm(tmp_path_factory):
    """A tiny GPT-NeoX reward model (one output) with the same BPE tokenizer as `tiny_neox`."""
    import models
    path = str(tmp_path_factory.mktemp("rm") / "model")
    models.make_reward_model(path, arch="gpt_neox", tokenizer=models.make_bpe_tokenizer(), max_len=1024, seed=1)
    return path


def env(tmp):
    e = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TBA_CACHE=str(tmp / "cache"))
    e.pop("RANK", None)
    return e


def run_tba(args, tmp, timeout=300, torchrun=None):
    """Run tba.py to completion; returns the CompletedProcess (stdout and stderr together)."""
    cmd = [sys.executable, os.path.join(ROOT, "tba.py"), *args]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={torchrun}", *cmd[1:]]
    return subprocess.run(cmd, cwd=str(tmp), env=env(tmp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)


@pytest.fixture
def refusal(tmp_path, monkeypatch, capfd):
    """`refusal(args)`: tba.main(args) in this process, for a run that is refused before anything starts (no
    subprocess: its imports and the searchers' fork server cost seconds of CPU each); a run that gets past the
    checks fails the test instead of running here. Returns (exit status, the lines printed to stdout and stderr,
    captured at the file descriptors, a C library's output too, then each warning a command line would show, as
    "warning: ...").
    The environment is restored after. The command line's own refusals are tested as subprocesses (test_config,
    test_checks)."""
    import warnings

    import tba
    monkeypatch.setattr(tba, "run", lambda *a: pytest.fail("not refused: the run would start"))

    def call(args):
        monkeypatch.chdir(tmp_path)
        environ = dict(os.environ)
        os.environ.update(env(tmp_path))
        os.environ.pop("RANK", None)
        capfd.readouterr()
        try:
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("default")  # as a command line shows them (Python's default filters)
                for quiet in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                    warnings.simplefilter("ignore", quiet)
                tba.main([str(a) for a in args])
            status = 0
        except SystemExit as e:
            status = e.code
        finally:
            os.environ.clear()
            os.environ.update(environ)
        out = capfd.readouterr()
        return status, (out.out + out.err).strip().splitlines() + [f"warning: {w.message}" for w in said]
    return call


def shared_run(tmp_path_factory, name: str, args, **kw):
    """One tba.py run (`args`, its --out given here) that several tests read and none writes into, made once a
    session: by the first pytest worker to ask, while the others wait on its lock. Returns (its --out folder, its
    output); a run that failed or timed out fails each test that reads it, with its output."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root  # the session's, shared by its workers
    folder, done = root / f"shared-{name}", root / f"shared-{name}.json"  # written last: complete
    given = [*map(str, args), json.dumps(kw, sort_keys=True)]
    with locked(str(folder) + ".lock", f"run {folder}"):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                p = run_tba([*args, "--out", str(folder / "run")], folder, **kw)
                p = dict(returncode=p.returncode, stdout=p.stdout)
            except subprocess.TimeoutExpired as e:  # said once: every reader fails on it, none runs it again
                p = dict(returncode=None, stdout=f"{e.output or ''}\n(timed out after {e.timeout} s)")
            done.write_text(json.dumps(dict(p, given=given)))
    p = json.loads(done.read_text())
    assert p["given"] == given, f"two shared runs named {name!r}: {p['given']} and {given}"
    assert p["returncode"] == 0, p["stdout"][-3000:]
    return folder / "run", p["stdout"]


HAS_WANDB = importlib.util.find_spec("wandb") is not None


@pytest.fixture
def logged_run(tiny_model, tmp_path_factory):
    """(its --out, its output) of a short synchronous run whose output is a pipe (not a terminal), with --wandb
    where it is installed (offline): made once a session (shared_run) for test_watch and test_e2e."""
    wandb = ["--wandb", "tba-tests"] if HAS_WANDB else []
    os.environ["WANDB_MODE"] = "offline"  # run_tba's environment copies os.environ
    try:
        return shared_run(tmp_path_factory, "logged", ["--model", tiny_model, *SMALL, "--searchers", "0", "--steps",
                                                       "5", "--eval-every", "2", "--log-every", "2", *wandb])
    finally:
        os.environ.pop("WANDB_MODE")


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def get_report(queue, procs, timeout: float):
    """The next message on `queue` from spawned test processes; fails on the deadline or when every
    process in `procs` has exited (or one has failed) without sending it. A message {"error": traceback}
    is a failure in that process."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            msg = queue.get(timeout=1.0)
            break
        except Empty:
            codes = [p.exitcode for p in procs]
            if queue.empty() and (all(c is not None for c in codes) or any(c not in (None, 0) for c in codes)):
                raise AssertionError(f"spawned processes exited ({codes}) without a report")
            assert time.monotonic() < deadline, f"no report in {timeout:.0f} s"
    assert "error" not in msg, msg["error"]
    return msg


def copy_repo(to) -> str:
    """The repository's files as git sees them (tracked and new), copied to `to`: a copy a test's commands may write
    into (runs/, a task file into tasks/, a page's code applied)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, stdout=subprocess.PIPE,
                           text=True, check=True).stdout.splitlines()
    for f in files:
        if os.path.isfile(os.path.join(ROOT, f)):
            os.makedirs(os.path.dirname(os.path.join(to, f)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), os.path.join(to, f))
    return str(to)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a test's own process group), below Linux's ephemeral
    range (32768-60999): a port the kernel hands out (bind to 0, an outgoing connection: vLLM's, gloo's) may be
    taken by another test's process in the seconds before this test's rank binds it (EADDRINUSE)."""
    import random
    import socket
    while True:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port := random.SystemRandom().randrange(20000, 32000)))  # (unseeded)
                return port
            except OSError:
                continue


def report_of(target, *args, timeout: float = 300):
    """Run target(*args, port, results) in one spawned process with a free port for its process group;
    its report (get_report: a deadline, and a failure if the process dies without one). The process
    is joined, or killed, before this returns."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, free_port(), results), daemon=True)
    p.start()
    try:
        return get_report(results, [p], timeout)
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()


@pytest.fixture(autouse=True, scope="module")
def gpt_neox_classes_kept():
    """Every test file leaves transformers' GPT-NeoX classes as it found them (classes_kept), whichever of
    its tests started a vLLM engine of a GPT-NeoX model in the pytest process."""
    from transformers.models.gpt_neox import modeling_gpt_neox
    with classes_kept(modeling_gpt_neox):
        yield


@contextlib.contextmanager
def classes_kept(module):
    """Every class of `module` as it was, afterwards. vLLM's Transformers backend rewrites the decoder class
    of an architecture it serves that way (GPT-NeoX) in place: its bases, __init__ and __call__
    (vllm/compilation/decorators.py:352-359, 434, 756; searcher.Engine.beside), so an engine
    started in the pytest process would leave the later test files' GPT-NeoX models needing a vLLM config."""
    saved = {c: (c.__bases__, dict(vars(c))) for c in vars(module).values()
             if isinstance(c, type) and c.__module__ == module.__name__}
    try:
        yield
    finally:
        for c, (bases, attrs) in saved.items():
            if c.__bases__ != bases:
                c.__bases__ = bases
            for name in set(vars(c)) - set(attrs):
                delattr(c, name)
            for name, value in attrs.items():
                if vars(c).get(name) is not value:
                    setattr(c, name, value)


def pytest_configure(config):
    share_the_cores()
    config.addinivalue_line("markers", "engine: starts a vLLM engine, a process of the run or a whole run (the "
                                       "quick loop leaves these out: python -m pytest -q -m 'not engine' tests)")
    config.addinivalue_line("markers", "cuda: needs a CUDA device, skipped without one (tests/gpu_lease.sh runs "
                                       "these: -m cuda)")
    if config.option.durations is None:  # the slowest tests named at the end (CI's log too: the 20-minute budget)
        config.option.durations = 15


def share_the_cores():
    """Under `pytest -n N` (pytest-xdist), worker i and the runs it starts keep to every N-th core from i, or
    with more workers than cores to core i mod cores (the README's -n 3 on 2 cores: two workers take turns on
    one): a run splits the cores it is given (checks: sched_getaffinity), and two workers' OpenMP threads on
    the same cores wait on each other at every parallel region (the tiny model's warm start: 25 s alone,
    280 s beside another)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker and count > 1:
        cores, i = sorted(os.sched_getaffinity(0)), int(worker.removeprefix("gw"))
        os.sched_setaffinity(0, cores[i % count::count] if len(cores) >= count else [cores[i % len(cores)]])


ENGINE_FIXTURES = {"checkpoint", "logged_run", "run"}  # fixtures that run tba.py (test_checks, here)


def pytest_collection_modifyitems(config, items):
    """A test whose fixture starts a run is an engine test too; a `cuda` test is skipped where torch sees no CUDA
    device."""
    cuda = None
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.engine)
        if item.get_closest_marker("cuda"):
            if cuda is None:
                import torch
                cuda = torch.cuda.is_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="no CUDA device visible"))
