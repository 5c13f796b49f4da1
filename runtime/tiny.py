"""The `tiny` model: a small Llama with a character-level tokenizer, warm-started on `arith`.

It plays the paper's SFT model (pi_ref): `--model tiny` builds it once (about 20 s on two idle
CPU cores, minutes on busy ones, with a line every few seconds), caches it under $TBA_CACHE
(default ~/.cache/tba) and reuses it. The warm start is a short supervised pass on the answers of
training problems, stopped on purpose as soon as greedy accuracy on 512 training problems, checked
after every step near the target, reaches 35%, so that RL has room to improve it. Where the warm
start stops decides how much RL gains in 200 steps: a fixed number of steps does not do (accuracy
climbs from 25% to 70% within 30 steps, and float rounding moves that climb by several steps
between CPUs). The held-out accuracy it starts RL from still depends on the CPU (0.385 on a 2-core
AMD EPYC, 0.325 on a 2-core Intel Xeon, measured): each CPU's float kernels (AVX2 or AVX-512 code
paths, another order of summation) round differently, the difference grows over some 240 steps
into other weights, and the 512 check problems and the 400 held-out ones (sampling error about
0.02 each) agree only roughly on where 35% lies. Equal kernels everywhere (one thread, ATen's
default CPU capability, MKL's reproducible mode) would give another model on every CPU, this
project's measurements' included, so they are not used.

    python -m runtime.tiny OUT_DIR                    # build it into OUT_DIR instead of the cache
    python -m runtime.tiny --task countdown [OUT_DIR] # warm-started on another task's demos (its `demos()`)

A task that brings demonstrations (tasks/task.py: `demos()`, solved problems) gets a tiny model warm-started on
them instead, the same way, until greedy responses to 512 of its training problems score `TASK_TARGET` on its
held-out metric: `--model tiny` builds it on first use for such a task (`cached(task)`), so a new task learns on
a laptop from its own start.

Tests make untrained models of other architectures (Pythia, Qwen2, GPT-2) in tests/models.py.
"""

import fcntl
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time

import torch

from tasks.arith import splits as arith_splits

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = [chr(i) for i in range(32, 127)] + ["\n"]  # printable ASCII and newline: enough for GSM8K too
TMP = ".tiny-"  # the prefix of a build's temporary folder, beside the one it builds
RECIPE = dict(  # everything that decides the cached model; its hash names the cache folder
    version=4, hidden=128, layers=3, heads=4, ffn=384, max_len=256, seed=0,
    sft_max_steps=600, sft_batch=64, sft_lr=1e-3, sft_target=0.35, sft_check=512,
)


def make_tokenizer():
    """A character-level tokenizer that loads in transformers and in vLLM."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token a character
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")


def llama_config(tokenizer, hidden: int, layers: int, heads: int, ffn: int, max_len: int, **extra):
    """A transformers Llama config in the given shape, with the tokenizer's special tokens and the
    LM head tied to the embeddings."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=ffn,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=max_len, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **extra)


def make_model(out: str, hidden=64, layers=2, heads=2, ffn=None, max_len=256, seed=0, tokenizer=None):
    """Save a randomly initialised tiny Llama and its tokenizer (default: the character-level one)
    to `out`; return (model, tokenizer)."""
    import transformers

    tokenizer = tokenizer or make_tokenizer()
    config = llama_config(tokenizer, hidden, layers, heads, ffn or 3 * hidden, max_len)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model, tokenizer


def warm_start(model, tokenizer, steps: int, batch: int, lr: float, seed: int, target: float = 1.0,
               check: int = 512, progress=None, task: str | None = None) -> dict:
    """Supervised pass on arith answers, or a task's demos (`task`: its solutions; the loss covers the answer and EOS
    only), for `steps` steps or until greedy accuracy on `check` training problems reaches `target` (measured every
    5 steps, and after every step from within 0.1 of the target; a task's by its held-out metric on greedy
    responses). `progress(step, accuracy)` after each step (the latest accuracy measured). Returns what it did."""
    train, _ = arith_splits()
    rng, check = random.Random(seed), random.Random(seed + 1).sample(train, check)
    accuracy_of = greedy_accuracy
    if task is not None:
        train, check, accuracy_of = demo_set(task, check, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    accuracy = 0.0
    for step in range(1, steps + 1):
        model.train()
        rows = []
        for p in (rng.sample(train, batch) if len(train) >= batch else rng.choices(train, k=batch)):  # (few demos)
            prompt = tokenizer(p.prompt).input_ids
            target_ids = tokenizer(p.answer).input_ids + [tokenizer.eos_token_id]
            rows.append((prompt + target_ids, [0] * len(prompt) + [1] * len(target_ids)))
        T = max(len(ids) for ids, _ in rows)
        ids = torch.tensor([r + [tokenizer.pad_token_id] * (T - len(r)) for r, _ in rows])  # (B, T)
        mask = torch.tensor([m + [0] * (T - len(m)) for _, m in rows])                   # (B, T)
        logits = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long()).logits
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if target < 1.0 and (step % 5 == 0 or accuracy >= target - 0.1):  # every step near the target
            accuracy = accuracy_of(model, tokenizer, check)
            if accuracy >= target:
                break
        if progress:
            progress(step, accuracy)
    model.eval()
    return dict(sft_steps_taken=step, sft_check_accuracy=accuracy)


def demo_set(task: str, check: list, seed: int) -> tuple[list, list, object]:
    """A task's warm start: its demos to imitate, `len(check)` of its training problems to check on, and the check
    (its held-out metric, or its reward, of greedy responses)."""
    import tasks
    entry = tasks.get(task)
    demos, (problems, _) = entry.demos(), entry.load(None)
    score = entry.metric or entry.reward

    def accuracy(model, tokenizer, problems):
        longest = max(len(tokenizer(p.answer).input_ids) for p in demos) + 1  # a demo's solution and its end
        texts = greedy_texts(model, tokenizer, [p.prompt for p in problems], longest)
        return sum(score(t, p.answer) for t, p in zip(texts, problems)) / len(problems)
    return demos, random.Random(seed + 1).sample(problems, min(len(check), len(problems))), accuracy


@torch.no_grad()
def greedy_texts(model, tokenizer, prompts: list[str], max_new: int, batch: int = 256) -> list[str]:
    """Greedy responses to `prompts` (left-padded batches), as text."""
    model.eval()
    out = []
    for i in range(0, len(prompts), batch):
        rows = [tokenizer(p).input_ids for p in prompts[i:i + batch]]
        T = max(map(len, rows))
        ids = torch.tensor([[tokenizer.pad_token_id] * (T - len(r)) + r for r in rows])
        mask = (torch.arange(T) >= torch.tensor([T - len(r) for r in rows])[:, None]).long()
        made = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        out += tokenizer.batch_decode(made[:, T:], skip_special_tokens=True)
    return out


@torch.no_grad()
def greedy_accuracy(model, tokenizer, problems) -> float:
    """Exact-match accuracy of greedy answers, in one forward pass: greedy decoding writes the answer
    and EOS exactly when, fed the right answer, the argmax at each answer position and at the EOS
    is the right token (by induction over the positions). Arith prompts all have the same length."""
    model.eval()
    rows = [tokenizer(p.prompt).input_ids + tokenizer(p.answer).input_ids + [tokenizer.eos_token_id] for p in problems]
    P = len(tokenizer(problems[0].prompt).input_ids)
    T = max(len(r) for r in rows)
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (T - len(r)) for r in rows])         # (N, T)
    target = torch.zeros_like(ids, dtype=torch.bool)                                          # (N, T)
    for i, r in enumerate(rows):
        target[i, P:len(r)] = True                                                            # answer and EOS
    argmax = model(input_ids=ids).logits[:, :-1].argmax(-1)                                   # (N, T-1): token t+1
    right = (argmax == ids[:, 1:]) | ~target[:, 1:]                                           # (N, T-1)
    return right.all(dim=1).float().mean().item()


TASK_RECIPE = dict(sft_max_steps=3000, sft_target=0.15)  # a task's own warm start (countdown: tests/test_tiny.py)


def recipe_for(task: str | None) -> dict:
    """The recipe of the tiny model of `task` (None: arith's, RECIPE as it is)."""
    return RECIPE if task is None else dict(RECIPE, **TASK_RECIPE, task=task)


def build(out: str, recipe: dict = RECIPE, every: float = 5.0) -> str:
    """Build the tiny model into `out` (made atomically: a temporary folder, then a rename; the folder goes
    whatever stops the build), with a line every `every` s: the warm start's step and check accuracy. A recipe
    with a `task` warm-starts on that task's demos."""
    r = recipe
    tmp = tempfile.mkdtemp(prefix=TMP, dir=os.path.dirname(os.path.abspath(out)))
    t0 = last = time.time()

    def progress(step, accuracy):
        nonlocal last
        if time.time() - last >= every:  # a busy machine takes minutes: show that it moves
            last = time.time()
            print(f"  warm start: step {step} (at most {r['sft_max_steps']}), check accuracy {accuracy:.3f} "
                  f"(stops at {r['sft_target']:g}), {last - t0:.0f} s", flush=True)
    try:
        model, tokenizer = make_model(tmp, r["hidden"], r["layers"], r["heads"], r["ffn"], r["max_len"], r["seed"])
        done = warm_start(model, tokenizer, r["sft_max_steps"], r["sft_batch"], r["sft_lr"], r["seed"],
                          r["sft_target"], r["sft_check"], progress, r.get("task"))
        model.save_pretrained(tmp)
        with open(os.path.join(tmp, "tiny_recipe.json"), "w") as f:
            json.dump(dict(r, **done), f, indent=1)
        os.rename(tmp, out)
    except OSError:  # another process finished the same build first (`out` exists): keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isfile(os.path.join(out, "tiny_recipe.json")):
            raise
    except BaseException:  # Ctrl-C, an error: no half-built folder left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def cached(task: str | None = None) -> str:
    """The path of the cached tiny model (warm-started on arith, or on `task`'s demos), building it on first use."""
    root = os.environ.get("TBA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tba")
    recipe = recipe_for(task)
    key = hashlib.sha256(json.dumps([recipe, SPECIALS, CHARS], sort_keys=True).encode()).hexdigest()[:12]
    path = os.path.join(root, f"tiny-{key}" if task is None else f"tiny-{task}-{key}")
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time (torchrun ranks start together)
        if not os.path.isfile(os.path.join(path, "tiny_recipe.json")):
            remove_stale(root, time.time())
            print(f"building the tiny model{f' for {task}' if task else ''} once into {path} (a line every few "
                  f"seconds) ...", flush=True)
            t0 = time.time()
            build(path, recipe)
            print(f"built in {time.time() - t0:.0f} s", flush=True)
    return path


def remove_stale(root: str, since: float):
    """The temporary folders of builds that died (killed: no cleanup ran), found by the next builder under the
    lock: made before it took the lock (`since`), so by a builder that no longer holds it."""
    for name in os.listdir(root):
        folder = os.path.join(root, name)
        if name.startswith(TMP) and os.path.isdir(folder) and os.path.getmtime(folder) < since:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    task = args.pop(args.index("--task") + 1) if "--task" in args[:-1] else None
    args = [a for a in args if a != "--task"]
    if len(args) > 1 or (not args and task is None):
        sys.exit(__doc__)
    if task is not None:
        import tasks
        if task not in tasks.TASKS or tasks.get(task).demos is None:
            sys.exit(f"runtime.tiny: --task {task}: not a task with demos() (those with: "
                     f"{', '.join(n for n in tasks.TASKS if tasks.get(n).demos)})")
    print(build(args[0], recipe_for(task)) if args else cached(task))
