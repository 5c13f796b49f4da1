#!/usr/bin/env bash
# One lease of a GPU (docs/gpu.md, "A lease": 15 minutes in all, its start included, one command at most 600 s; the
# lent machine has a torch of its own, 2.11, no vLLM, no network, and gets only the working tree): what of the GPU path
# needs no vLLM, in stages, each under its own limit within a total budget that fits ONE command (a rerun would need
# a second start: the machine is kept warm 30 s), every line written as it is produced (to stdout, and to
# $OUT/lease.log where OUT is set), so that a cut keeps what ran.
#     OUT=$OUT bash tests/gpu_lease.sh            # every stage within BUDGET (480 s): run it under a 510 s limit
# Environment: BUDGET (s, default 480); STAGES (of checks, tests, probe, run in this order; default all three: setup
# always runs first, as it names the torch, CUDA and card of every figure after it); PARTS (the probe's parts in the
# order to run them, default gsm8k,math,write,seeded,decode-rho,decode-qwen); PYTHON (default python3, else python);
# OUT (a folder for lease.log). HF_HUB_OFFLINE=1 is set: the lent machine has no network to wait for.
# Stages, each under `timeout -k 5` at its limit or at what is left of BUDGET, whichever is less (one left under 20 s
# is not started, and says so):
#   setup   60 s  the kernel (`uname -r`: a fallback machine may run another runtime), versions (Python, torch, CUDA,
#                 NCCL, transformers, numpy, pytest, the driver), the card, `ulimit -l`, which torch APIs the GPU path
#                 calls this torch has (tools/gpu_probe.py's APIS), that nothing imported imports vLLM (a cold import
#                 of a CUDA torch can take 20 s); without torch (10) or a CUDA device (11) the stages after it
#                 refuse in one line each, while any other failure of it is said and the stages run
#   checks 120 s  tools/gpu_checks.py: the GPU path's own code, one line of figures a check
#   tests  150 s  the tests that need CUDA (pytest -m cuda; a test past 60 s has its stacks dumped:
#                 faulthandler_timeout, pytest's own)
#   probe         tools/gpu_probe.py's parts, in PARTS' order: the rest of BUDGET, at least 130 s (480 - 3 x 5 of
#                 kill grace - 60 - 120 - 150 - 5 of its own)
# In checks and probe each part has a limit of its own: past it the tool dumps its stacks and ends, and a new process
# runs the parts after it while the stage has time. Exit status: 0 every stage passed; 2 a bad setting (nothing run);
# 10 torch missing; 11 torch sees no CUDA device (setup ran, the rest refused); else the first failed stage's (pytest's;
# 1 a check or part failed, hung or crashed; 124 a stage stopped at its limit, or not started for want of time).
set -uo pipefail
BUDGET=${BUDGET:-480} KILL=5 FLOOR=20 HANG=60
STAGES=${STAGES:-checks,tests,probe}
PARTS=${PARTS:-gsm8k,math,write,seeded,decode-rho,decode-qwen}
CHECKS=fingerprint,watchdog,lagged,slot,keep,arrival  # tools/gpu_checks.py's, in its order
TESTS="tests/test_gpu.py tests/test_weight_protocol.py tests/test_authors.py"  # every file with a `cuda` test
declare -A LIMIT=([setup]=60 [checks]=120 [tests]=150 [probe]=$BUDGET)  # the probe: what is left
start=$SECONDS
here=$PWD
absolute() { case $1 in /*) echo "$1" ;; */*) echo "$here/$1" ;; *) echo "$1" ;; esac; }  # before the cd
PY=$(absolute "${PYTHON:-$(command -v python3 || command -v python || echo python3)}")
LOG=/dev/null
if [ -n "${OUT:-}" ]; then
  OUT=$(absolute "$OUT")
  mkdir -p "$OUT" && LOG=$OUT/lease.log
fi
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
say() { echo "$*" | tee -a "$LOG"; }

case $BUDGET in ''|*[!0-9]*) say "tests/gpu_lease.sh: BUDGET=$BUDGET: a whole number of seconds"; exit 2 ;; esac
# (below FLOOR + KILL no stage could start: before, BUDGET=0 said only "exit status 125")
[ "$BUDGET" -ge $((FLOOR + KILL)) ] || { say "tests/gpu_lease.sh: BUDGET=$BUDGET: below the $((FLOOR + KILL)) s a stage needs"; exit 2; }
for stage in ${STAGES//,/ }; do
  case $stage in
    checks|tests|probe) ;;
    *) say "tests/gpu_lease.sh: STAGES=$STAGES: the stages are checks, tests, probe"; exit 2 ;;
  esac
done
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# the seconds stage $1 may run: its limit, or what is left of BUDGET after its kill grace, whichever is less
share() { local left=$((BUDGET - (SECONDS - start) - KILL)); left=$((left < 0 ? 0 : left))  # (a stage may overrun by its grace)
  echo $((left < LIMIT[$1] ? left : LIMIT[$1])); }

# tools/$1 with the parts $2 within $3 s: a part that hung (past its own limit the tool dumps the stacks and ends) or
# crashed the process is named, and a new process runs the parts after it while 20 s are left
parts() {
  local tool=$1 todo=$2 limit=$3 began=$SECONDS rc=0 code left finished broken rest p
  while [ -n "$todo" ]; do
    left=$((limit - (SECONDS - began)))
    if [ "$left" -lt "$FLOOR" ]; then
      say "== $tool: not started, $left s left of the stage's $limit: $todo"; return 124
    fi
    rm -f "$WORK/out"
    timeout -k "$KILL" "$left" "$PY" -u "tools/$tool" --parts "$todo" 2>&1 | tee -a "$LOG" "$WORK/out"
    code=${PIPESTATUS[0]}
    if grep -q '^{"figure": "done"' "$WORK/out" || ! grep -q '^{"figure": "machine"' "$WORK/out"; then
      [ "$rc" -ne 0 ] && return "$rc" || return "$code"
    fi
    finished=$(sed -n 's/^{"figure": "timing", "part": "\([^"]*\)".*/\1/p' "$WORK/out")
    broken="" rest=""
    for p in ${todo//,/ }; do  # the parts run in this order: the first unfinished one ended the process
      if grep -qx -- "$p" <<<"$finished"; then continue; fi
      if [ -z "$broken" ]; then broken=$p; else rest=$rest${rest:+,}$p; fi
    done
    if [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then
      say "== $tool: stopped at the stage's limit in $broken"; return 124
    fi
    say "== $tool: $broken ended the process (exit status $code: a hang, its stacks above, or a crash)"
    rc=1 todo=$rest
  done
  return "$rc"
}

status=0
note() { [ "$status" -ne 0 ] || status=$1; }

s=$(share setup)
say "== setup (limit $s s): $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $PY"
{
  echo "kernel: $(uname -r)"
  echo "ulimit -l (page-locked memory, KiB): $(ulimit -l)"
  if command -v nvidia-smi >/dev/null; then
    timeout -k 1 5 nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  else
    echo "nvidia-smi: not found"
  fi
  timeout -k "$KILL" "$s" "$PY" - <<'EOF'
import importlib.util
import platform
import sys
print("python", platform.python_version(), sys.executable)
try:
    import torch
except ImportError:
    print("torch is not installed: nothing can be checked here")
    sys.exit(10)
versions = {}
for name in ("transformers", "numpy", "pytest", "pytest_timeout", "vllm"):
    if importlib.util.find_spec(name) is None:
        versions[name] = None
    else:
        versions[name] = getattr(__import__(name), "__version__", "?") if name != "vllm" else "installed"
print("packages:", versions)
n = torch.cuda.device_count()
nccl = torch.cuda.nccl.version() if n and hasattr(torch.cuda, "nccl") else None
print("torch", torch.__version__, "CUDA", torch.version.cuda, "NCCL", nccl, "devices", n,
      [(torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i),
        round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)) for i in range(n)])
if not torch.__version__.startswith("2.13."):
    print(f"note: torch {torch.__version__}: the GPU path is written against torch 2.13 (vLLM 0.32 pins it); every "
          f"figure below is this torch's")
sys.path[:0] = [".", "tools", "tests"]
import gpu_probe
gpu_probe.api_report(None, None, True)
absent = [name for name in gpu_probe.APIS if gpu_probe.exists(name) is not True]
print("APIs absent or not checked:", ", ".join(absent) or "none")
try:  # the lent machine has no vLLM: nothing the stages import may need it
    import tba, loss, gpu_checks, test_gpu, test_weight_protocol, test_authors  # noqa: F401,E401
    from runtime import weights, nodes, policy, ranks  # noqa: F401,E401
    loaded = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
    print("vllm imported by tba, the tools and the tests:", loaded or "no")
except Exception as e:  # noqa: BLE001 - said, and the stages show what fails
    print("import check failed:", repr(e))
card = torch.cuda.get_device_name(0) if n else "no CUDA device"
print(f"on: torch {torch.__version__}, CUDA {torch.version.cuda}, {card}")
sys.exit(0 if n else 11)
EOF
} 2>&1 | tee -a "$LOG" "$WORK/setup"
setup=${PIPESTATUS[0]}
ON=$(sed -n 's/^on: //p' "$WORK/setup")
why="" more=""
case $setup in  # only these two leave nothing to run: any other failure of the setup is said, and the stages run
  0) ;;
  10) why="torch is not installed" ;;
  11) why="${ON%, no CUDA device} sees no CUDA device" ;;
  124|137) more=" (stopped at its limit): the stages run" ;;
  *) more=": the stages run" ;;
esac
ON=${ON:-"a torch and card the setup did not name"}
say "== setup: exit status $setup$more"
note "$setup"

for stage in ${STAGES//,/ }; do
  if [ -n "$why" ]; then say "== $stage: refused: $why"; continue; fi
  s=$(share "$stage")
  if [ "$s" -lt "$FLOOR" ]; then say "== $stage: not started, $s s left of BUDGET=$BUDGET"; note 124; continue; fi
  say "== $stage (limit $s s) on $ON"
  case $stage in
    checks) parts gpu_checks.py "$CHECKS" "$s" ;;
    probe) parts gpu_probe.py "$PARTS" "$s" ;;
    tests)
      if grep -q "'pytest': None" "$WORK/setup"; then
        say "== tests: pytest is not installed here"; (exit 10)
      else
        # -v: each test named as it ends (a cut keeps which passed); -rfEs: the failures, errors and skips again
        timeout -k "$KILL" "$s" "$PY" -m pytest -v -rfEs -p no:cacheprovider --durations=10 -m cuda \
          -o faulthandler_timeout=$HANG $TESTS 2>&1 | tee -a "$LOG"
        (exit "${PIPESTATUS[0]}")
      fi ;;
  esac
  rc=$?
  say "== $stage: exit status $rc$([ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && echo " (stopped at its limit)") on $ON"
  note "$rc"
done
say "== done in $((SECONDS - start)) s of BUDGET=$BUDGET, exit status $status"
exit "$status"
