#!/usr/bin/env bash
# The checks of the GPU path that need PyTorch with CUDA but not vLLM, in one command on a GPU node with
# no network, within 540 s: tests/test_gpu.py (FSDP2 in bf16 across --trainer-dtype x
# --activation-checkpointing, AdamW's float32 moments under bf16 weights, the leaders' gloo group beside
# NCCL with 2 GPUs, the CUDA IPC handoff, chunked log-probs, the GPU refusals and the memory split, and
# that the "cpu" cases stay on the CPU there), tests/test_weight_protocol.py, tests/test_loss.py (its two
# tests of the warm-started tiny model are left out: CPU-only, and 15 s of warm start) and the TL;DR
# full-vocabulary KL (tests/test_authors.py). Nothing here imports vLLM (checked first: the run stops if
# anything does); the tests that need it are not selected. Then tools/gpu_probe.py prints its figures
# (probe.jsonl, one JSON line each as measured; docs/gpu.md).
#     bash tests/gpu_check.sh [python]   # default: $PYTHON, else python3, else python
# Time: one command on a lent GPU may run 600 s, so the script ends within TOTAL = 540 s, in shares each enforced
# by `timeout -k` (SIGTERM at the share, SIGKILL 5 s later, 1 s for nvidia-smi): nvidia-smi 4 s, the setup check
# 30 s, pytest 300 s (GPU_CHECK_TIMEOUT), the probe 190 s (GPU_CHECK_PROBE_TIMEOUT): 5 + 35 + 305 + 195 = 540.
# The probe gets at most what is left of TOTAL after the rest, so a raised share shortens it rather than
# overrunning; it prints each figure as it goes, so a probe stopped at its share leaves what it measured.
# Writes setup and pytest output, then a summary naming every failed, errored and skipped test, to
# summary.txt and pytest.log in $GPU_CHECK_OUT (default: $OUT if set, else runs/gpu_check in the repository);
# the probe's figures to probe.jsonl, its stderr (a failed part's traceback) to probe.log.
# Exit status: pytest's (0 all passed, 1 tests failed, 2 interrupted, 3 internal error, 4 usage error, 5 none
# collected), 124 (or 137) past its share, or before anything runs: 10 a package missing
# (torch, transformers, numpy; also after pytest passed when a test skipped or errored for one), 11 torch
# sees no CUDA device, 13 the import check failed or imported vLLM, 124 the setup check past its share;
# 14 when pytest passed but the probe failed (a part's error, or stopped at its share). A torch other than 2.13
# (the version the GPU path was written against) runs the checks, with a warning in the summary.
set -uo pipefail
TOTAL=540 KILL=5
SETUP_S=30
TESTS_S=${GPU_CHECK_TIMEOUT:-300}
PROBE_S=${GPU_CHECK_PROBE_TIMEOUT:-190}
start=$SECONDS
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
  if command -v nvidia-smi >/dev/null; then timeout -k 1 4 nvidia-smi -L; else echo "nvidia-smi: not found"; fi
  timeout -k "$KILL" "$SETUP_S" "$PY" - <<'EOF'
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
if [ "$setup" -ne 0 ]; then
  late=$([ "$setup" -eq 124 ] || [ "$setup" -eq 137 ] && echo " (stopped after $SETUP_S s)")
  echo "== setup check failed (exit status $setup$late): nothing was run" | tee -a "$SUMMARY"; exit "$setup"
fi
# the GPU count the setup check printed ("... devices N [...]"): no second start of Python and CUDA
gpus=$(sed -n 's/^torch .* devices \([0-9][0-9]*\) .*/\1/p' "$SUMMARY" | head -n 1)
gpus=${gpus:-0}

# -rfEs: -r replaces pytest's default (fE), so failures and errors are named beside the skips
timeout -k "$KILL" "$TESTS_S" "$PY" -m pytest -q -rfEs -p no:cacheprovider --durations=10 \
  tests/test_gpu.py tests/test_weight_protocol.py tests/test_loss.py tests/test_authors.py::test_full_vocabulary_kl_and_nll \
  -k "not on_policy_gradient_is_reinforce and not chunked_logprobs_equal_the_plain" 2>&1 | tee "$DEST/pytest.log"
rc=${PIPESTATUS[0]}
# what this machine let it check, said plainly; a skip for a missing package fails the check (a
# summary that passed with half of it skipped would claim what was not run)
both="FSDP2 with bf16 compute over float32 and bf16 weights, with and without activation checkpointing; AdamW's float32 moments under bf16 weights; the TL;DR full-vocabulary KL on the GPU; CPU runs staying on the CPU beside CUDA"
if [ "$gpus" -ge 2 ]; then
  what="on $gpus GPUs: $both; FSDP2 over NCCL with 2 ranks (all-gathers between GPUs); the leaders' gloo group beside NCCL (two nodes' leaders on GPUs 0 and 1); weight reads on GPU 1 from GPU 0 (peer copies) and the two-device sync of the lock"
else
  # torch 2.13's FSDP2 at world size 1 calls no collective: it copies the shards in place of its all-gather
  # (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py:392-403, 437-460) and the gradients in place of its
  # reduce-scatter (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:618-631); another torch may differ
  what="on 1 GPU: $both; FSDP2 on one rank (at world size 1 it copies where its all-gathers and reduce-scatters would be: no NCCL collective runs); weight reads on the same GPU; NOT covered (they need 2 GPUs): NCCL between two GPUs (FSDP2's all-gathers and reduce-scatters), the leaders' gloo group beside NCCL, GPU-to-GPU copies, the two-device sync"
fi
missing=$(grep -E "^(SKIPPED|ERROR).*(could not import|No module named|ModuleNotFoundError)" "$DEST/pytest.log" || true)
{
  echo "== pytest exit status $rc$([ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && echo " (stopped after $TESTS_S s)")"
  grep -E "^(FAILED|ERROR|SKIPPED)" "$DEST/pytest.log"
  tail -n 1 "$DEST/pytest.log"
  if [ "$rc" -eq 0 ] && [ -z "$missing" ]; then echo "== checked $what"; else echo "== ran, NOT all passed: $what"; fi
  [ -z "$missing" ] || echo "== parts skipped or errored for a missing package (above): the check is incomplete (exit status 10)"
} | tee -a "$SUMMARY"
if [ "$rc" -eq 0 ] && [ -n "$missing" ]; then rc=10; fi
if [ "${GPU_CHECK_PROBE:-1}" = 1 ]; then  # the figures at Qwen2.5-7B's and rho-math-1b's shapes
  left=$((TOTAL - (SECONDS - start) - KILL - 1))  # 1 s for the lines below
  share=$((left < PROBE_S ? left : PROBE_S))
  if [ "$left" -lt 10 ]; then  # too little to start Python, torch and CUDA
    echo "== probe not run: $left s left of $TOTAL" | tee -a "$SUMMARY"
    probe=124
  else
    timeout -k "$KILL" "$share" "$PY" tools/gpu_probe.py > "$DEST/probe.jsonl" 2> "$DEST/probe.log"
    probe=$?
    failed=$(sed -n 's/.*"part": "\([^"]*\)", "error".*/\1/p' "$DEST/probe.jsonl" | paste -sd, -)
    late=$([ "$probe" -eq 124 ] || [ "$probe" -eq 137 ] && echo " (stopped after $share s: the figures up to there)")
    echo "== probe exit status $probe$late (lines in probe.jsonl: $(grep -c . "$DEST/probe.jsonl"); parts failed: ${failed:-none})" | tee -a "$SUMMARY"
  fi
  if [ "$rc" -eq 0 ] && [ "$probe" -ne 0 ]; then rc=14; fi
fi
exit "$rc"
