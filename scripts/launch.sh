# The run scripts' one launcher, sourced by run_gsm8k.sh and scripts/run_*.sh after they set `settings` (the
# flags), TRAINERS and SEARCHERS: `launch SUMMARY "$@"` prints the GPU split, SUMMARY and the command, and runs
# it with the script's arguments passed through to tba.py (last wins), unless one of them is --dry-run.
launch() {
  local summary=$1 arg dry_run=0 name
  shift
  for name in TRAINERS SEARCHERS; do  # refused here, --dry-run too, not by tba.py after torchrun has started
    case "${!name}" in ''|*[!0-9]*|0) echo "$(basename "$0"): $name must be a number of GPUs, at least 1, got '${!name}'" >&2
      exit 2;; esac
  done
  local passthrough=()
  for arg in "$@"; do
    if [ "$arg" = "--dry-run" ]; then dry_run=1; else passthrough+=("$arg"); fi
  done
  local cmd=(torchrun --standalone --nproc_per_node="$TRAINERS" tba.py "${settings[@]}" "${passthrough[@]}")
  echo "GPU split: $TRAINERS trainer GPU(s) + $SEARCHERS searcher GPU(s)${summary:+; $summary}"
  echo "${cmd[*]}"
  if [ "$dry_run" = 1 ]; then
    exit 0
  fi
  exec "${cmd[@]}"
}
