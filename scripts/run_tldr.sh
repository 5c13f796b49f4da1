#!/usr/bin/env bash
# The paper's TL;DR run (Bartoldson et al., 2025, Sec. 5, Tables 1 and 3; the authors' tba_tldr.py,
# src/tba_trainer_tldr.py, configs/tba_pythia2.8b_tldr.yml, launch_training_tldr.sh, eval_tldr/):
# TBA fine-tunes a Pythia SFT model to summarise Reddit posts against a learned reward model, on
# one 4-GPU node.
#
#   bash scripts/run_tldr.sh                          # run it (Pythia 410M, Table 3's 256 steps)
#   bash scripts/run_tldr.sh --dry-run                # print the command and settings, start nothing
#   SIZE=1b bash scripts/run_tldr.sh                  # 410m (default), 1b or 2.8b, as the authors publish
#   SETTING=table1 bash scripts/run_tldr.sh           # Table 1's run: 625 steps, 2 searchers (default: table3)
#   bash scripts/run_tldr.sh --data ../tldr           # extra arguments pass through to tba.py (not a flag
#                                                     # of `settings` below: that is refused)
#   GOLD=../gold bash scripts/run_tldr.sh             # the evaluation's judge from a local folder
#
# GPU split as in run_gsm8k.sh: TRAINERS GPUs train, the next SEARCHERS GPUs each run one searcher.
# Without --data the prompts come from the hub (the `datasets` package); --data DIR takes
# train.jsonl and validation.jsonl with the fields `query` and `reference_response`.
#
# The evaluation is the authors' (eval_tldr/): responses at temperature 0.01 to every validation
# prompt, each scored by the 6.9B gold reward model against the reference summary (win rate), the
# per-token full-vocabulary KL(pi_ref || pi_theta) and the perplexity under the SFT model. The
# gold model's hub repository is named by the authors with the tokenizer of
# EleutherAI/pythia-6.9b-deduped beside it (configs/evaluate_tldr.yml); tba.py needs the tokenizer
# in the judge's folder, so if the repository has none, save that tokenizer into a copy and pass
# it as GOLD. Add --eval-limit N for a shorter evaluation.
#
# Where this run still differs from the authors' (precision, the learning rate, the initial buffer,
# the evaluation), and why: docs/departures.md, "The TL;DR run".
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository
TRAINERS=${TRAINERS:-1}
SIZE=${SIZE:-410m}
SETTING=${SETTING:-table3}
GOLD=${GOLD:-cleanrl/EleutherAI_pythia-6.9b-deduped__reward__tldr}
case "$SIZE" in 410m|1b|2.8b) ;; *) echo "run_tldr.sh: SIZE must be 410m, 1b or 2.8b, got $SIZE" >&2; exit 2;; esac
# Searcher 0 holds, beside vLLM, pi_ref, the reward model, the evaluation's policy copy and the 6.9B
# gold judge (13.3 GB in bf16): vLLM's share of a searcher GPU (--searcher-memory) is computed from
# the card and these models' sizes, or the card is refused in one line (docs/gpu.md, "Memory").
case "$SETTING" in
  # Table 3 (the released config): 40,960 episodes; beta anneals over 128 updates, cut at 32
  table3) STEPS=256; DEFAULT_SEARCHERS=3; BETA_STOP=32; BETA_TARGET=128; EVAL_EVERY=64;;
  # Table 1 (off-policy robustness, Pythia 410M): 100,000 episodes, 2 searchers; the beta stop and
  # target steps at one eighth and one half of the run
  table1) STEPS=625; DEFAULT_SEARCHERS=2; BETA_STOP=78; BETA_TARGET=312; EVAL_EVERY=156;;
  *) echo "run_tldr.sh: SETTING must be table3 or table1, got $SETTING" >&2; exit 2;;
esac
SEARCHERS=${SEARCHERS:-$DEFAULT_SEARCHERS}
# A searcher round is ceil(rollout batch / 20) prompts x 20 (src/tba_trainer_tldr.py:298-301, their
# local_rollout_forward_batch_size 40, 20, 10 for 410m, 1b, 2.8b: launch_training_tldr.sh), and
# their trainer waits at each sync (k = 10) for one round of every searcher: at most k B K =
# 10 x 8 x 20 = 1,600 draws per N rounds, e.g. 1,600 / (3 x 2 x 20) = 13.3 draws a trajectory
# at 410m with 3 searchers (docs/performance.md).
case "$SIZE" in 410m) ROUND=2;; *) ROUND=1;; esac
REUSE=$(awk -v n="$SEARCHERS" -v r="$ROUND" 'BEGIN { printf "%.3g", 10 * 8 * 20 / (n * r * 20) }')

settings=(
  --model "mnoukhov/pythia${SIZE}-sft-tldr" --task tldr        # policy and pi_ref
  --reward-model "mnoukhov/pythia${SIZE}-rm-tldr6.9b"          # one output, read at the EOS
  --non-eos-penalty                         # a response without EOS scores -1
  --searchers "$SEARCHERS"
  --steps "$STEPS"                          # 160 episodes a step
  --prompts-per-step 8                      # B
  --samples-per-prompt 20                   # K
  --search-samples-per-prompt 20            # searchers draw 20 per prompt
  --round-prompts "$ROUND"                  # a searcher's round (above)
  --max-reuse "$REUSE"                      # draws per trajectory received: the authors' bound (above)
  --sync-every 10                           # k
  --recency 0.5                             # m; the other half by reward
  --reward-inv-temp 1                       # softmax(reward x 1) over each prompt's buffer
  --duplicates collapse                     # a response drawn once however often it came (their buffer_utils.py:36-83)
  --initial-buffer 10000                    # trajectories before the first update
  # beta at update u: 1.0 (1 - (u-1)/TARGET) + 0.05 (u-1)/TARGET for u < STOP, then 0.05 (a jump)
  --beta 1.0 --beta-final 0.05 --beta-anneal-steps "$BETA_TARGET" --beta-stop-step "$BETA_STOP"
  --lr 3e-6 --warmup-steps 0 --decay-steps "$STEPS" --lr-decay linear   # transformers' default schedule
  --grad-clip 0                             # no gradient clipping in their loop
  --temperature 0.7 --max-new-tokens 128
  --micro-batch 20                          # one prompt's K=20 responses per forward/backward
  --dtype bfloat16
  --eval-every "$EVAL_EVERY"                # at each quarter of the run, as their saved checkpoints
  --eval-temperature 0.01                   # configs/generate_tldr.yml: 0.010001, on the whole validation split
  --eval-reward-model "$GOLD"               # the gold judge: win = gold(response) > gold(reference)
)
if [ "$SIZE" = 2.8b ]; then  # 44.5 GB of float32 weights, gradients and AdamW state before any activation
  settings+=(--activation-checkpointing)
fi
source scripts/launch.sh
launch "Pythia $SIZE; $SETTING" "$@"
