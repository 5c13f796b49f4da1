#!/usr/bin/env bash
# The Engine's tests on a GPU, where vLLM's CUDA build is installed (pip install -r requirements.txt): the same
# tests the CPU suite runs on vLLM's CPU engine, with TBA_TEST_DEVICE=cuda:0 (tests/conftest.py): the engine
# against the trainer's log-probs after a sync (Llama, GPT-NeoX), tied names, TBA′'s pi_ref, the searcher
# process, the emulation's per-step charges.
#     bash tests/gpu_engine_check.sh [python]     # default: $PYTHON, else python3
# Writes pytest.log and summary.txt to $GPU_CHECK_OUT (default: runs/gpu_engine_check). Exit status: pytest's, or
# 10 when vLLM or CUDA is missing (nothing was run). tests/gpu_lease.sh covers what needs no vLLM.
set -uo pipefail
PY=${1:-${PYTHON:-python3}}
cd "$(dirname "$0")/.."
DEST=${GPU_CHECK_OUT:-runs/gpu_engine_check}
mkdir -p "$DEST"
if ! "$PY" -c "import vllm, torch, sys; sys.exit(0 if torch.cuda.device_count() else 1)" 2>/dev/null; then
  echo "== vLLM with CUDA is not installed here, or torch sees no GPU: nothing was run" | tee "$DEST/summary.txt"
  exit 10
fi
TBA_TEST_DEVICE=cuda:0 timeout -k 30 "${GPU_CHECK_TIMEOUT:-900}" "$PY" -m pytest -q -rfEs -p no:cacheprovider \
  tests/test_weight_sync.py tests/test_lag.py::test_a_round_in_flight_receives_new_weights \
  tests/test_lag.py::test_the_engine_is_kept_full_and_every_response_comes_back_once \
  tests/test_slowdown.py::test_only_search_rounds_are_slowed 2>&1 | tee "$DEST/pytest.log"
rc=${PIPESTATUS[0]}
{ echo "== pytest exit status $rc"; grep -E "^(FAILED|ERROR|SKIPPED)" "$DEST/pytest.log"; tail -n 1 "$DEST/pytest.log"; } \
  | tee "$DEST/summary.txt"
exit "$rc"
