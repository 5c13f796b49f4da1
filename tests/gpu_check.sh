#!/usr/bin/env bash
# The checks of the GPU path that need PyTorch with CUDA but not vLLM, in one command on a GPU node with
# no network (a few minutes): tests/test_gpu.py (FSDP2 over NCCL across --trainer-dtype x
# --activation-checkpointing, AdamW's float32 moments under bf16 weights, the leaders' gloo group beside
# NCCL with 2 GPUs, the CUDA IPC handoff, chunked log-probs, the GPU refusals and the memory split),
# tests/test_weight_protocol.py, tests/test_loss.py (its two tests of the warm-started tiny model are left
# out: CPU-only, and 15 s of warm start) and the TL;DR full-vocabulary KL (tests/test_authors.py). Nothing
# here imports vLLM (checked first: the run stops if anything does); the tests that need it are not selected.
#     bash tests/gpu_check.sh [python]      # default: python; GPU_CHECK_TIMEOUT=seconds (default 900)
# Writes pytest.log and summary.txt to $GPU_CHECK_OUT (default: $OUT if set, else runs/gpu_check)
# and exits with pytest's status (124: timed out), or 3 when a part was skipped for a missing
# package, or 4 when no GPU was visible; the summary says what was checked on the GPUs found.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python}
DEST=${GPU_CHECK_OUT:-${OUT:-runs/gpu_check}}
mkdir -p "$DEST"
SUMMARY=$DEST/summary.txt

{
  echo "== $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  if command -v nvidia-smi >/dev/null; then nvidia-smi -L; else echo "nvidia-smi: not found"; fi
  "$PY" - <<'EOF'
import importlib.util, sys
import torch
print("torch", torch.__version__, "CUDA", torch.version.cuda, "devices", torch.cuda.device_count(),
      [(torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())])
print("installed:", {m: importlib.util.find_spec(m) is not None for m in ("transformers", "numpy", "pynvml", "vllm")})
sys.path[:0] = [".", "tests"]
import tba, weights, loss, nodes, test_gpu, test_weight_protocol, test_loss, test_authors  # noqa: F401,E401
loaded = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
print("vllm imported by tba and the tests:", loaded or "no")
sys.exit(1 if loaded else 0)
EOF
} 2>&1 | tee "$SUMMARY"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "setup check failed: see above" | tee -a "$SUMMARY"; exit 1; }

timeout "${GPU_CHECK_TIMEOUT:-900}" "$PY" -m pytest -q -rs -p no:cacheprovider --durations=10 \
  tests/test_gpu.py tests/test_weight_protocol.py tests/test_loss.py tests/test_authors.py::test_full_vocabulary_kl_and_nll \
  -k "not on_policy_gradient_is_reinforce and not chunked_logprobs_equal_the_plain" 2>&1 | tee "$DEST/pytest.log"
rc=${PIPESTATUS[0]}
# what this machine let it check, said plainly; a skip for a missing package fails the check (a
# summary that passed with half of it skipped would claim what was not run)
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
both="FSDP2 with bf16 compute over float32 and bf16 weights, with and without activation checkpointing; AdamW's float32 moments under bf16 weights; the TL;DR full-vocabulary KL on the GPU"
if [ "$gpus" -ge 2 ]; then
  checked="checked on $gpus GPUs: $both; FSDP2 over NCCL with 2 ranks (all-gathers between GPUs); the leaders' gloo group beside NCCL (two nodes' leaders on GPUs 0 and 1); weight reads on GPU 1 from GPU 0 (peer copies) and the two-device sync of the lock"
elif [ "$gpus" -eq 1 ]; then
  checked="checked on 1 GPU: $both; FSDP2 over NCCL at world size 1 (its all-gathers and reduce-scatters still go through NCCL, within one rank); weight reads on the same GPU; NOT checked (they need 2 GPUs): NCCL between two GPUs, the leaders' gloo group beside NCCL, GPU-to-GPU copies, the two-device sync"
else
  checked="no GPU visible: only the CPU parts ran; NOTHING of the GPU path was checked"
fi
missing=$(grep -E "^SKIPPED.*(could not import|No module named)" "$DEST/pytest.log" || true)
{
  echo "== pytest exit status $rc$([ "$rc" -eq 124 ] && echo ' (timed out)')"
  grep -E "^(FAILED|ERROR|SKIPPED)" "$DEST/pytest.log"
  tail -n 1 "$DEST/pytest.log"
  echo "== $checked"
  [ -z "$missing" ] || echo "== parts skipped for a missing package (see above): the check is incomplete, exit status 3"
} | tee -a "$SUMMARY"
if [ "$rc" -eq 0 ] && [ -n "$missing" ]; then rc=3; fi
if [ "$rc" -eq 0 ] && [ "$gpus" -eq 0 ]; then rc=4; fi  # run for the GPU path, and none was there
exit "$rc"
