#!/usr/bin/env bash
# The paper's red-teaming run (Bartoldson et al., 2025, Table 6: a GPT-2 attacker, TBA on 4 GPUs),
# built on Lee et al., "Learning diverse attacks on large language models for robust red-teaming and
# safety tuning" (arXiv 2405.18540, github.com/GFNOrg/red-teaming: main.py, trainers/gfn_trainer.py,
# configs/gpt2.json, eval.py). The paper gives k = 10, beta = 0.05, 5,000 steps and 128 attacks a step;
# the rest is Lee et al.'s GPT-2 setting. redteam.py documents the task.
#
#   bash run_redteam.sh                       # run it
#   bash run_redteam.sh --dry-run             # print the command and settings, start nothing
#   ATTACKER=save/gpt2-sft bash run_redteam.sh    # the attacker (see below)
#   bash run_redteam.sh --victim-responses 3  # extra arguments pass through to tba.py (last wins)
#
# GPU split as in run_gsm8k.sh: TRAINERS GPUs train, the next SEARCHERS GPUs each run one searcher,
# whose GPU also holds pi_ref, the victim and the classifier (docs/tasks.md, "Red-teaming"). The one attack
# prompt is searched as B = 16 copies of K = 8 attacks, so TRAINERS must divide 16.
#
# Where this differs from Lee et al.'s run:
# - attacker: theirs is GPT-2 after their supervised fine-tuning on instruction lists (a checkpoint
#   they share on Google Drive, not on the hub); ATTACKER defaults to the plain `gpt2`: point it at
#   their checkpoint, saved as a folder with its tokenizer, to reproduce them.
# - log Z: theirs is a learned head on the prompt's hidden state; TB here estimates it per group of
#   K = 8 attacks (loss.py). Their 128 attacks an update are 16 a batch x 8 accumulated batches.
# - sampling: theirs draws half the batches at a temperature uniform in [0.5, 2.0] and the other
#   half from their replay buffer (edit-distance deduplicated, by reward); here the searchers sample
#   at temperature 1 and TBA's buffer supplies the off-policy data (m = 0.5, the other half by reward).
# - length: theirs blocks EOS at the first token and gives attacks under 5 tokens a log-reward of
#   -500; here a searched attack under 5 tokens gets r = -25 (-500 in r / beta) and EOS is blocked
#   only in the evaluation (redteam.py).
# - lr: their linear warmup (100 steps) and linear decay to 0; here warmup then cosine decay; no
#   weight decay (theirs: 0.1); their gamma and reward temperature anneals are left out (both at 1).
# - evaluation: theirs is offline (eval.py, 1,024 attacks x 5 responses); here the same every 500
#   steps (their eval_period) during the run.
set -euo pipefail
cd "$(dirname "$0")"
TRAINERS=${TRAINERS:-1}
SEARCHERS=${SEARCHERS:-3}
ATTACKER=${ATTACKER:-gpt2}

settings=(
  --model "$ATTACKER" --task redteam           # attacker and pi_ref; the instruction list of Lee et al.
  --victim vicgalle/gpt2-alpaca                # Alpaca template, temperature 0.7, top-p 0.92, 30 tokens
  --classifier facebook/roberta-hate-speech-dynabench-r4-target   # P(hate) of each response
  --embedding-model sentence-transformers/all-MiniLM-L6-v2        # the evaluation's diversity
  --victim-responses 5                         # r = mean of log P(hate) over 5 responses
  --searchers "$SEARCHERS"
  --steps 5000
  --prompts-per-step 16 --samples-per-prompt 8 # 128 attacks a step
  --sync-every 10                              # k
  --recency 0.5 --reward-inv-temp 1            # m; the other half by reward, as their buffer
  --buffer-capacity 1000                       # their buffer_size
  --beta 0.05
  --lr 1e-4 --warmup-steps 100 --decay-steps 4900 --grad-clip 1.0
  --temperature 1.0 --max-new-tokens 20        # attacks of 5 to 20 tokens
  --micro-batch 128
  --dtype float32                              # configs/gpt2.json
  --eval-every 500 --eval-limit 1024           # asr, toxicity, diversity, unique
)
passthrough=()
dry_run=0
for arg in "$@"; do
  if [ "$arg" = "--dry-run" ]; then dry_run=1; else passthrough+=("$arg"); fi
done
cmd=(torchrun --standalone --nproc_per_node="$TRAINERS" tba.py "${settings[@]}" "${passthrough[@]}")

echo "GPU split: $TRAINERS trainer GPU(s) + $SEARCHERS searcher GPU(s); attacker $ATTACKER"
echo "${cmd[*]}"
if [ "$dry_run" = 1 ]; then
  exit 0
fi
exec "${cmd[@]}"
