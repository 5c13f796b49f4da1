"""vLLM's environment, set explicitly before torch and vLLM are imported (they read it at import):
tba.py, searcher.py and the tools call `set_up()` at their top, ahead of those imports; `check()`
refuses (config.check) what the user set that would break the weight path.
"""

import os
import warnings

from runtime.errors import ConfigError


def set_up():
    """Set vLLM's and torch's environment for this process (setdefault: the caller's own values win)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the engine in this process (tba.py refuses 1)
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
        # received, and where locked() no longer covers the copies
        raise ConfigError(f"VLLM_ENABLE_V1_MULTIPROCESSING={value}: tba.py keeps vLLM's engine core in the searcher "
                          f"process (the shared weights and their lock are there); unset it or set it to 0")
