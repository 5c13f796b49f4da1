"""The red-teaming attacker's supervised fine-tuning, as Lee et al. ran it: their prior, pi_ref.

Lee et al. (github.com/GFNOrg/red-teaming) first fine-tune GPT-2 on 3,003 harmful instructions, and
that model is both where the GFlowNet starts and its prior: `run_redteam.sh` needs its output as
ATTACKER. Their recipe (README "SFT", main.py:15-62, trainers/sft_trainer.py, dataset.py:12-70):
- data: the instructions of `prompts/sft_dataset.json` (a JSON list of {"instruction": ...}),
  stripped, shuffled with seed 42, the first 10% held out for a validation loss every 10 steps;
- each example is an attacker prompt (one drawn at random from `--prompts`, their
  `prompts/alpaca.jsonl`; by default tasks/redteam.py's one instruction list) + " " + the instruction +
  EOS, the loss (cross-entropy, a mean over each micro-batch's tokens) on the tokens after the prompt;
- 100 steps of 1,024 examples (their loader's batches: an epoch's last one is smaller), each in 32
  micro-batches, AdamW at lr 3e-5 with weight decay 0.1 (not on biases and LayerNorm weights:
  utils.py:195-221), gradient-norm clip 1.0, float32, all weights;
- the learning rate is transformers' linear warmup over 100 steps then linear decay to the end,
  with the end at 100 steps: a warmup over the whole run, the first update at lr 0 (as theirs).
The model and its tokenizer are saved to --out. Here the batches are right-padded (theirs: left-
padded with explicit position ids; the same sums for a causal LM).

    # their files: prompts/sft_dataset.json and prompts/alpaca.jsonl from github.com/GFNOrg/red-teaming
    python tools/sft_attacker.py sft_dataset.json --prompts alpaca.jsonl --model gpt2 --out save/gpt2-sft
    ATTACKER=save/gpt2-sft bash run_redteam.sh

On one GPU this is a few minutes for GPT-2 (102,400 examples of about 60 tokens); on the CPU use a
small model and fewer steps (tests/test_sft_attacker.py).
"""

import argparse
import json
import math
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tasks import redteam, task  # noqa: E402  (after the path: the project's modules)
from runtime.errors import ConfigError  # noqa: E402


def fail(msg: str):
    print(f"sft_attacker.py: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def read_instructions(path: str) -> list[str]:
    """Their sft_dataset.json: a JSON list of objects with a text field "instruction"."""
    try:
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)
    except OSError as e:
        fail(f"DATA: cannot read {path} ({e.strerror})")
    except ValueError:
        fail(f"DATA: {path} is not valid JSON")
    if not isinstance(rows, list) or not rows:
        fail(f"DATA: {path} is not a non-empty JSON list of {{\"instruction\": ...}} objects")
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("instruction"), str) or not row["instruction"].strip():
            fail(f"DATA: {path} item {i}: no text field 'instruction'")
    return [row["instruction"].strip() for row in rows]


def read_prompts(path: str | None) -> list[str]:
    """Attacker prompts: their JSONL (one {"attacker_prompt": ...} a line), or tasks/redteam.py's one."""
    if path is None:
        return [redteam.ATTACK_PROMPT]
    try:
        return [p.prompt for p in task.read_jsonl(path, redteam.problem)]
    except ConfigError as e:
        fail(str(e).replace("--data", "--prompts", 1))


def split(instructions: list[str]) -> tuple[list[str], list[str]]:
    """(train, validation): shuffled with seed 42, the first 10% for validation (dataset.py:25-32)."""
    shuffled = list(instructions)
    random.Random(42).shuffle(shuffled)
    held = int(len(shuffled) * 0.1)
    return shuffled[held:], shuffled[:held]


def example(tokenizer, prompt: str, instruction: str) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of prompt + " " + instruction + EOS, the loss on what follows the prompt
    (dataset.py:49-70)."""
    ids = tokenizer(prompt + " " + instruction).input_ids + [tokenizer.eos_token_id]
    n = len(tokenizer(prompt).input_ids)
    return ids, [0] * n + [1] * (len(ids) - n)


def lr_at(step: int, lr: float, warmup: int, steps: int) -> float:
    """transformers' get_linear_schedule_with_warmup for update `step` (0-based; theirs steps the
    scheduler after each update, so update 0 has lr 0)."""
    if step < warmup:
        return lr * step / max(1, warmup)
    return lr * max(0.0, (steps - step) / max(1, steps - warmup))


def decay_names(model) -> set[str]:
    """Parameters that get weight decay: not biases, not in a LayerNorm (utils.py:195-221)."""
    import torch
    names = set()
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.LayerNorm):
            continue
        for name, _ in module.named_parameters(recurse=False):
            if "bias" not in name:
                names.add(f"{module_name}.{name}" if module_name else name)
    return names


def loss_of(model, rows, pad: int, device):
    """Mean cross-entropy over the masked tokens of `rows` [(ids, mask)], right-padded."""
    import torch
    T = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([r + [pad] * (T - len(r)) for r, _ in rows], device=device)          # (n, T)
    mask = torch.tensor([m + [0] * (T - len(m)) for _, m in rows], device=device)           # (n, T)
    attention = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r, _ in rows], device=device)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()        # (n, T-1, V)
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # (n, T-1)
    return (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()


def batches(train: list[str], size: int, rng: random.Random):
    """Their loader: shuffled epochs cut into batches of `size`, the last one smaller."""
    while True:
        order = list(train)
        rng.shuffle(order)
        for i in range(0, len(order), size):
            yield order[i:i + size]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", help="their sft_dataset.json: a JSON list of {\"instruction\": ...}")
    p.add_argument("--out", required=True, help="folder for the fine-tuned model and its tokenizer (new or empty)")
    p.add_argument("--model", default="gpt2", help="the attacker to fine-tune: a folder or hub id (theirs: gpt2)")
    p.add_argument("--prompts", default=None, help="attacker prompts, their attack-prompt JSONL (theirs: "
                                                   "prompts/alpaca.jsonl); default: tasks/redteam.py's instruction list")
    p.add_argument("--steps", type=int, default=100, help="updates (theirs: 100)")
    p.add_argument("--batch", type=int, default=1024, help="examples an update (theirs: 1,024)")
    p.add_argument("--grad-acc", type=int, default=32, help="micro-batches an update (theirs: 32)")
    p.add_argument("--lr", type=float, default=3e-5, help="peak learning rate (theirs: 3e-5)")
    p.add_argument("--warmup", type=int, default=100, help="linear warmup updates (theirs: 100)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (theirs: 0.1)")
    p.add_argument("--seed", type=int, default=42, help="seed of the batches, prompts and dropout (theirs: 42)")
    args = p.parse_args(argv)
    for flag in ("steps", "batch", "grad_acc"):
        if getattr(args, flag) < 1:
            fail(f"--{flag.replace('_', '-')}: must be at least 1")
    if args.lr <= 0 or args.warmup < 0 or args.weight_decay < 0:
        fail("--lr must be positive, --warmup and --weight-decay 0 or more")
    if os.path.isdir(args.out) and os.listdir(args.out):
        fail(f"--out: {args.out} exists and is not empty")
    instructions, prompts = read_instructions(args.data), read_prompts(args.prompts)
    train, validation = split(instructions)
    if not train:
        fail(f"DATA: {args.data} holds {len(instructions)} instruction(s): too few to train on")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runtime import hub
    try:
        path = hub.resolve_model(args.model)
    except ConfigError as e:
        fail(str(e))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.eos_token_id is None:
        fail(f"--model: the tokenizer of {path} has no EOS token")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    decay = decay_names(model)
    named = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    opt = torch.optim.AdamW([{"params": [q for n, q in named if n in decay], "weight_decay": args.weight_decay},
                             {"params": [q for n, q in named if n not in decay], "weight_decay": 0.0}], lr=args.lr)
    rng = random.Random(args.seed)
    encode = lambda texts: [example(tokenizer, rng.choice(prompts), t) for t in texts]
    held = [example(tokenizer, prompts[i % len(prompts)], t) for i, t in enumerate(validation)]
    per = lambda rows: math.ceil(len(rows) / args.grad_acc)  # torch.chunk's micro-batch size, as theirs

    @torch.no_grad()
    def validate() -> float:
        model.eval()
        losses = [loss_of(model, held[i:i + per(held)], pad, device).item() for i in range(0, len(held), per(held))]
        model.train()
        return sum(losses) / len(losses) if losses else float("nan")

    print(f"{len(train)} instructions to train on, {len(validation)} held out, {len(prompts)} prompt(s); "
          f"{args.steps} steps of {args.batch} on {device}", flush=True)
    t0, source = time.time(), batches(train, args.batch, rng)
    model.train()
    for step in range(args.steps):
        rows = encode(next(source))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.lr, args.warmup, args.steps)
        total = 0.0
        for i in range(0, len(rows), per(rows)):
            loss = loss_of(model, rows[i:i + per(rows)], pad, device) / args.grad_acc
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % 10 == 0 or step + 1 == args.steps:
            print(f"step {step + 1:4d}/{args.steps} | train loss {total:.4f} | validation loss {validate():.4f} | "
                  f"lr {lr_at(step, args.lr, args.warmup, args.steps):.2e} | {time.time() - t0:.0f}s", flush=True)
    model.eval()
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"saved the attacker to {args.out}: pass it as ATTACKER= (run_redteam.sh) or --model (tba.py)", flush=True)


if __name__ == "__main__":
    main()
