#!/usr/bin/env bash
# The paper's MATH run (Bartoldson et al., 2025, Sec. 6): TBA′ (TB with pi_ref reset every 50 steps) against
# Dr. GRPO, Qwen 2.5 7B on MATH, evaluated on MATH-500, at an exact lag of 2 or 10 steps, on one 8-GPU node.
# The settings are the paper's and the authors' experiment files' (bbartoldson/tba-prime at 71c1716):
# docs/departures.md, "The MATH run", says where ours still differ. Trainer rank 0 holds about 75 GB under TBA′
# (59 under Dr. GRPO; 78 and 63 with --behaviour-logprobs trainer) of an 80 GB card, and its host --lag's pinned
# slots, 45.7 GB at LAG=2, 167.5 at 10 (57.1 and 209.4 with --behaviour-logprobs trainer's, 11.4 and 41.9 on each
# other rank): as allocated, term by term, in docs/gpu.md ("Memory"; no GPU ran it).
#
#   bash run_math.sh                          # TBA′, lag 2, importance weights on
#   bash run_math.sh --dry-run                # print the command and settings, start nothing
#   LOSS=drgrpo bash run_math.sh              # the baseline: Dr. GRPO
#   NORM=response bash run_math.sh            # each response's sum / its length (default: sequence, the authors':
#                                             # / its prompt + response length; budget: / 4,096, Liu et al.'s)
#   LAG=10 IS=off bash run_math.sh            # lag 10; TBA′ without importance weights (IS=on|off, LOSS=tb)
#   EVAL=greedy bash run_math.sh              # evaluate greedily instead of at the training temperature
#   bash run_math.sh --data ../math           # train.jsonl and test.jsonl of one's own (docs/tasks.md); extra
#                                             # arguments pass through, but not a flag of `settings` below
#                                             # (--lag 5: refused, as LAG=5 is)
#
# GPU split: TRAINERS GPUs train (torchrun ranks, FSDP2), the next SEARCHERS GPUs each run one vLLM searcher;
# the authors' multinode_launch.sh ran 4 trainer + 4 inference GPUs. B = 32 must be a multiple of TRAINERS.
set -euo pipefail
cd "$(dirname "$0")"
TRAINERS=${TRAINERS:-4}
SEARCHERS=${SEARCHERS:-4}
LOSS=${LOSS:-tb}
NORM=${NORM:-sequence}
LAG=${LAG:-2}
EVAL=${EVAL:-sampled}
fail() { echo "run_math.sh: $1" >&2; exit 2; }
case "$LAG" in 2|10) ;; *) fail "LAG must be 2 or 10 (the paper's lags), got $LAG";; esac
case "$TRAINERS" in *[!0-9]*|0|'') ;; *) [ $((32 % TRAINERS)) -eq 0 ] || fail "TRAINERS must divide B = 32, got $TRAINERS";; esac
case "$NORM" in response|sequence|budget) ;; *) fail "NORM must be response, sequence or budget, got $NORM";; esac
case "$LOSS" in
  tb)
    IS=${IS:-on}
    case "$IS" in on) WEIGHTS=--importance-weights;; off) WEIGHTS=--no-importance-weights;;
      *) fail "IS must be on or off, got $IS";; esac
    case $TRAINERS,${PYTORCH_CUDA_ALLOC_CONF:-} in 4,*expandable_segments:True*) ;; 4,*)  # memory.py's figures
      launch_note="run_math.sh: trainer rank 0 of 4 under TBA′ holds about 84 GB of an 80 GB card's 84.5 usable \
(docs/gpu.md, \"Memory\"), under the 5 GB kept free: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True leaves about 7";;
    esac
    objective=(
      --loss tbprime                        # TBA′'s update (loss.tbprime_loss)
      --ref-reset-every 50                  # rho: pi_ref becomes the current policy every 50 steps (Sec. 6)
      --beta 0.005                          # fixed: --beta-final defaults to it, no anneal (Sec. 6)
      "$WEIGHTS"                            # IS: each token weighted by min(pi / mu, c), or the plain gradient
    );;
  drgrpo)
    [ -z "${IS:-}" ] || fail "IS is TBA′'s (LOSS=tb), got IS=$IS with LOSS=drgrpo"
    objective=(
      --loss drgrpo                         # A = r - mean r, per-token min(pi / mu, c), no clip, no KL
    );;
  *) fail "LOSS must be tb or drgrpo, got $LOSS";;
esac
case "$EVAL" in sampled) EVAL_T=1.0;; greedy) EVAL_T=0;; *) fail "EVAL must be sampled or greedy, got $EVAL";; esac

settings=(
  --model Qwen/Qwen2.5-7B --task math       # the base model (the paper's "Qwen 2.5 7B"; theirs: -Instruct)
  --searchers "$SEARCHERS"
  --steps 420                               # issue 37 (the paper's text: 400)
  --prompts-per-step 32                     # B (Sec. 6)
  --samples-per-prompt 16                   # K: a group of 16 (Sec. 6; their SamplingConfig.n)
  --search-samples-per-prompt 16            # searchers draw exactly K per prompt: every rollout trained on once
  --lag "$LAG"                              # batch n is sampled by the weights of step n - LAG, exactly (their
                                            # async_level, infer.py:174-229); with --lag every batch is its step's
                                            # rounds, used once: no replay (--recency, --max-reuse play no part)
  "${objective[@]}"
  --is-cap 8                                # c of min(pi / mu, c): their RatioConfig.clip_ratio (config.py:106)
  --norm "$NORM"                            # sequence: each sample's token sum / its prompt + response length,
                                            # theirs (train.py:465-468, data.py:647, loss.py:156, 266, micro-batch 1)
  --lr 1e-6 --warmup-steps 0 --decay-steps 0   # constant (Sec. 6; their train.py has no scheduler)
  --weight-decay 0.01 --adam-betas 0.9,0.99 # their AdamW (train.py:143-148, config.py:11-18)
  --grad-clip 1.0                           # their grad_norm_clip (config.py:28, train.py:447)
  --temperature 1.0                         # their sampling: T 1, top-p 1 (vLLM's default; no flag sets another)
  --context 4096                            # prompt + response <= 4,096 tokens (Sec. 6), each response the room
  --max-new-tokens 4096                     # its prompt leaves (their vLLM max_model_len, max_tokens None)
  --micro-batch 1                           # one sequence a pass (a pass without gradient first gives log Z's stats)
  --activation-checkpointing                # their ac_ckpt (train.py:129-131)
  --dtype bfloat16                          # vLLM, pi_ref and the compute in bf16; float32 weights and AdamW, as
  --trainer-dtype float32                   # theirs (FSDP2 bf16 params over float32 weights: train.py:59-68)
  --eval-every 5                            # MATH-500, all 500 problems, one response each
  --save-every 100                          # a checkpoint (model, AdamW, the lag's L steps of weights: about 137 GB
                                            # at LAG=2, 260 GB at 10) every 100 steps
  --eval-temperature "$EVAL_T"              # EVAL=sampled: the training temperature; greedy: 0
)
source scripts/launch.sh
launch "LOSS=$LOSS LAG=$LAG EVAL=$EVAL NORM=$NORM${IS:+ IS=$IS}" "$@"
