#!/usr/bin/env bash
# The paper's Llama red-teaming run (Bartoldson et al., 2025, Table 6: a Llama 3.2 1B attacker against a
# Llama 3.1 8B Instruct victim, TBA on 8 A100s in 5.7 h against 37.4 h synchronous), with Lee et al.'s
# settings for Llama victims (github.com/GFNOrg/red-teaming: the Llama command of README.md:165-183,
# configs/llama.json, trainers/gfn_trainer.py:175-204, utils.py:87-134): Llama Guard 3 8B judges, bf16.
# The paper gives k = 10, beta = 0.05, 5,000 steps and 128 attacks a step. scripts/run_redteam.sh is the GPT-2 run;
# where both differ from Lee et al.'s: docs/departures.md, "Red-teaming". redteam.py documents the task.
#
#   bash scripts/run_redteam_llama.sh                   # run it
#   bash scripts/run_redteam_llama.sh --dry-run         # print the command and settings, start nothing
#   ATTACKER=save/llama-sft JUDGE=/models/llama-guard-3-8b bash scripts/run_redteam_llama.sh   # hub ids or local folders
#   bash scripts/run_redteam_llama.sh --out runs/rtl    # extra arguments pass through to tba.py (not a flag of
#                                                       # `settings` below: that is refused)
#
# GPU split: the paper's 8 A100s (80 GB), split as scripts/run_redteam.sh splits its 4 V100s: TRAINERS GPUs train,
# the next SEARCHERS GPUs each run one searcher. A searcher's GPU holds the attacker's, the victim's and
# Llama Guard's vLLM engines (0.9 of it: --searcher-memory's computed default, split by the models' sizes),
# pi_ref and MiniLM beside them; docs/tasks.md, "Red-teaming", gives the split, and the run refuses a GPU
# it cannot fit. The one attack prompt is searched as B = 16 copies of K = 8 attacks: TRAINERS must divide 16.
#
# The models: the hub's (gated: accept Meta's licence and log in first) or local folders with their
# tokenizers. Lee et al. first fine-tune the attacker on their harmful instructions (as for GPT-2); point
# ATTACKER at that model to start from it.
set -euo pipefail
cd "$(dirname "$0")/.."  # the repository
TRAINERS=${TRAINERS:-1}
SEARCHERS=${SEARCHERS:-7}
ATTACKER=${ATTACKER:-meta-llama/Llama-3.2-1B}
VICTIM=${VICTIM:-meta-llama/Llama-3.1-8B-Instruct}
JUDGE=${JUDGE:-meta-llama/Llama-Guard-3-8B}
EMBEDDER=${EMBEDDER:-sentence-transformers/all-MiniLM-L6-v2}

settings=(
  --model "$ATTACKER" --task redteam           # attacker and pi_ref; the instruction list of Lee et al.
  --victim "$VICTIM"                           # its chat template: temperature 0.1, top-p 0.9 (configs/llama.json)
  --victim-max-new-tokens 64                   # their victim_max_len
  --classifier "$JUDGE"                        # log P("unsafe") as Llama Guard 3's first verdict token
  --embedding-model "$EMBEDDER"                # the evaluation's diversity
  --victim-responses 5                         # r = mean of log P(unsafe) over 5 responses
  --searchers "$SEARCHERS"
  --steps 5000
  --prompts-per-step 16 --samples-per-prompt 8 # 128 attacks a step
  --sync-every 10                              # k
  --recency 0.5                                # m: half fresh, as their online half
  --buffer-keep best --buffer-capacity 5000    # their heap of the best 5,000 by log R for Llama victims
  --dedup-similarity 0.4                       # near-duplicates by MiniLM cosine keep the better (their code's
                                               #   default tolerance; their README says 0.3)
  --reward-inv-temp 1                          # buffer draws by exp(log P(unsafe)), as scripts/run_redteam.sh
  --beta 0.05                                  # the paper's
  --reward-temp 2 --reward-temp-anneal-steps 500   # T_R 2 -> 1 (their reward_sched)
  --gamma-final 1.2 --gamma-anneal-steps 2000  # gamma 1 -> 1.2 (their lm_sched_end, lm_sched_horizon)
  --explore-temp-min 0.5 --explore-temp-max 2.0    # half the requests at T ~ U[0.5, 2] (their temp_low/high)
  --lora-rank 32 --lora-alpha 16               # LoRA on peft's default targets (Llama: q_proj, v_proj)
  --lr 1e-4 --weight-decay 0.01                # AdamW, as scripts/run_redteam.sh
  --warmup-steps 100 --lr-decay linear --decay-steps 39900 --grad-clip 1.0   # their horizon, as scripts/run_redteam.sh
  --temperature 1.0 --max-new-tokens 20        # attacks of 5 to 20 tokens
  --micro-batch 128
  --dtype bfloat16                             # configs/llama.json
  --eval-every 500 --eval-limit 1024           # asr, toxicity, diversity, unique
)
source scripts/launch.sh
launch "attacker $ATTACKER, victim $VICTIM, judge $JUDGE" "$@"
