"""vLLM's environment and the workarounds its engines need here, in one place. This module imports neither vLLM
nor torch at its top: `set_up()` sets their environment variables before either is imported (they read them at
import), and the fork server imports this module first, with FORK_SERVER set."""

import contextlib
import gc
import os
import signal
import warnings

from runtime.errors import STOPS, ConfigError

# torchrun stops a rank with SIGTERM to its whole process group, the fork server included, which ignores only
# SIGINT (Python 3.11, multiprocessing/forkserver.py:196): dead, it reports every searcher as exit code 255
# (multiprocessing/popen_forkserver.py:69-72). So the server ignores SIGTERM as the searchers do, and ends
# with the trainer. It ignores SIGINT only once its preload imports are done (multiprocessing/forkserver.py:169-196):
# Ctrl-C during them (vLLM's, seconds) printed their KeyboardInterrupt traceback, so it ignores SIGINT from here
# on too (its children get this back, multiprocessing/forkserver.py:300-301; the searchers ignore both anyway).
FORK_SERVER = "TBA_FORK_SERVER"  # set while runtime.fleet.fork_server starts the server
if os.environ.pop(FORK_SERVER, None):
    for sig in STOPS:  # (SIGHUP and SIGUSR1 too: a closed terminal's reaches the whole group)
        signal.signal(sig, signal.SIG_IGN)
    # its preload (vLLM's import, the start's longest wait) with no cyclic GC passing over the heap it grows
    gc.disable()  # (the searchers it forks turn it on again: searcher.run)


def early(argv: list[str]) -> bool:
    """Whether tba.py's command line will start searchers from a fork server (runtime/processes.fork_server),
    judged before torch is imported so that the server's import of vLLM (5-7 s of one core) begins at once:
    each node's first rank, searchers asked for, no help asked, no NVIDIA device (a GPU node spawns its
    searchers). A wrong guess starts the server later or leaves it unused; it stops at exit either way."""
    if os.environ.get("LOCAL_RANK", "0") != "0" or {"-h", "--help"} & set(argv) or os.path.exists("/dev/nvidiactl"):
        return False
    for i, a in enumerate(argv):
        if a == "--searchers" and argv[i + 1:i + 2] == ["0"] or a == "--searchers=0":
            return False
    return True


def quiet_resource_tracker():
    """A searcher killed (-9, a crashed vLLM) leaves a semaphore of its own in multiprocessing's resource tracker,
    the trainer's, which unlinks it at the trainer's exit and warns that it leaked, two lines after the run's one
    (multiprocessing/resource_tracker.py:254). The run has said what happened: the tracker, started by the fork
    server or the trainer's first lock, inherits a filter for that warning alone (idempotent). It is started
    here, ignoring SIGHUP and SIGUSR1 as it does SIGINT and SIGTERM (an ignored signal is inherited across
    exec): a closed terminal's SIGHUP killed it, and its successor printed KeyError tracebacks."""
    from multiprocessing import resource_tracker
    quiet = "ignore::UserWarning:multiprocessing.resource_tracker"
    if quiet not in os.environ.get("PYTHONWARNINGS", ""):
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), quiet]))
    kept = {s: signal.signal(s, signal.SIG_IGN) for s in STOPS[2:]}
    try:
        resource_tracker.ensure_running()
    finally:
        for s, handler in kept.items():
            signal.signal(s, handler)


def start_fork_server():
    """Start the searchers' fork server (multiprocessing's one), which imports vLLM and searcher.py once; N searchers
    then fork from it instead of importing side by side on the cores they share (4 on 2 cores started 10 s later).
    It imports this module first (it ignores SIGTERM and SIGINT there), then searcher.py, so it must find the
    repository: Python 3.11's fork server does not take the trainer's sys.path (multiprocessing/forkserver.py, main),
    so PYTHONPATH is given it for its start. It goes at this process's exit (`stop_fork_server`)."""
    import atexit
    import multiprocessing
    from multiprocessing import forkserver
    quiet_resource_tracker()  # the server starts the resource tracker: its filter first
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["runtime.vllm_env", "searcher", "transformers", "vllm", "vllm.entrypoints.llm"])
    before = os.environ.get("PYTHONPATH")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository, above runtime/
    os.environ["PYTHONPATH"] = os.pathsep.join([root] + ([before] if before else []))
    os.environ[FORK_SERVER] = "1"
    try:
        forkserver.ensure_running()
        atexit.unregister(stop_fork_server)  # once, however often it is called
        atexit.register(stop_fork_server)
    finally:
        del os.environ[FORK_SERVER]
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def stop_fork_server():
    """At the trainer's exit (`start_fork_server` makes it an exit function): the fork server goes at once. It
    starts before the checks, and while it still imports vLLM it ignores SIGINT and SIGTERM and sees no end of the
    trainer, so a refused or stopped run would leave it printing vLLM's import lines after the run's last. Python
    3.11's ForkServer keeps its pid (multiprocessing/forkserver.py:37, 161); its socket is in multiprocessing's
    temporary folder, which the exit functions remove (multiprocessing/connection.py:77, util.py:get_temp_dir)."""
    import sys
    pid = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    pid = pid and pid._forkserver_pid
    if pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def set_up():
    """Set vLLM's and torch's environment for this process (setdefault: the caller's own values win)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the engine in this process (check refuses 1)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    # On CUDA vLLM 0.32 defaults to its V2 model runner where Triton works (vllm/config/vllm.py:703-739);
    # the CPU build, which the tests run, derives from V1. Pin V1 so that a GPU runs the code the tests
    # cover; both reload weights and apply the temperature to processed log-probs.
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    # vLLM 0.32's Triton shim touches torch.distributed.reduce_op, deprecated: two FutureWarnings a process
    warnings.filterwarnings("ignore", message=r"`torch.distributed.reduce_op` is deprecated", category=FutureWarning)


def check():
    """Environment variables that would break the weight path, refused in one line."""
    value = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if value != "0":  # =1 moves vLLM's engine core into a child process (vllm/v1/engine/llm_engine.py:170 ->
        # vllm/v1/engine/core_client.py:125, SyncMPClient), which cannot open the CUDA IPC handles this process
        # received, and where the read hold (weights.reading) no longer covers the copies
        raise ConfigError(f"VLLM_ENABLE_V1_MULTIPROCESSING={value}: tba.py keeps vLLM's engine core in the searcher "
                          f"process (the shared weights and their lock are there); unset it or set it to 0")


def llm_options(cfg, path: str, device, memory: float | None, max_model_len: int) -> dict:
    """vllm.LLM's arguments for an engine of the model at `path` on `device`, kept in this process beside any
    others (vLLM 0.32 lets one process hold several: the later ones reuse its one-rank torch.distributed group
    and model-parallel groups, vllm/distributed/parallel_state.py:1905, 1988, 2366-2404,
    vllm/v1/worker/gpu_worker.py:1664-1678). `memory`: its fraction of the GPU (gpu_memory_utilization); on the
    CPU its KV cache is sized to this run."""
    import torch
    options = dict(model=path, dtype=cfg.dtype, seed=cfg.seed, max_model_len=max_model_len,
                   enforce_eager=device.type == "cpu", enable_prefix_caching=True,
                   use_tqdm_on_load=False)  # its loading bar would break the trainer's
    if device.type == "cuda":  # pick this GPU without hiding the others (CUDA IPC needs them)
        from runtime import gpu
        options.update(device_ids=[device.index], gpu_memory_utilization=memory,
                       # the step budget runtime.gpu's memory estimate assumes, not vLLM's, which varies by card
                       max_num_batched_tokens=gpu.batch_tokens(max_model_len), max_num_seqs=gpu.BATCH_SEQS)
        # vLLM caches its compiled graphs under VLLM_CACHE_ROOT by rank
        # (vllm/compilation/decorators.py:565-584, vllm/compilation/backends.py:1074-1084), and every
        # engine here is rank 0 of its own, while Inductor's code hard-codes the device index: engines
        # on other GPUs would load each other's artifacts. A cache per device index; read when the
        # engine starts (vllm/envs.py).
        import vllm.envs
        root, own = vllm.envs.VLLM_CACHE_ROOT, f"tba-cuda{device.index}"
        os.environ["VLLM_CACHE_ROOT"] = root if os.path.basename(root) == own else os.path.join(root, own)
    else:  # vLLM's sampler torch.compiles its log-prob gather on first use: 3-4 s of C++ build
        # per process on the CPU, for no speed-up there (this process only; GPUs keep compiling)
        torch._dynamo.config.disable = True
        if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # the user's GiB, else what this run needs
            options.update(kv_cache_memory_bytes=cpu_kv_cache_bytes(path, cfg.dtype, max_model_len))
        # A seeded request whose prefill is split over two engine steps crashes the CPU engine: the runner
        # rewinds its generator (vllm/v1/worker/gpu_model_runner.py:3498-3502), which a CPU generator
        # cannot ("CPU Generator does not use offset"). Whole prefills only, as vLLM's own CPU platform
        # does for MLA (vllm/platforms/cpu.py:516-530). It happens once a round's prompts pass the
        # 4,096-token step budget (red-teaming: 32 x 8 requests of a 223-token prompt).
        options.update(enable_chunked_prefill=False)
    return options


def cpu_kv_cache_bytes(path: str, dtype: str, max_model_len: int) -> int:
    """KV cache for vLLM's CPU engine: room for its 256 concurrent sequences (vLLM's CPU default,
    engine/arg_utils.py) of the engine's longest length, between 32 MiB and 1 GiB. The CPU engine
    allocates and zeroes all of it at start: the tiny model needs a few MiB, not the GiBs a default
    would give (0.35 s less start-up per engine, 1 GiB less memory per searcher)."""
    from runtime.gpu import kv_bytes_per_token
    tokens = 256 * -(-max_model_len // 256) * 256  # sequences x length in whole blocks
    return int(min(2**30, max(2**25, kv_bytes_per_token(path, dtype) * tokens)))


@contextlib.contextmanager
def eager_transformers(llm):
    """Build transformers models in a process that runs vLLM (pi_ref, reward models, the synchronous trainer's
    policy) inside this (docs/tasks.md, "Models"). vLLM's Transformers backend (GPT-NeoX in 0.32:
    vllm/model_executor/models/registry.py:709-716) rewrites the transformers decoder class in place
    (vllm/compilation/decorators.py:359, 434, 756, via vllm/model_executor/models/transformers/base.py:172); a copy of
    the engine's config with compilation off gives plain eager models."""
    import copy
    from vllm.config import CompilationConfig, CompilationMode, set_current_vllm_config
    config = copy.copy(llm.llm_engine.vllm_config)
    config.compilation_config = CompilationConfig(mode=CompilationMode.NONE)
    with set_current_vllm_config(config):
        yield


def quiet_loading():
    """No loading and saving bars from transformers in this process (they would break the trainer's
    progress bar and fill logs); the hub's download bars stay."""
    import huggingface_hub.utils
    import transformers
    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.enable_progress_bars()


def engine_params(llm, names: list[str]) -> dict[str, list[str]]:
    """{the engine's parameter: the Hugging Face names loaded into it}, found at the first arrival (the names
    never change); the worker keeps how to read each back (`held_fingerprints`). A name goes where the model's
    loader sends it (hf_to_vllm_mapper: vllm/model_executor/models/utils.py:80-146 stacks q, k, v), or to the
    one parameter whose name ends with it (the Transformers backend's "model."); one that maps to none is in
    no group (runtime.weights.arrival_plan refuses it). A CPU linear weight is repacked for oneDNN
    (vllm/model_executor/layers/utils.py:519-596): read through the layer's product, I x W^T. get_model()
    unwraps CUDA's graph wrapper (vllm/v1/worker/gpu_worker.py:1129-1130;
    vllm/v1/worker/worker_base.py:352-353). A reload keeps each layer's module and its parameters' names
    (vllm/model_executor/model_loader/reload/layerwise.py:417-444)."""
    import torch

    def plan(worker):
        model = worker.get_model()
        params, modules = dict(model.named_parameters()), dict(model.named_modules())
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        groups, eyes, worker.tba_held = {}, {}, []
        for name in names:
            mapped = mapper.map_name(name) if mapper is not None else name
            if mapped is None:  # a name the loader drops: unchecked
                continue
            if mapped not in params:
                ends = [p for p in params if p.endswith("." + mapped) or mapped.endswith("." + p)]
                if len(ends) != 1:
                    continue
                mapped = ends[0]
            groups.setdefault(mapped, []).append(name)
        for param in groups:
            (owner, leaf), t = param.rsplit(".", 1), params[param]
            m = modules[owner]
            key = (m.input_size_per_partition, t.dtype) if t.numel() == 0 and hasattr(m, "cpu_linear") else None
            if key and key not in eyes:  # repacked: read as I x W^T, one identity a size
                eyes[key] = torch.eye(key[0], dtype=t.dtype, device=t.device)
            worker.tba_held.append((m, leaf, eyes.get(key)))
        return groups

    return llm.collective_rpc(plan)[0]


def held_fingerprints(llm) -> list[list[float]]:
    """The three sums (runtime.weights.fingerprint's) of each parameter `engine_params` found, read back
    now."""
    from runtime.weights import held

    def read(worker):
        return [[float(x) for x in held(m.cpu_linear(eye, None, None) if eye is not None else getattr(m, leaf))]
                for m, leaf, eye in worker.tba_held]
    return llm.collective_rpc(read)[0]
