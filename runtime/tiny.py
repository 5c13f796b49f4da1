"""The `tiny` model: a small Llama with a character-level tokenizer, warm-started on `arith`.

It plays the paper's SFT model (pi_ref), and ships with the project so that the toy run starts from the same
weights, and the same held-out accuracy, on every CPU: runtime/tiny-arith/ holds its float32 weights (2.6 MB), its
tokenizer and its `tiny_recipe.json` (what it is made of, `made_of`, with the hash of that, its identity; the warm
start's steps and check accuracy; its greedy accuracy on arith's 400 held-out problems, `heldout_accuracy`). It was
made on a 2-core AMD EPYC, in 100 s on cores shared with other jobs, by

    rm -rf runtime/tiny-arith && python -m runtime.tiny runtime/tiny-arith

`--model tiny` takes it where its recorded identity is the code's (RECIPE, the tokenizer's characters and arith's
training problems, unedited). Where it is not, and for a task with demos (tasks/task.py: `demos()`, warm-started the
same way until TASK_RECIPE's target), `--model tiny` builds the model once into $TBA_CACHE (default ~/.cache/tba), in
a folder named by the hash of what decides it, saying why in one line, with a line every few seconds; docs/faults.md
says what a damaged folder or a second builder does.

The warm start is a short supervised pass on the answers of training problems, stopped as soon as greedy
accuracy on 512 training problems reaches 35% (why, and how far apart two CPUs' models land:
docs/performance.md, "The same start on every CPU"). Equal kernels everywhere (one thread, ATen's default CPU
capability, MKL's reproducible mode) would give another model on every CPU, this project's measurements'
included, so they are not used: the shipped model is what makes the start the same.

    python -m runtime.tiny                            # the model --model tiny uses (built if need be): its path
    python -m runtime.tiny OUT_DIR                    # build it into OUT_DIR (a new folder)
    python -m runtime.tiny --task countdown [OUT_DIR] # warm-started on another task's demos (its `demos()`)
"""

import contextlib
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

import tasks
from runtime.errors import ConfigError
from runtime.hub import digest
from tasks.arith import splits as arith_splits

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = [chr(i) for i in range(32, 127)] + ["\n"]  # printable ASCII and newline: enough for GSM8K too
RECIPE_FILE = "tiny_recipe.json"  # the recipe and what the warm start did; a build writes it last
WHOLE = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", RECIPE_FILE)  # a built model
SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny-arith")  # arith's, built as the docstring says
WAIT = 3600  # s a process waits for another's build of the same model (on busy cores a build took 17 minutes)
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


def make_model(out: str | None, hidden=64, layers=2, heads=2, ffn=None, max_len=256, seed=0, tokenizer=None):
    """A randomly initialised tiny Llama and its tokenizer (default: the character-level one), saved to `out`
    unless it is None: (model, tokenizer)."""
    import transformers
    tokenizer = tokenizer or make_tokenizer()
    config = llama_config(tokenizer, hidden, layers, heads, ffn or 3 * hidden, max_len)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if out is not None:
        save(model, tokenizer, out)
    return model, tokenizer


def save(model, tokenizer, out: str):
    """Save the model (config and weights) and its tokenizer to `out`, whole in whichever process saves: transformers
    writes the config and weights only on rank 0 of a torch.distributed group (transformers/distributed/mixin.py:236,
    should_save_on_this_rank; modeling_utils.py:3352), and a build runs on whichever rank takes its lock first."""
    model.should_save_on_this_rank = lambda is_main_process: True  # this model is whole in every process
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def warm_start(model, tokenizer, steps: int, batch: int, lr: float, seed: int, target: float = 1.0,
               check: int = 512, progress=None, task: str | None = None, near: float = 0.1) -> dict:
    """Supervised pass on arith answers, or a task's demos (`task`; the loss covers the answer and EOS only), for
    `steps` steps or until greedy accuracy on `check` training problems (a task's held-out metric) reaches `target`,
    measured every 5 steps, and every step from within `near` of it. `progress(step, accuracy)` after each step."""
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
        if target < 1.0 and (step % 5 == 0 or accuracy >= target - near):  # every step near the target
            accuracy = accuracy_of(model, tokenizer, check)
            if accuracy >= target:
                break
        if progress:
            progress(step, accuracy)
    model.eval()
    return dict(sft_steps_taken=step, sft_check_accuracy=accuracy)


def demo_set(task: str, check: list, seed: int) -> tuple[list, list, object]:
    """A task's warm start: its demos to imitate, `len(check)` of its training problems to check on, and the
    check (its held-out metric, or its reward, of greedy responses)."""
    entry = tasks.get(task)
    demos, (problems, _) = demos_of(task), entry.load(None)
    score = entry.metric or entry.reward

    def accuracy(model, tokenizer, problems):
        longest = max(len(tokenizer(p.answer).input_ids) for p in demos) + 1  # a demo's solution and its end
        texts = greedy_texts(model, tokenizer, [p.prompt for p in problems], longest)
        return sum(score(t, p.answer) for t, p in zip(texts, problems)) / len(problems)
    return demos, random.Random(seed + 1).sample(problems, min(len(check), len(problems))), accuracy


def demos_of(task: str) -> list:
    """The task's demos (its `demos()`), refused in one line (ConfigError) where there is nothing to
    warm-start on: none, or not `Problem(prompt, solution)`s of text, or a `demos()` that fails."""
    from tasks.task import Problem
    try:
        demos = tasks.get(task).demos()
    except Exception as e:
        first = (str(e).splitlines() or [""])[0][:160]
        raise ConfigError(f"--task: {task}'s demos() fails ({type(e).__name__}: {first}); the tiny model is "
                          f"warm-started on them (--model tiny)") from None
    what = "Problem(prompt, solution) with text in both"
    if not isinstance(demos, (list, tuple)):
        raise ConfigError(f"--task: {task}'s demos() returned {type(demos).__name__}, not a list of {what}")
    if not demos:
        raise ConfigError(f"--task: {task}'s demos() returned no demos; the tiny model is warm-started on them "
                          f"(--model tiny): give some, or pass another --model")
    bad = next((i for i, p in enumerate(demos) if not (isinstance(p, Problem) and isinstance(p.prompt, str)
                                                       and isinstance(p.answer, str))), None)
    if bad is not None:
        raise ConfigError(f"--task: {task}'s demos() item {bad} is {demos[bad]!r:.80}, not a {what}")
    return list(demos)


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
    """Exact-match accuracy of greedy answers in one forward pass: greedy decoding writes the answer and EOS
    exactly when the argmax at each of their positions, fed the answer, is its token (one prompt length: arith)."""
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


# a task's own warm start (countdown: tests/test_tiny.py); checked every step only from 0.05 below its target
# (arith's: 0.1): a check (512 generations) costs 2-3 steps; countdown's made 28, not 46, to the same model
TASK_RECIPE = dict(sft_max_steps=3000, sft_target=0.15, sft_near=0.05)


def recipe_for(task: str | None) -> dict:
    """The recipe of the tiny model of `task` (None: arith's, RECIPE as it is)."""
    return RECIPE if task is None else dict(RECIPE, **TASK_RECIPE, task=task)


def build(out: str, recipe: dict = RECIPE, every: float = 5.0) -> str:
    """Build the tiny model into `out`, whole or not at all (a temporary folder beside it, renamed once whole),
    with a line every `every` s: its step and check accuracy. A recipe's `task`: warm-started on its demos."""
    r = recipe
    out = os.path.abspath(out)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}-", dir=os.path.dirname(out))
    t0 = last = time.time()

    def progress(step, accuracy):
        nonlocal last
        if time.time() - last >= every:  # a busy machine takes minutes: show that it moves
            last = time.time()
            left = (last - t0) / step * (r["sft_max_steps"] - step)  # every step left at this pace: a bound
            print(f"  warm start: step {step} (at most {r['sft_max_steps']}), check accuracy {accuracy:.3f} "
                  f"(stops at {r['sft_target']:g}), {last - t0:.0f} s (at most "
                  f"{f'{left / 60:.0f} min' if left >= 120 else f'{left:.0f} s'} more)", flush=True)
    try:
        model, tokenizer = make_model(None, r["hidden"], r["layers"], r["heads"], r["ffn"], r["max_len"], r["seed"])
        done = warm_start(model, tokenizer, r["sft_max_steps"], r["sft_batch"], r["sft_lr"], r["seed"],
                          r["sft_target"], r["sft_check"], progress, r.get("task"), r.get("sft_near", 0.1))
        if r.get("task") is None:  # arith's start for RL: greedy on its 400 held-out problems
            done["heldout_accuracy"] = round(greedy_accuracy(model, tokenizer, arith_splits()[1]), 4)
        save(model, tokenizer, tmp)
        made = made_of(r)
        with open(os.path.join(tmp, RECIPE_FILE), "w") as f:  # written last
            weights = digest(os.path.join(tmp, "model.safetensors"))  # damage of the same size: `damage`
            json.dump(dict(identity=identity(made), **made, **done, weights=weights), f, indent=1)
        os.rename(tmp, out)
    except OSError:  # `out` exists: another process finished the same build first (keep theirs, if whole)
        shutil.rmtree(tmp, ignore_errors=True)
        if damage(out):
            raise
    except BaseException:  # Ctrl-C, an error: no half-built folder left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def damage(path: str) -> str:
    """What keeps the folder at `path` from loading as a built tiny model ('' when nothing does): a file of
    WHOLE missing, or one that does not parse (a build on rank 1 of a process group had none: docs/faults.md)."""
    from safetensors import safe_open
    missing = [name for name in WHOLE if not os.path.isfile(os.path.join(path, name))]
    if missing:
        return f"no {', '.join(missing)}"
    for name in WHOLE:
        try:
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(path, name), "pt"):  # its header, and the data it covers
                    pass
            else:
                json.load(open(os.path.join(path, name)))
        except Exception as e:  # JSONDecodeError, SafetensorError, a read error
            return f"{name} does not parse ({type(e).__name__})"
    recorded = json.load(open(os.path.join(path, RECIPE_FILE))).get("weights")  # (an older build's: none)
    if recorded and digest(os.path.join(path, "model.safetensors")) != recorded:  # damage of the same size
        return "model.safetensors is not the file its build wrote (its SHA-256 differs)"
    return ""


def made_of(recipe: dict) -> dict:
    """What decides the tiny model of `recipe`: the recipe, the tokenizer's characters and, by hash, what the warm
    start reads (arith's training problems; a task's demos and problems): an edited task warm-starts anew."""
    digest = lambda rows: hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]
    task = recipe.get("task")
    made = dict(recipe=recipe, tokens=digest(SPECIALS + CHARS))
    if task is None:
        problems = arith_splits()[0]
    else:
        problems = tasks.get(task).load(None)[0]
        made["demos"] = digest([[p.prompt, p.answer] for p in demos_of(task)])
    made["problems"] = digest([[p.prompt, p.answer] for p in problems])
    return made


def identity(made: dict) -> str:
    """The hash of what decides a tiny model (`made_of`): it names the model's folder in the cache."""
    return hashlib.sha256(json.dumps(made, sort_keys=True).encode()).hexdigest()[:12]


def changes(old: dict, new: dict) -> str:
    """What differs between what decided two tiny models (`made_of`, as recorded in their recipe files), in
    words ('' when nothing)."""
    who = new["recipe"].get("task") or "arith"
    a, b = old["recipe"], new["recipe"]
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    words = [f"the recipe ({', '.join(keys)})"] if keys else []
    for key, what in (("tokens", "the tokenizer's characters"), ("demos", f"{who}'s demos"),
                      ("problems", f"{who}'s training problems")):
        words += [what] if old.get(key) != new.get(key) else []
    return " and ".join(words)


def folder(task: str | None = None) -> str:
    """Where the cached tiny model (of arith, or of `task`) is, built or not: $TBA_CACHE (default
    ~/.cache/tba), in a folder named by the hash of what decides it (`identity`)."""
    root = os.environ.get("TBA_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tba")
    key = identity(made_of(recipe_for(task)))
    return os.path.join(root, f"tiny-{key}" if task is None else f"tiny-{task}-{key}")


def previous(path: str, made: dict) -> tuple[str, str]:
    """The latest whole model of the cache beside `path` made for the same task, and what changed since
    (`changes`); ('', '') where there is none."""
    root, task = os.path.dirname(path), made["recipe"].get("task")
    found = []
    for name in os.listdir(root):
        other = os.path.join(root, name)
        if name.startswith("tiny-") and other != path and os.path.isdir(other) and not damage(other):
            recorded = json.load(open(os.path.join(other, RECIPE_FILE)))
            if isinstance(recorded.get("recipe"), dict) and recorded["recipe"].get("task") == task:
                found.append((os.path.getmtime(other), other, recorded))
    if not found:
        return "", ""
    _, other, recorded = max(found)
    return other, changes(recorded, made)


def shipped() -> str:
    """Why the shipped arith model (SHIPPED) is not the one the code makes ('' when it is): not whole, or made
    of other things (`changes`: RECIPE edited, say) than the code's."""
    why = damage(SHIPPED)
    if why:
        return f"the shipped tiny model {SHIPPED} is incomplete ({why})"
    recorded = json.load(open(os.path.join(SHIPPED, RECIPE_FILE)))
    made = made_of(RECIPE)
    if recorded.get("identity") == identity(made):
        return ""
    return f"{changes(recorded, made) or 'what made it'} changed since the shipped tiny model {SHIPPED} was built"


def cached(task: str | None = None) -> str:
    """The path of the tiny model `--model tiny` uses: arith's shipped one (SHIPPED) where the code makes that
    one, else the cached one (of arith, or of `task`), built on first use and again where not whole (`damage`)."""
    why_not = shipped() if task is None else ""
    if task is None and not why_not:
        return SHIPPED
    path = folder(task)  # a task's demos are refused here, before anything is built
    if not damage(path):
        return path
    try:  # the cache takes the build's lock and folder: else say why a build is needed, and where not
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path + ".lock", "a").close()
    except OSError as e:
        raise ConfigError(f"--model: the tiny model must be built ({why_not or 'none is cached'}), and the "
                          f"cache {os.path.dirname(path)} cannot take it ({e.strerror}): set TBA_CACHE to a "
                          f"writable folder") from None
    with held(path):  # one builder at a time (torchrun's ranks start together)
        why = damage(path)
        if why:
            if os.path.exists(path):
                print(f"the tiny model in {path} is incomplete ({why}): building it again", flush=True)
                shutil.rmtree(path)
            else:
                old, changed = previous(path, made_of(recipe_for(task)))
                print(f"{why_not}: building the tiny model into {path}" if why_not else
                      f"{changed} changed since {old} was built: warm-starting a new tiny model into {path}" if changed
                      else f"building the tiny model{f' for {task}' if task else ''} once into {path}",
                      "(minutes: a line every few seconds, with the time left at most) ...", flush=True)
            remove_stale(path, time.time())
            t0 = time.time()
            build(path, recipe_for(task))
            print(f"built in {time.time() - t0:.0f} s", flush=True)
    return path


@contextlib.contextmanager
def held(path: str, every: float = 30.0):
    """Hold the build lock of the model at `path` (a file beside it). While another process holds it, building
    the same model, say so in one line, again every `every` s, and give up after WAIT s in one line
    (ConfigError). The lock goes with its holder (flock): a lock held is a builder alive."""
    with open(path + ".lock", "w") as lock:
        start, said = time.time(), None
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.time()
                if now - start > WAIT:
                    raise ConfigError(f"--model: another process has been building the tiny model into {path} for "
                                      f"over {WAIT} s (it holds {path}.lock); stop it, or let it finish and start "
                                      f"again") from None
                if said is None:
                    print(f"another process is building the tiny model into {path}: waiting for it (at most "
                          f"{WAIT} s) ...", flush=True)
                    said = now
                elif now - said >= every:
                    print(f"  still waiting for the build of {path}: {now - start:.0f} s", flush=True)
                    said = now
                time.sleep(0.5)
        yield


def remove_stale(path: str, since: float):
    """The temporary folders of builds of `path` that died (killed: no cleanup ran), found by the next builder
    under its lock: made before it took the lock (`since`), so by a builder that no longer holds it."""
    root, prefix = os.path.dirname(path), f".{os.path.basename(path)}-"
    for name in os.listdir(root):
        stale = os.path.join(root, name)
        if name.startswith(prefix) and os.path.isdir(stale) and os.path.getmtime(stale) < since:
            shutil.rmtree(stale, ignore_errors=True)


def main(argv: list[str]):
    """`python -m runtime.tiny [--task NAME] [OUT_DIR]`: the path of the tiny model `--model tiny` uses (of
    arith, or of the task), built or found; or a build into OUT_DIR."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m runtime.tiny", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", help="warm-start on this task's demos (its `demos()`) instead of arith")
    p.add_argument("out", nargs="?", metavar="OUT_DIR", help="build into this folder instead of the cache")
    args = p.parse_args(argv)
    if args.out and os.path.exists(args.out):
        sys.exit(f"runtime.tiny: {args.out} exists: remove it first, or name another folder")
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        sys.exit(f"runtime.tiny: {os.path.dirname(os.path.abspath(args.out))} does not exist: make it first")
    try:  # a broken task file: its line
        if args.task is not None and not (args.task in tasks.TASKS and tasks.get(args.task).demos):
            with_demos = [n for n in tasks.names() if tasks.get(n).demos]
            sys.exit(f"runtime.tiny: --task {args.task}: not a task with demos() (those with: {', '.join(with_demos)})")
        print(build(args.out, recipe_for(args.task)) if args.out else cached(args.task))
    except ConfigError as e:
        sys.exit(f"runtime.tiny: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
