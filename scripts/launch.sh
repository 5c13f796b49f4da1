# The run scripts' one launcher, sourced by run_gsm8k.sh and scripts/run_*.sh after they set `settings` (the
# flags), TRAINERS and SEARCHERS: `launch SUMMARY "$@"` prints the GPU split, SUMMARY and the command, and runs
# it with the script's arguments passed through to tba.py, unless one of them is --dry-run. An argument that is
# a flag the script sets itself (`--flag`, `--flag=value` or `--no-flag`) is refused: tba.py would take the last
# one, past the script's own checks of its variables (LAG=5 refused, --lag 5 run); its variable or an edit of
# `settings` changes it instead.
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
  local i
  for ((i = 0; i < ${#passthrough[@]}; i++)); do
    case "${passthrough[i]}" in --?*) own_setting "${passthrough[i]}" "${passthrough[i + 1]:-}";; esac
  done
  local cmd=(torchrun --standalone --nproc_per_node="$TRAINERS" tba.py "${settings[@]}" "${passthrough[@]}")
  echo "GPU split: $TRAINERS trainer GPU(s) + $SEARCHERS searcher GPU(s)${summary:+; $summary}"
  [ -z "${launch_note:-}" ] || echo "$launch_note"  # a script's word on its settings (run_math.sh: rank 0's memory)
  echo "${cmd[*]}"
  if [ "$dry_run" = 1 ]; then
    exit 0
  fi
  exec "${cmd[@]}"
}

# `own_setting ARG NEXT`: exit 2 in one line if ARG (--flag, --flag=value, --no-flag; NEXT: the argument after it)
# is a flag of `settings`, naming what sets it: the variable on its line of the script where the script reads
# that variable from the environment (${NAME:-...}), else an edit of the settings.
own_setting() {
  local arg=$1 next=$2 flag key i value="" script variable="" exact=0 line code rest
  flag=${arg%%=*}
  key=${flag#--}
  key=--${key#no-}  # --no-X is tba.py's negation of --X: the same setting
  for ((i = 0; i < ${#settings[@]}; i++)); do
    [ "${settings[i]}" = "$key" ] || [ "${settings[i]}" = "--no-${key#--}" ] && break
  done
  [ "$i" -lt "${#settings[@]}" ] || return 0
  case "${settings[i + 1]:-}" in --*|'') ;; *) value=" ${settings[i + 1]}";; esac
  script=$0
  [ -r "$script" ] || script=${OLDPWD:-.}/$0  # the scripts cd before they launch: $0 is relative to where they ran
  if [ -r "$script" ]; then
    local in_settings=0
    while IFS= read -r line; do
      case "$line" in settings=\(*) in_settings=1;; esac
      [ "$in_settings" = 1 ] || continue  # the script's other lines (an echoed example) may name the flag too
      code=${line%%#*}  # and so may a comment
      case " $code " in *[[:space:]]"${settings[i]}"[[:space:]]*) ;; *) continue;; esac
      rest=${code#*"${settings[i]}"}
      rest=${rest%% --*}  # its value: up to the line's next flag
      if [[ $rest =~ \$\{?([A-Za-z_][A-Za-z0-9_]*) ]] && grep -qF "\${${BASH_REMATCH[1]}:-" "$script"; then
        variable=${BASH_REMATCH[1]}
        [[ $rest =~ ^[[:space:]]*\"?\$\{?$variable\}?\"?[[:space:]]*$ ]] && exact=1  # the value is the variable alone
      fi
      break
    done < "$script"
  fi
  local given=${arg#*=}
  [ "$given" != "$arg" ] || case "$next" in --*|'') given=...;; *) given=$next;; esac
  local own="$(basename "$0"): $flag: the script sets ${settings[i]} itself (${settings[i]}$value)"
  if [ "$exact" = 1 ]; then
    echo "$own; use $variable instead ($variable=$given bash $0), not an extra argument" >&2
  elif [ -n "$variable" ]; then
    echo "$own; use $variable instead (see the script's header), not an extra argument" >&2
  else
    echo "$own; edit its settings instead of passing an extra argument" >&2
  fi
  exit 2
}
