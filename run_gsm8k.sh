#!/usr/bin/env bash
# The paper's headline run (Bartoldson et al., 2025, Sec. 5; the authors' launch_training_gsm8k.sh):
# TBA on GSM8K with RhoMath-1B SFT (realtreetune/rho-1b-sft-GSM8K) on one 4-GPU node, reported at
# 54.6% +- 0.6 greedy pass@1 on the test set after 700 steps (82 min on 4 x A100 80 GB).
#
#   bash run_gsm8k.sh                          # run it
#   bash run_gsm8k.sh --dry-run                # print the command and settings, start nothing
#   bash run_gsm8k.sh --data ../gsm8k          # extra arguments pass through to tba.py; a flag of
#                                              # `settings` below is refused: edit it there instead
#
# GPU split: TRAINERS GPUs train (torchrun ranks, FSDP2), the next SEARCHERS GPUs each run one vLLM
# searcher; the authors used 1 + 3. Change it with the environment, e.g. on an 8-GPU node:
#   TRAINERS=1 SEARCHERS=7 bash run_gsm8k.sh                # the authors' B = 7
#   TRAINERS=2 SEARCHERS=6 PROMPTS=8 bash run_gsm8k.sh      # B (PROMPTS) must be a multiple of TRAINERS
set -euo pipefail
cd "$(dirname "$0")"
TRAINERS=${TRAINERS:-1}
SEARCHERS=${SEARCHERS:-3}
PROMPTS=${PROMPTS:-7}  # B
# The authors' trainer waits at each sync (every k = 2 steps) until every searcher has finished its
# round of 3 prompts x 24 = 72 (ceil(72 / 24) prompts: their searcher batch, src/tba_trainer_gsm8k.py:
# 313-316), so it draws at most k B K = 2 x 7 x 20 = 280 per N x 72 made: 280 / 216 = 1.3 draws a
# trajectory with their 3 searchers (docs/performance.md). The same bound for this split:
REUSE=$(awk -v n="$SEARCHERS" -v b="$PROMPTS" 'BEGIN { printf "%.3g", 2 * b * 20 / (n * 3 * 24) }')

settings=(
  --model rho-math-1b --task gsm8k          # RhoMath-1B SFT, GSM8K train split for searching
  --searchers "$SEARCHERS"
  --steps 700                               # 98,000 episodes at 140 a step
  --prompts-per-step "$PROMPTS"             # B
  --samples-per-prompt 20                   # K: the TB loss's log Z is over them
  --search-samples-per-prompt 24            # searchers draw 24 per prompt
  --round-prompts 3                         # a searcher's round: 3 prompts x 24 (their searcher batch)
  --max-reuse "$REUSE"                      # draws per trajectory received: the authors' bound (above)
  --sync-every 2                            # k
  --recency 0.95                            # m; the other 5% uniform over the buffer
  --reward-inv-temp 0
  --duplicates collapse                     # a response drawn once however often it came (their buffer_utils.py:36-83)
  --initial-buffer 500                      # trajectories before the first update (initial_buffer_samples)
  --beta 0.014 --beta-final 0.004 --beta-anneal-steps 500 --beta-stop-step 500   # kl_coef_decay_{target,stop}_iter
  --lr 1e-5 --warmup-steps 50 --stable-steps 350 --decay-steps 600   # warmup-stable-decay
  --grad-clip 0                             # the authors never clip (no clip call in src/tba_trainer_gsm8k.py);
                                            # TB's gradient is ~136x RLOO's at beta 0.014: a clip at 1 acts every step
  --trainer-dtype bfloat16                  # the authors' bf16 weights (tba_gsm8k.py:49-56): their lr 1e-5 was tuned
                                            # where small updates round away; float32 steps further. AdamW's moments
                                            # stay float32 (theirs: bf16; docs/departures.md, "bf16 weights")
  --temperature 0.7 --max-new-tokens 512
  --micro-batch 20                          # one prompt's K=20 responses per forward/backward
  --dtype bfloat16
  --eval-every 100                          # greedy pass@1 on the 1,319 test problems
)
source scripts/launch.sh
launch "" "$@"
