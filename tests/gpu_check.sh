#!/usr/bin/env bash
# The checks of the GPU path that need PyTorch with CUDA but not vLLM, in one command on a GPU node with
# no network (a few minutes): tests/test_gpu.py (FSDP2 over NCCL across --trainer-dtype x
# --activation-checkpointing, AdamW's float32 moments under bf16 weights, the leaders' gloo group beside
# NCCL with 2 GPUs, the CUDA IPC handoff, chunked log-probs, the GPU refusals and the memory split, and
# that the "cpu" cases stay on the CPU there), tests/test_weight_protocol.py, tests/test_loss.py (its two
# tests of the warm-started tiny model are left out: CPU-only, and 15 s of warm start) and the TL;DR
# full-vocabulary KL (tests/test_authors.py). Nothing here imports vLLM (checked first: the run stops if
# anything does); the tests that need it are not selected.
#     bash tests/gpu_check.sh [python]   # default: $PYTHON, else python3, else python
#     GPU_CHECK_TIMEOUT=seconds          # pytest's limit, default 480: under 10 minutes with the setup
# Writes setup and pytest output, then a summary naming every failed, errored and skipped test, to
# summary.txt and pytest.log in $GPU_CHECK_OUT (default: $OUT if set, else runs/gpu_check in the repository).
# Exit status: pytest's (0 all passed, 1 tests failed, 2 interrupted, 3 internal error, 4 usage error, 5 none
# collected), 124 (or 137) past GPU_CHECK_TIMEOUT, or before anything runs: 10 a package missing
# (torch, transformers, numpy; also after pytest passed when a test skipped or errored for one), 11 torch
# sees no CUDA device, 13 the import check failed or imported vLLM. A torch other than 2.13 (the version the GPU
# path was written against) runs the checks, with a warning in the summary. Then tools/gpu_probe.py prints the
# weight path's, a MATH step's and the seeded sampler's figures (probe.jsonl; docs/gpu.md).
set -uo pipefail
here=$PWD
absolute() { case $1 in /*) echo "$1" ;; */*) echo "$here/$1" ;; *) echo "$1" ;; esac; }  # before the cd
PY=$(absolute "${1:-${PYTHON:-$(command -v python3 || command -v python || echo python3)}}")
DEST=${GPU_CHECK_OUT:-${OUT:-}}
[ -z "$DEST" ] || DEST=$(absolute "$DEST")
cd "$(dirname "$0")/.."
DEST=${DEST:-runs/gpu_check}
mkdir -p "$DEST"
SUMMARY=$DEST/summary.txt

{
  echo "== $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null || echo '?') with $PY"
  if command -v nvidia-smi >/dev/null; then nvidia-smi -L; else echo "nvidia-smi: not found"; fi
  "$PY" - <<'EOF'
import sys
missing = []
for name in ("torch", "transformers", "numpy"):  # every selected test needs transformers (tests/conftest.py)
    try:
        __import__(name)
    except ImportError:
        missing.append(name)
if missing:
    print("missing packages:", ", ".join(missing), "(pip install them: nothing was run)")
    sys.exit(10)
import importlib.util
import torch
import transformers
n = torch.cuda.device_count()
print("torch", torch.__version__, "CUDA", torch.version.cuda, "devices", n,
      [(torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i)) for i in range(n)])
print("transformers", transformers.__version__, "installed:",
      {m: importlib.util.find_spec(m) is not None for m in ("pynvml", "vllm")})
if not torch.__version__.startswith("2.13."):  # the trainer's side needs no vLLM: checked on this torch, said so
    print(f"warning: torch {torch.__version__}: the GPU path is written against torch 2.13 (vLLM 0.32 pins 2.13.0); "
          f"the checks run on this one, and what they show holds for it")
if torch.version.cuda is None or n == 0:
    print("torch sees no CUDA device: nothing of the GPU path can be checked here")
    sys.exit(11)
sys.path[:0] = [".", "tests"]
try:
    import tba, loss, test_gpu, test_weight_protocol, test_loss, test_authors  # noqa: F401,E401
    from runtime import weights, nodes, policy, ranks  # noqa: F401,E401
except Exception as e:
    print("import check failed:", repr(e))
    sys.exit(13)
loaded = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
print("vllm imported by tba and the tests:", loaded or "no")
sys.exit(13 if loaded else 0)
EOF
} 2>&1 | tee "$SUMMARY"
setup=${PIPESTATUS[0]}
if [ "$setup" -ne 0 ]; then echo "== setup check failed (exit status $setup): nothing was run" | tee -a "$SUMMARY"; exit "$setup"; fi
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")

# -rfEs: -r replaces pytest's default (fE), so failures and errors are named beside the skips
timeout -k 30 "${GPU_CHECK_TIMEOUT:-480}" "$PY" -m pytest -q -rfEs -p no:cacheprovider --durations=10 \
  tests/test_gpu.py tests/test_weight_protocol.py tests/test_loss.py tests/test_authors.py::test_full_vocabulary_kl_and_nll \
  -k "not on_policy_gradient_is_reinforce and not chunked_logprobs_equal_the_plain" 2>&1 | tee "$DEST/pytest.log"
rc=${PIPESTATUS[0]}
# what this machine let it check, said plainly; a skip for a missing package fails the check (a
# summary that passed with half of it skipped would claim what was not run)
both="FSDP2 with bf16 compute over float32 and bf16 weights, with and without activation checkpointing; AdamW's float32 moments under bf16 weights; the TL;DR full-vocabulary KL on the GPU; CPU runs staying on the CPU beside CUDA"
if [ "$gpus" -ge 2 ]; then
  what="on $gpus GPUs: $both; FSDP2 over NCCL with 2 ranks (all-gathers between GPUs); the leaders' gloo group beside NCCL (two nodes' leaders on GPUs 0 and 1); weight reads on GPU 1 from GPU 0 (peer copies) and the two-device sync of the lock"
else
  what="on 1 GPU: $both; FSDP2 over NCCL at world size 1 (its all-gathers and reduce-scatters still go through NCCL, within one rank); weight reads on the same GPU; NOT covered (they need 2 GPUs): NCCL between two GPUs, the leaders' gloo group beside NCCL, GPU-to-GPU copies, the two-device sync"
fi
missing=$(grep -E "^(SKIPPED|ERROR).*(could not import|No module named|ModuleNotFoundError)" "$DEST/pytest.log" || true)
{
  echo "== pytest exit status $rc$([ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && echo " (stopped after ${GPU_CHECK_TIMEOUT:-480} s)")"
  grep -E "^(FAILED|ERROR|SKIPPED)" "$DEST/pytest.log"
  tail -n 1 "$DEST/pytest.log"
  if [ "$rc" -eq 0 ] && [ -z "$missing" ]; then echo "== checked $what"; else echo "== ran, NOT all passed: $what"; fi
  [ -z "$missing" ] || echo "== parts skipped or errored for a missing package (above): the check is incomplete (exit status 10)"
} | tee -a "$SUMMARY"
if [ "$rc" -eq 0 ] && [ -n "$missing" ]; then rc=10; fi
if [ "${GPU_CHECK_PROBE:-1}" = 1 ]; then  # the figures at Qwen2.5-7B's shapes: under 4 minutes on one GPU
  timeout -k 30 300 "$PY" tools/gpu_probe.py > "$DEST/probe.jsonl" 2>> "$DEST/pytest.log"
  echo "== probe exit status $? ($(wc -l < "$DEST/probe.jsonl") figures in probe.jsonl)" | tee -a "$SUMMARY"
fi
exit "$rc"
