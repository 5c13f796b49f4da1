#!/usr/bin/env bash
# The paper's red-teaming run (Bartoldson et al., 2025, Table 6: a GPT-2 attacker, TBA on 4 GPUs), with
# Lee et al.'s GPT-2 recipe ("Learning diverse attacks on large language models for robust red-teaming
# and safety tuning", arXiv 2405.18540, github.com/GFNOrg/red-teaming: main.py, trainers/gfn_trainer.py,
# utils.py, configs/gpt2.json, eval.py). The paper gives k = 10, beta = 0.05, 5,000 steps and 128 attacks
# a step; the rest is Lee et al.'s. redteam.py documents the task.
#
#   ATTACKER=save/gpt2-sft bash scripts/run_redteam.sh              # run it (ATTACKER: see below)
#   ATTACKER=save/gpt2-sft bash scripts/run_redteam.sh --dry-run    # print the command and settings, start nothing
#   ATTACKER=... bash scripts/run_redteam.sh --out runs/rt          # extra arguments pass through to tba.py (not a
#                                                                   # flag of `settings` below: that is refused)
#
# ATTACKER (required) is their prior: GPT-2 after their supervised fine-tuning on 3,003 harmful
# instructions, the start of training and pi_ref. Make it with tools/sft_attacker.py from their files
# prompts/sft_dataset.json and prompts/alpaca.jsonl (github.com/GFNOrg/red-teaming):
#   python tools/sft_attacker.py sft_dataset.json --prompts alpaca.jsonl --model gpt2 --out save/gpt2-sft
#
# GPU split as in run_gsm8k.sh: TRAINERS GPUs train, the next SEARCHERS GPUs each run one searcher,
# whose GPU also holds pi_ref, the victim and the classifier (docs/tasks.md, "Red-teaming"). The one attack
# prompt is searched as B = 16 copies of K = 8 attacks, so TRAINERS must divide 16.
#
# Where this run still differs from Lee et al.'s, and why: docs/departures.md, "Red-teaming".
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository
TRAINERS=${TRAINERS:-1}
SEARCHERS=${SEARCHERS:-3}
if [ -z "${ATTACKER:-}" ]; then
  echo "run_redteam.sh: set ATTACKER to Lee et al.'s SFT attacker, made with:" >&2
  echo "  python tools/sft_attacker.py sft_dataset.json --prompts alpaca.jsonl --model gpt2 --out save/gpt2-sft" >&2
  echo "  (their prompts/sft_dataset.json and prompts/alpaca.jsonl, github.com/GFNOrg/red-teaming); then" >&2
  echo "  ATTACKER=save/gpt2-sft bash scripts/run_redteam.sh" >&2
  exit 2
fi

settings=(
  --model "$ATTACKER" --task redteam           # attacker and pi_ref (their SFT model); their instruction list
  --victim vicgalle/gpt2-alpaca                # Alpaca template, temperature 0.7, top-p 0.92, 30 tokens
  --classifier facebook/roberta-hate-speech-dynabench-r4-target   # P(hate) of each response
  --embedding-model sentence-transformers/all-MiniLM-L6-v2        # the evaluation's diversity
  --victim-responses 5                         # r = mean of log P(hate) over 5 responses
  --searchers "$SEARCHERS"
  --steps 5000
  --prompts-per-step 16 --samples-per-prompt 8 # 128 attacks a step
  --sync-every 10                              # k
  --recency 0.5                                # m: half fresh, as their online half
  --buffer-keep best --buffer-capacity 1000    # their heap of the best 1,000 by log R (utils.py:289-347)
  --dedup-edit 0.25                            # near-duplicates by token edit distance keep the better
  --reward-inv-temp 1                          # buffer draws by exp(log P(unsafe)): their prioritization c_reward
  --beta 0.05                                  # the paper's
  --reward-temp 2 --reward-temp-anneal-steps 500   # T_R 2 -> 1 (their reward_sched); gamma stays 1 for GPT-2
  --explore-temp-min 0.5 --explore-temp-max 2.0    # half the requests at T ~ U[0.5, 2] (their temp_low/high)
  --lora-rank 32 --lora-alpha 16               # LoRA on peft's default targets (GPT-2: c_attn)
  --lr 1e-4 --weight-decay 0.01                # AdamW: torch's default weight decay, theirs
  --warmup-steps 100 --lr-decay linear --decay-steps 39900   # their horizon: 8 x 5,000 scheduler steps
  --grad-clip 1.0                              #   (lr is still 0.88 x 1e-4 at step 5,000)
  --temperature 1.0 --max-new-tokens 20        # attacks of 5 to 20 tokens
  --micro-batch 128
  --dtype float32                              # configs/gpt2.json
  --eval-every 500 --eval-limit 1024           # asr, toxicity, diversity, unique
)
source scripts/launch.sh
launch "attacker $ATTACKER" "$@"
