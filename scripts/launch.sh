# The run scripts' one launcher, sourced by run_gsm8k.sh and scripts/run_*.sh after they set `settings` (the
# flags), TRAINERS and SEARCHERS: `launch SUMMARY "$@"` prints the GPU split, SUMMARY and the command, and runs
# it with the script's arguments passed through to tba.py (last wins), unless one of them is --dry-run.
launch() {
  local summary=$1 arg dry_run=0
  shift
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
