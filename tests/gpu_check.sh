#!/usr/bin/env bash
# The checks of the GPU path that need PyTorch with CUDA but not vLLM (a few minutes; test_loss.py's
# two tests of the warm-started tiny model are left out: CPU-only, and 15 s of warm start):
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
import tba, weights, loss, test_gpu, test_weight_protocol  # noqa: F401,E401
loaded = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
print("vllm imported by tba and the tests:", loaded or "no")
sys.exit(1 if loaded else 0)
EOF
} 2>&1 | tee "$SUMMARY"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "setup check failed: see above" | tee -a "$SUMMARY"; exit 1; }

timeout "${GPU_CHECK_TIMEOUT:-900}" "$PY" -m pytest -q -rs -p no:cacheprovider --durations=10 \
  tests/test_gpu.py tests/test_weight_protocol.py tests/test_loss.py \
  -k "not on_policy_gradient_is_reinforce and not chunked_logprobs_equal_the_plain" 2>&1 | tee "$DEST/pytest.log"
rc=${PIPESTATUS[0]}
# what this machine let it check, said plainly; a skip for a missing package fails the check (a
# summary that passed with half of it skipped would claim what was not run)
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$gpus" -ge 2 ]; then
  checked="checked on $gpus GPUs: FSDP2 over NCCL with 2 ranks (all-gathers), weight reads on GPU 1 from GPU 0 (peer copies) and the two-device sync of the lock"
elif [ "$gpus" -eq 1 ]; then
  checked="checked on 1 GPU: FSDP2 at world size 1 (no NCCL all-gather), weight reads on the same GPU; NOT checked (they need 2 GPUs): GPU-to-GPU copies, the two-device sync, NCCL all-gathers"
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
