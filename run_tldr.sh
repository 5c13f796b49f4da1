#!/usr/bin/env bash
# The paper's TL;DR run (Bartoldson et al., 2025, Sec. 5 and Table 1; the authors' tba_tldr.py,
# src/tba_trainer_tldr.py, configs/tba_pythia2.8b_tldr.yml, launch_training_tldr.sh): TBA fine-tunes
# a Pythia SFT model to summarise Reddit posts against a learned reward model, on one 4-GPU node.
#
#   bash run_tldr.sh                          # run it (Pythia 410M)
#   bash run_tldr.sh --dry-run                # print the command and settings, start nothing
#   SIZE=1b bash run_tldr.sh                  # 410m (default), 1b or 2.8b, as the authors publish
#   bash run_tldr.sh --data ../tldr           # extra arguments pass through to tba.py (last wins)
#
# GPU split as in run_gsm8k.sh: TRAINERS GPUs train, the next SEARCHERS GPUs each run one searcher.
# Without --data the prompts come from the hub (the `datasets` package); --data DIR takes
# train.jsonl and validation.jsonl with the fields `query` and `reference_response`.
#
# Where this differs from the authors' run (their code: trl 0.9.4, DeepSpeed, MPI):
# - beta: theirs anneals linearly from 1.0 toward 0.05 over 128 updates but stops the anneal at
#   update 32 (beta about 0.78) and then uses 0.05, a jump; here the anneal is linear to 0.05
#   over those 128 updates, with no jump.
# - lr: theirs decays linearly to 0 over the 256 updates; here the decay is cosine over them (the
#   schedule's only shape).
# - precision: theirs trains in fp16; here bf16 compute on float32 weights (FSDP2).
# - initial buffer: their loop stops at about 10,020 trajectories (whole searcher iterations
#   past 1e4); here the first step waits for 10,000.
# - evaluation: the paper's win rate is judged by a 6.9B "gold" reward model
#   (cleanrl/EleutherAI_pythia-6.9b-deduped__reward__tldr, with the tokenizer of
#   EleutherAI/pythia-6.9b-deduped); here the judge is the training reward model unless
#   --eval-reward-model names a folder holding a classifier and its tokenizer. Evaluation runs on
#   the first 1,000 validation prompts every 64 updates (theirs is offline, after training).
set -euo pipefail
cd "$(dirname "$0")"
TRAINERS=${TRAINERS:-1}
SEARCHERS=${SEARCHERS:-3}
SIZE=${SIZE:-410m}
case "$SIZE" in 410m|1b|2.8b) ;; *) echo "run_tldr.sh: SIZE must be 410m, 1b or 2.8b, got $SIZE" >&2; exit 2;; esac

settings=(
  --model "mnoukhov/pythia${SIZE}-sft-tldr" --task tldr        # policy and pi_ref
  --reward-model "mnoukhov/pythia${SIZE}-rm-tldr6.9b"          # one output, read at the EOS
  --non-eos-penalty                         # a response without EOS scores -1
  --searchers "$SEARCHERS"
  --steps 256                               # 40,960 episodes at 160 a step
  --prompts-per-step 8                      # B
  --samples-per-prompt 20                   # K
  --search-samples-per-prompt 20            # searchers draw 20 per prompt
  --sync-every 10                           # k
  --recency 0.5                             # m; the other half by reward
  --reward-inv-temp 1                       # softmax(reward x 1) over each prompt's buffer
  --initial-buffer 10000                    # trajectories before the first update
  --beta 1.0 --beta-final 0.05 --beta-anneal-steps 128
  --lr 3e-6 --warmup-steps 0 --decay-steps 256 --grad-clip 0   # no gradient clipping in their loop
  --temperature 0.7 --max-new-tokens 128
  --micro-batch 20                          # one prompt's K=20 responses per forward/backward
  --dtype bfloat16
  --eval-every 64 --eval-limit 1000         # greedy, on validation prompts: score, win_rate, kl
)
if [ "$SIZE" = 2.8b ]; then  # 44.5 GB of float32 weights, gradients and AdamW state before any activation
  settings+=(--activation-checkpointing)
fi
passthrough=()
dry_run=0
for arg in "$@"; do
  if [ "$arg" = "--dry-run" ]; then dry_run=1; else passthrough+=("$arg"); fi
done
cmd=(torchrun --standalone --nproc_per_node="$TRAINERS" tba.py "${settings[@]}" "${passthrough[@]}")

echo "GPU split: $TRAINERS trainer GPU(s) + $SEARCHERS searcher GPU(s); Pythia $SIZE"
echo "${cmd[*]}"
if [ "$dry_run" = 1 ]; then
  exit 0
fi
exec "${cmd[@]}"
