"""TRL's GRPOTrainer on the toy setup of `tba.py`: the comparison run of `bench.py --parts 8`.

Trains the project's `tiny` model on the `arith` task with `trl.GRPOTrainer` (GRPO: K sampled
answers per prompt, advantage = reward minus the group mean over the group's standard deviation,
one policy-gradient step on them) and logs held-out greedy accuracy against time exactly as
`tba.py` does. TRL is not a dependency of the project: run this with the python of a virtual
environment of its own (`bench.py --parts 8` makes one in ~/.cache/tba/trl-venv):

    python3.11 -m venv ~/.cache/tba/trl-venv
    ~/.cache/tba/trl-venv/bin/pip install torch==2.13.0 trl==1.13.0 transformers==5.19.0 requests
    ~/.cache/tba/trl-venv/bin/python tools/trl_grpo.py --seed 0 --out runs/trl-s0

(TRL 1.13's GRPOTrainer imports `requests` without declaring it; hence the extra package.)
It needs torch, transformers, tokenizers and datasets, not vLLM: this file imports only
`tasks`, `rewards` and `tiny` from the project.

Setup, as `tba.py`'s defaults (`--model tiny`, task `arith`): the cached `tiny` model (built if
missing), the 7,700 training prompts and 400 held-out problems of `arith.splits()`, the
reward `rewards.arith_reward` (exact match after strip), B = 32 prompts x K = 8 samples per step,
temperature 1.0, at most 8 new tokens (generation stops at EOS), 200 steps, float32 on the CPU,
AdamW (weight decay 0) with gradient-norm clip 1.0, and the same learning-rate shape: constant,
then a cosine decay to 0 over the last 100 steps (`tba.py --decay-steps 100`; here transformers'
`warmup_stable_decay`, whose formula is `runtime.policy.lr_at`'s). Evaluation: greedy pass@1 on the 400
held-out problems, at most 8 new tokens, stopping at EOS, the same reward, at step 0 and every
10 steps, in a callback (batched: the arith prompts all have the same token length).

GRPO settings (one user's, reported to reach start + 0.15 in about 16 s here): learning rate 1e-4,
beta 0 (no KL term, no reference model), 8 generations per prompt, 256 completions per optimizer
step (per_device_train_batch_size counts completions), one optimizer step per generation batch
(steps_per_generation 1, num_iterations 1: on-policy, so the clipped ratio is 1 and epsilon does
nothing), TRL's default loss ("dapo": token-level, normalised by the batch's active tokens) and
reward scaling ("group"). No gradient checkpointing (TRL's default is on: it only slows this
0.65M-parameter model), no bf16 (TRL's default; tba.py trains in float32 on the CPU), no saving,
no evaluation by the trainer, no logging anywhere but OUT, torch threads = the cores (one process).

Where it departs from tba.py's setup, and why:
- the loss: GRPO's, not trajectory balance, so the learning rate is GRPO's (1e-4, the user's;
  tba.py's 5e-5 scales a TB gradient that is 2 / beta = 40 times REINFORCE's);
- the prompts: TRL's sampler walks a shuffled epoch (200 x 32 = 6,400 of the 7,700 prompts, none
  twice), tba.py draws 32 at random each step; generation is transformers' `generate` in the
  training process (TRL without vLLM), tba.py's is vLLM;
- the schedule is tba.py's, not TRL's default linear decay to 0 (`--lr-scheduler linear` for that):
  the comparison is of the algorithms on one setup, and the schedule is part of the setup.

Output in --out: `config.json` (settings, versions, `started`: the Unix time of t = 0, taken at the
top of this file) and `metrics.jsonl`, one JSON object a line:
- `"kind": "eval"`: `step`, `accuracy`, `time` (s since t = 0 minus all evaluation time before
  it, at the moment the weights of `step` were made), `seconds` (this evaluation), `overhead` (all
  evaluation time so far, this one excluded: time + overhead is the raw clock);
- `"kind": "train"`, one a step: `step`, `time` (as above), `seconds` (the step), `generate` (s in
  `model.generate`), `score` (s in the rest of TRL's rollout: decoding, rewards, advantages),
  `reward` (batch mean), `loss`, `lr`, `grad_norm`, `completion_length` (mean tokens), `overhead`.
"""

import time

T0 = time.time()  # t = 0: before the imports (torch, transformers and TRL take seconds)

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root, above tools/
sys.path.insert(0, ROOT)  # for tiny, rewards and tasks

import torch

from runtime import tiny
from rewards import arith_reward
from tasks.arith import splits as arith_splits


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder (metrics.jsonl, config.json)")
    p.add_argument("--model", default=None, help="model folder (default: the cached `tiny` model, built if missing)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--prompts-per-step", type=int, default=32, help="B")
    p.add_argument("--samples-per-prompt", type=int, default=8, help="K: GRPO's num_generations")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lr-scheduler", default="tba", choices=["tba", "linear", "constant"],
                   help="tba: constant, then cosine to 0 over the last --decay-steps (tba.py's); "
                        "linear: TRL's default, linear to 0 over all steps; constant")
    p.add_argument("--decay-steps", type=int, default=100)
    p.add_argument("--beta", type=float, default=0.0, help="GRPO's KL coefficient")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=10, help="steps between evaluations (and at step 0)")
    p.add_argument("--eval-limit", type=int, default=None, help="the first N held-out problems only")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    return p.parse_args(argv)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, problems, max_new_tokens: int) -> tuple[float, dict]:
    """Greedy pass@1 as tba.py's evaluation (vLLM, temperature 0): at most `max_new_tokens`, stop at
    EOS, the text decoded without special tokens, `arith_reward`. One batch: the prompts all have
    the same token length, so there is no padding. Returns (accuracy, the first problem's answer)."""
    was_training = model.training
    model.eval()
    rows = [tokenizer(p.prompt).input_ids for p in problems]
    assert len({len(r) for r in rows}) == 1, "greedy_accuracy needs prompts of one token length"
    ids = torch.tensor(rows)                                     # (N, P)
    prompt_len, eos = ids.shape[1], tokenizer.eos_token_id
    done = torch.zeros(len(rows), dtype=torch.bool)
    for _ in range(max_new_tokens):
        nxt = model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1)  # (N,)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        done |= nxt == eos
        if done.all():
            break
    texts = []
    for row in ids[:, prompt_len:].tolist():
        row = row[:row.index(eos)] if eos in row else row    # what vLLM returns: up to the stop token
        texts.append(tokenizer.decode(row, skip_special_tokens=True))
    rewards = [arith_reward(t, p.answer) for t, p in zip(texts, problems)]
    model.train(was_training)
    return sum(rewards) / len(rewards), dict(prompt=problems[0].prompt, completion=texts[0], reward=rewards[0])


def main(argv=None):
    args = parse(argv)
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)

    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model_path = args.model or tiny.cached()
    train, test = arith_splits()
    test = test[: args.eval_limit] if args.eval_limit else test
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    dataset = datasets.Dataset.from_dict({"prompt": [p.prompt for p in train], "answer": [p.answer for p in train]})

    def arith(completions, answer, **_):  # TRL's reward-function signature around the project's reward
        return [arith_reward(c, a) for c, a in zip(completions, answer)]

    scheduler = dict(tba=("warmup_stable_decay", dict(num_decay_steps=args.decay_steps, decay_type="cosine",
                                                      num_stable_steps=max(0, args.steps - args.decay_steps))),
                     linear=("linear", None), constant=("constant", None))[args.lr_scheduler]
    config = GRPOConfig(
        output_dir=os.path.join(args.out, "trainer"),  # nothing is written there (no saving)
        seed=args.seed, max_steps=args.steps, use_cpu=True, bf16=False, gradient_checkpointing=False,
        learning_rate=args.lr, lr_scheduler_type=scheduler[0], lr_scheduler_kwargs=scheduler[1], warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0,
        per_device_train_batch_size=args.prompts_per_step * args.samples_per_prompt,  # completions, not prompts
        gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        num_generations=args.samples_per_prompt, max_completion_length=args.max_new_tokens,
        temperature=args.temperature, top_p=1.0, top_k=0, beta=args.beta,
        eval_strategy="no", save_strategy="no", report_to="none", push_to_hub=False,
        logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
    )

    os.makedirs(args.out, exist_ok=True)
    versions = dict(trl=trl.__version__, transformers=transformers.__version__, torch=torch.__version__,
                    datasets=datasets.__version__, python=sys.version.split()[0])
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(dict(vars(args), threads=threads, model_path=model_path, started=T0, versions=versions,
                       grpo={k: v for k, v in config.to_dict().items() if isinstance(v, (int, float, str, bool, type(None)))}),
                  f, indent=1)
    metrics = open(os.path.join(args.out, "metrics.jsonl"), "a")
    clock = dict(overhead=0.0, generate=0.0, score=0.0, step_start=0.0)

    def now() -> float:  # s since t = 0, without the evaluations
        return time.time() - T0 - clock["overhead"]

    def write(**row):
        metrics.write(json.dumps(row) + "\n")
        metrics.flush()

    class Timed(GRPOTrainer):
        """GRPOTrainer with its rollout timed: `model.generate`, then decoding, rewards, advantages."""

        def _generate_single_turn(self, *a, **k):
            t = time.perf_counter()
            out = super()._generate_single_turn(*a, **k)
            clock["generate"] += time.perf_counter() - t
            return out

        def _generate_and_score_completions(self, *a, **k):
            t, g = time.perf_counter(), clock["generate"]
            out = super()._generate_and_score_completions(*a, **k)
            clock["score"] += time.perf_counter() - t - (clock["generate"] - g)
            return out

    class Evaluate(TrainerCallback):
        """Held-out greedy accuracy at step 0 and every --eval-every steps; one train row a step."""

        def __init__(self):
            self.pending = None  # the train row of the step just ended, completed by on_log

        def evaluate(self, model, step):
            made, t = now(), time.time()
            accuracy, example = greedy_accuracy(model, tokenizer, test, args.max_new_tokens)
            seconds = time.time() - t
            write(kind="eval", step=step, accuracy=accuracy, time=made, seconds=seconds,
                  overhead=clock["overhead"], example=example)
            clock["overhead"] += seconds
            print(f"eval  step {step:5d} | held-out accuracy {accuracy:.3f} | {made:.1f}s", flush=True)

        def on_train_begin(self, args_, state, control, model=None, **kw):
            self.evaluate(model, 0)

        def on_step_begin(self, args_, state, control, **kw):
            clock.update(step_start=time.time(), generate=0.0, score=0.0)

        def on_step_end(self, args_, state, control, model=None, **kw):
            step = state.global_step
            self.pending = dict(kind="train", step=step, time=now(), seconds=time.time() - clock["step_start"],
                                generate=clock["generate"], score=clock["score"], overhead=clock["overhead"])
            if args.eval_every and step % args.eval_every == 0 or step == args.steps:
                self.evaluate(model, step)

        def on_log(self, args_, state, control, logs=None, **kw):
            if self.pending is None or "loss" not in (logs or {}):
                return
            row, self.pending = self.pending, None
            row.update(reward=logs.get("reward"), loss=logs.get("loss"), lr=logs.get("learning_rate"),
                       grad_norm=logs.get("grad_norm"), completion_length=logs.get("completions/mean_length"))
            write(**row)
            print(f"step {row['step']:5d} | reward {row['reward']:.3f} | lr {row['lr']:.2e} | "
                  f"{row['seconds']:.3f}s (generate {row['generate']:.3f}s) | {row['time']:.1f}s", flush=True)

    trainer = Timed(model=model, reward_funcs=arith, args=config, train_dataset=dataset,
                    processing_class=tokenizer, callbacks=[Evaluate()])
    trainer.remove_callback(PrinterCallback)  # the console gets this file's lines instead of TRL's dicts
    trainer.train()
    metrics.close()
    with open(os.path.join(args.out, "metrics.jsonl")) as f:
        evals = [json.loads(line) for line in f if '"eval"' in line]
    print(f"done: {args.steps} steps in {now():.0f} s (+{clock['overhead']:.1f} s evaluating) | held-out accuracy "
          f"{evals[0]['accuracy']:.3f} (step 0) -> {evals[-1]['accuracy']:.3f} (step {evals[-1]['step']}) | "
          f"trl {trl.__version__} | {args.out}", flush=True)


if __name__ == "__main__":
    main()
