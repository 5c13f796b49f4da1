"""The command line: `parse` builds tba.Config from it, and `check` refuses bad input in one line naming the flag
(ConfigError; tba.py exits with status 2) and computes the derived values, once, before anything is spawned or
written. It returns a new Config with them filled in; Config is frozen, so nothing writes to it after the checks."""

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import sys
import time
import typing

import numpy as np
import torch

import tasks
from buffer import FIELDS, SCALARS
from loss import LOSSES, loss_options, reads
from runtime import lora, nodes, ranks, vllm_env
from runtime.checkpoint import check_model, check_resumed_flags, load_checkpoint, read_config, resumed_flags
from runtime.config import Config
from runtime.errors import ConfigError
from runtime.hub import load_tokenizer, resolve_model
from runtime.log import Log, check_out
from rewards import check_reward_model
from tasks.task import Data

MAX_REUSE = 1.0  # --max-reuse's default with searchers (docs/performance.md, part 9)


def parse(config_class, argv, description: str = ""):
    """The Config of a command line: one flag per field that is not derived, its help the field's; `given` says which
    flags the line gave (a task's defaults fill in the others: check)."""
    names = {f.name for f in dataclasses.fields(config_class)}
    flags = [token[2:].split("=")[0].replace("-", "_") for token in argv if token.startswith("--")]
    given = {name[3:] if name.startswith("no_") and name[3:] in names else name for name in flags}
    return config_class(**vars(parser(config_class, description).parse_args(argv)), given=tuple(sorted(given & names)))


def parser(config_class, description: str = "") -> argparse.ArgumentParser:
    """The command line's parser: one flag per field of `config_class` that is not derived. No abbreviations (a
    prefix of a flag is not that flag: a run script's checks of the flags it sets would miss one)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.error = lambda message: p.exit(2, f"tba.py: error: {message} (--help lists the flags)\n")  # no usage
    listings = {"{tasks}": ", ".join(tasks.TASKS), "{losses}": ", ".join(LOSSES)}  # by file: no task imported
    group = p
    for f in dataclasses.fields(config_class):
        if f.metadata.get("derived"):
            continue
        if f.name in getattr(config_class, "SECTIONS", {}):  # --help's groups
            group = p.add_argument_group(config_class.SECTIONS[f.name])
        name, help = "--" + f.name.replace("_", "-"), f.metadata["help"]
        for key, value in listings.items():
            help = help.replace(key, value)
        help += "" if "default:" in help else f" (default: {f.default})"  # said once (a help may give it itself)
        if f.type is bool or f.type == bool | None:  # None: decided by the checks
            group.add_argument(name, action=argparse.BooleanOptionalAction, default=f.default, help=help)
            continue
        kind = next(t for t in (int, float, str) if f.type is t or t in typing.get_args(f.type))
        group.add_argument(name, type=kind, default=f.default, help=help)
    return p


def need(ok, flag: str, msg: str):
    """Refuse in one line naming the flag unless `ok`."""
    if not ok:
        raise ConfigError(f"--{flag}: {msg}")


def given(cfg, flag: str) -> bool:
    """Whether the command line gave `flag` (a Config made in code, with no `given`: whether it differs from the
    default)."""
    if cfg.given is not None:
        return flag in cfg.given
    return getattr(cfg, flag) != next(f.default for f in dataclasses.fields(cfg) if f.name == flag)


KINDS = {int: "a whole number", float: "a number", str: "a string", bool: "true or false", type(None): "None"}


def task_defaults(cfg):
    """The task's own defaults (tasks/task.py: `defaults`) for the flags the command line did not give, each a flag
    (not a derived value) and of its type, else refused in one line naming the task. Returns (the Config, the flags
    they filled in: a refusal of one of them says it came from the task, `check`)."""
    if cfg.task not in tasks.TASKS:
        return cfg, ()  # refused below
    flags = {f.name: f.type for f in dataclasses.fields(cfg) if not f.metadata.get("derived")}
    filled = {}
    for key, value in tasks.get(cfg.task).defaults.items():
        need(key in flags, "task", f"{cfg.task}'s defaults name {key!r}, which is not a flag (tba.py --help lists "
             f"them, with - for _)")
        kinds = typing.get_args(flags[key]) or (flags[key],)
        number = float in kinds and isinstance(value, int) and not isinstance(value, bool)  # 1 for 1.0, as argparse
        need(number or any(type(value) is k for k in kinds), key.replace("_", "-"), f"must be "
             f"{' or '.join(KINDS[k] for k in kinds)}, got {value!r} (task {cfg.task}'s default)")
        if not given(cfg, key):
            filled[key] = float(value) if number else value
    return dataclasses.replace(cfg, **filled), tuple(filled)


def check(cfg, world: int):
    """Validate flags and data; compute the derived values. Returns (a new Config, Data, checkpoint or None). A
    resumed run goes on with its checkpoint's flags but for those given now; a refusal of a value that the task's
    defaults gave (not the command line) says so."""
    saved = read_config(cfg.resume, needed=False) if cfg.resume else None
    if saved is not None:
        cfg = resumed(cfg, saved)
        was = saved.get("task", cfg.task)  # before its data and model (--model tiny is each task's own)
        need(was == cfg.task, "resume", f"--task {cfg.task} (was {was}) cannot change mid-run (the checkpoint's buffer "
             f"holds {was}'s problems, searched and scored by its reward)")
    cfg, filled = task_defaults(cfg)
    try:
        return check_flags(cfg, world)
    except ConfigError as e:
        if str(e).split(":")[0].removeprefix("--").replace("-", "_") not in filled:
            raise
        raise ConfigError(f"{e} (task {cfg.task}'s default)") from None


def check_flags(cfg, world: int):
    """`check` after the checkpoint's flags and the task's defaults."""
    for f in dataclasses.fields(cfg):  # an empty path or name (an unset shell variable) is no value: never "not given"
        value, flag, choices = getattr(cfg, f.name), f.name.replace("_", "-"), f.metadata.get("choices")
        need(f.metadata.get("derived") or value != "", flag, "empty (an unset shell variable?): give a value, or "
             "leave the flag out")
        need(not choices or value in choices, flag, f"unknown {value!r} (choose from {', '.join(choices or ())})")
        # argparse reads 'inf' and 'nan' as floats: no flag means either
        need(not isinstance(value, float) or math.isfinite(value), flag, f"must be a finite number, got {value}")
    # every consumer of the seed takes it: numpy's seeds (vLLM's engine seeds random, numpy and torch with it,
    # vllm/utils/torch_utils.py:548-550, from cpu_worker.py:165 and gpu_worker.py:522), SeedSequence lists, torch
    need(0 <= cfg.seed < 2**32, "seed", f"must be in [0, 2**32 - 1] (numpy's and vLLM's seeds), got {cfg.seed}")
    given = cfg  # the flags as given, before the defaults that depend on others fill in
    need(0 <= cfg.recency <= 1, "recency", f"must be in [0, 1], got {cfg.recency}")
    need(cfg.samples_per_prompt >= 2, "samples-per-prompt", f"K must be at least 2 (log Z is a mean over K), got {cfg.samples_per_prompt}")
    if cfg.search_samples_per_prompt is None:  # not given: K (an explicit 0 is refused below, not taken as K)
        cfg = dataclasses.replace(cfg, search_samples_per_prompt=cfg.samples_per_prompt)
    need(cfg.search_samples_per_prompt >= cfg.samples_per_prompt, "search-samples-per-prompt",
         f"must be at least K = {cfg.samples_per_prompt}, got {cfg.search_samples_per_prompt}")
    need(cfg.sync_every >= 1, "sync-every", f"k must be at least 1, got {cfg.sync_every}")
    need(cfg.prompts_per_step >= 1 and cfg.prompts_per_step % world == 0, "prompts-per-step",
         f"must be a positive multiple of the {world} trainer rank(s), got {cfg.prompts_per_step}")
    for flag in ("steps", "max_new_tokens", "buffer_capacity", "micro_batch", "log_every"):
        need(getattr(cfg, flag) >= 1, flag.replace("_", "-"), "must be at least 1")
    for flag in ("searchers", "eval_every", "save_every", "beta_stop_step", "warmup_steps", "decay_steps",
                 "beta_anneal_steps", "initial_buffer", "ref_reset_every", "reward_temp_anneal_steps",
                 "gamma_anneal_steps"):
        need(getattr(cfg, flag) >= 0, flag.replace("_", "-"), "must be 0 or more")
    need(cfg.searchers > 0 or world == 1, "searchers", f"0 (the trainer searching itself) runs in one trainer process; "
         f"got {world} (vLLM cannot share a multi-process group)")
    need(cfg.evaluator == "searcher" or world == 1, "evaluator", f"after runs an engine in the trainer's process, "
         f"which needs one trainer rank, got {world} (vLLM cannot share a multi-process group)")
    need(cfg.beta >= 1e-15, "beta", f"must be at least 1e-15 (r / beta squared overflows), got {cfg.beta}")
    cfg = dataclasses.replace(cfg, beta_final=cfg.beta if cfg.beta_final is None else cfg.beta_final)
    need(cfg.beta_final >= 1e-15, "beta-final", f"must be at least 1e-15, got {cfg.beta_final}")
    need(cfg.lr > 0, "lr", "must be positive")
    need(cfg.temperature > 0, "temperature", "must be positive (the evaluation has its own: --eval-temperature)")
    need(cfg.context >= 0, "context", f"must be 0 (no limit but --max-new-tokens) or more, got {cfg.context}")
    need(cfg.grad_clip >= 0, "grad-clip", "must be 0 (no clipping) or more")
    need(cfg.eval_limit is None or cfg.eval_limit >= 1, "eval-limit", "must be at least 1")
    for flag in ("timeout", "start_timeout"):  # torch.distributed's own timeouts overflow far above (1e13 s)
        value = getattr(cfg, flag)
        need(0 < value <= 1e6, flag.replace("_", "-"), f"must be in (0, 1e6] s, got {value}")
    for flag in ("searcher_memory", "trainer_memory"):
        need(getattr(cfg, flag) is None or 0 < getattr(cfg, flag) < 1, flag.replace("_", "-"),
             f"must be a fraction in (0, 1), got {getattr(cfg, flag)}")
    for flag in ("generation_slowdown", "train_slowdown"):
        need(getattr(cfg, flag) >= 1, flag.replace("_", "-"), f"must be 1 (off) or more, got {getattr(cfg, flag)}")
    if cfg.calibration:
        from runtime import slowdown
        colocated = slowdown.read_calibration(cfg.calibration)["devices"] > 1  # refused in one line if it is not one
        need(not colocated or not cfg.searchers, "calibration", f"{cfg.calibration} holds a colocated run's devices "
             f"(generation and training split over them): with --searchers 0 only")
    need(cfg.max_staleness >= 0, "max-staleness", "must be 0 (no bound) or more")
    need(cfg.max_reuse is None or cfg.max_reuse >= 0, "max-reuse", f"must be 0 (no cap) or more, got {cfg.max_reuse}")
    cfg = dataclasses.replace(cfg, max_reuse=(MAX_REUSE if cfg.searchers and cfg.lag is None else 0.0)
                              if cfg.max_reuse is None else cfg.max_reuse)
    need(cfg.round_prompts is None or cfg.round_prompts >= 1, "round-prompts", f"must be at least 1, got {cfg.round_prompts}")
    need(cfg.round_prompts is None or cfg.searchers, "round-prompts", "sizes a searcher's round; with --searchers 0 "
         "the trainer searches B prompts before each step")
    # N searchers' rounds of B / N prompts together make one batch: its data comes from weights about as
    # fresh whatever N (rounds of B each, 4 searchers fed steps from data 5-7 steps stale: docs/performance.md)
    every = cfg.searchers * nodes.layout(world)[0]
    if cfg.searchers and cfg.round_prompts is None:  # synchronous: none (the trainer searches B prompts a step)
        cfg = dataclasses.replace(cfg, round_prompts=-(-cfg.prompts_per_step // every))
    check_recipe(cfg)
    vllm_env.check()
    check_lag(cfg, every or 1)
    need(cfg.loss in LOSSES, "loss", f"unknown loss {cfg.loss!r} (choose from {', '.join(LOSSES)})")
    flags = getattr(LOSSES[cfg.loss], "flags", ())
    need(flags_of(cfg.loss) == flags, "loss", f"{cfg.loss}'s flags must be a tuple of Config fields' names "
         f"(loss.py), got {flags!r}")
    cfg = dataclasses.replace(cfg, loss_pools=loss_pools(cfg))
    need(not (cfg.loss_pools and cfg.behaviour_logprobs == "trainer" and world > 1), "behaviour-logprobs", f"trainer "
         f"rescores each trainer rank's share of the batch, and --loss {cfg.loss} pools across the whole batch: on "
         f"{world} ranks it would read vLLM's log-probs for the others' shares (use one rank, or vllm)")
    need(0 < cfg.clip < 1, "clip", f"must be in (0, 1), got {cfg.clip}")
    need(cfg.is_cap >= 1, "is-cap", f"truncates an importance ratio: at least 1, got {cfg.is_cap}")
    try:
        betas = tuple(float(b) for b in cfg.adam_betas.split(","))
    except ValueError:
        betas = ()
    need(len(betas) == 2 and all(0 <= b < 1 for b in betas), "adam-betas", f"two numbers in [0, 1), beta1,beta2: "
         f"got {cfg.adam_betas!r}")
    need(cfg.eval_temperature >= 0, "eval-temperature", "must be 0 (greedy) or more")
    check_unused(cfg, given)
    need(not cfg.wandb or importlib.util.find_spec("wandb"), "wandb", "the wandb package is not installed (it is "
         "optional: pip install wandb)")
    ckpt = load_checkpoint(cfg.resume) if cfg.resume else None
    if ckpt:  # fewer steps would wait --timeout for an evaluation of weights that never come; as many: only the end
        done = ckpt["step"]  # (the final evaluation and final/), if a stop cut it short
        finished = os.path.isdir(os.path.join(os.path.dirname(os.path.realpath(cfg.resume)), "final"))
        need(cfg.steps > done or (cfg.steps == done and not finished), "steps", f"{cfg.steps} "
             f"{'is below' if cfg.steps < done else 'is'} the checkpoint's step {done}: "
             f"{'the run is finished (its final/ is written)' if cfg.steps == done else 'a resumed run cannot go back'}"
             f"; pass --steps above {done} to continue")
        check_resumable(cfg, ckpt)
    # devices: trainer rank r on GPU r, searcher i on GPU (ranks + i)
    device = ranks.machine_device()
    local = nodes.layout(world)[1]  # trainer ranks on this node (all of them on one node)
    if device == "cuda":
        from runtime import gpu  # the GPU checks
        cfg = dataclasses.replace(cfg, dtype=gpu.check_gpus(cfg, local))
    need(device == "cuda" or cfg.dtype in ("auto", "float32"), "dtype",
         f"{cfg.dtype} on the CPU is not supported here (vLLM's CPU engine and the log-prob checks run in float32)")
    cores = len(os.sched_getaffinity(0))
    cfg = dataclasses.replace(cfg, device=device, dtype="float32" if cfg.dtype == "auto" else cfg.dtype,
                              threads=max(1, cores // (local + cfg.searchers)))  # CPU: the cores split evenly
    cfg, task, data, train = check_task(cfg)
    if device == "cuda":
        flag = "searcher_memory" if cfg.searchers else "trainer_memory"
        cfg = dataclasses.replace(cfg, **{flag: gpu.check_memory(cfg, task, local)})
    cfg = dataclasses.replace(cfg, out=cfg.out or (
        run_of(cfg.resume) if cfg.resume  # the checkpoint's run (runtime.log.check_out)
        else os.path.join("runs", time.strftime("%Y%m%d-%H%M%S") + f"-{cfg.task}-s{cfg.searchers}")))
    if int(os.environ.get("RANK", "0")) == 0:  # rank 0 writes the run's files; the others, looking, could
        check_out(cfg.out, cfg.resume)            # see its probe file
    if cfg.resume:
        saved = read_config(cfg.resume)
        changed = check_resumed_flags(cfg, cfg.resume, same_weights=check_model(cfg, ckpt, cfg.resume))
        cfg = dataclasses.replace(cfg, resumes=(*saved.get("resumes", ()), dict(step=ckpt["step"], changed=changed)))
        n, digest = ckpt.get("problems", (0, data.digest(0)))  # (saved before checkpoints kept it: none)
        need(data.digest(n) == digest, "resume", f"the {cfg.task} task's training problems are not those the "
             f"checkpoint's run searched (edited since?): its buffer's prompt ids would index other prompts")
        buffer = task.buffer(cfg, data.prompts)  # its kind, which the checkpoint's buffer must be
        try:
            dropped, ckpt["buffer"] = ckpt["buffer"].get("dropped", "[]"), type(buffer).from_state(ckpt["buffer"])
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"--resume: {cfg.resume} does not parse as a checkpoint (buffer.npz: {e})") from None
        if json.loads(str(dropped)) and int(os.environ.get("RANK", "0")) == 0:  # said at its save too
            print(f"tba.py: note: {cfg.resume}'s buffer left out {', '.join(json.loads(str(dropped)))}: they start "
                  f"afresh (each as the buffer makes it)", flush=True)
    return cfg, data, ckpt


def resumed(cfg, saved: dict):
    """--resume: the flags not given are the checkpoint's (runtime.checkpoint.resumed_flags), but for one that cannot
    act beside the flags given now (acts_only: a streaming run's --max-reuse, resumed with --lag), which is left to its
    default: refused, it would be a flag the command line never gave."""
    out = resumed_flags(cfg, saved)
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    inert = {flag: defaults[flag] for flag, acts, _ in acts_only() if not given(cfg, flag) and not acts(out)}
    return dataclasses.replace(out, **inert, given=tuple(n for n in out.given if n not in inert))


def run_of(checkpoint: str) -> str:
    """The run folder of a checkpoint (the parent of its real path: OUT/checkpoint links to OUT/checkpoint-STEP), named
    as --resume names it where that is the same folder (runs/x/checkpoint: runs/x, as a fresh run's --out is said)."""
    real = os.path.dirname(os.path.realpath(checkpoint))
    given = os.path.dirname(os.path.normpath(checkpoint)) or "."
    return given if os.path.realpath(given) == real else real


def loss_pools(cfg) -> bool:
    """Whether --loss gets the whole batch in every pass of the gradient (tba.backward): it says so
    (`pools = True`), or `probe_pools` finds it pools (docs/experiments.md, "B is the whole batch"); one
    that fails on the probe's batch is refused in one line."""
    loss, declared = LOSSES[cfg.loss], getattr(LOSSES[cfg.loss], "pools", None)
    try:
        found = probe_pools(loss, loss_options(cfg, cfg.beta, 1.0, cfg.reward_temp))  # gamma_at, reward_temp_at at 0
    except ConfigError as e:  # a statistic named like a row field
        raise ConfigError(f"--loss: {cfg.loss}'s {e}") from None
    except Exception as e:
        raise ConfigError(f"--loss: {cfg.loss} fails on the start-up check's batch ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200] if str(e) else ''}); see docs/experiments.md for what a loss "
                          f"receives") from None
    if declared is not None and bool(declared) != found and int(os.environ.get("RANK", "0")) == 0:
        print(f"tba.py: --loss {cfg.loss} says pools = {declared}, and the start-up probe finds that it "
              f"{'pools across prompts' if found else 'does not pool'}: it gets the whole batch in every pass",
              flush=True)
    return bool(declared) or found


def probe_pools(loss, options: dict, K: int = 3, T: int = 5) -> bool:
    """Whether `loss` pools across prompts: on 4 prompts, its value or gradient differs from the sum of its
    values on parts (1 prompt and 3; each alone), each x its prompts. The batch is made as a run makes one,
    from buffer.Trajectory's number fields: integers where they are, `reward` 0/1 (a prompt all 0, one all 1)
    and `truncated` 0/1 (a cut response T long), another count of ones in each prompt, so that a mean over
    the batch's uncut responses (DAPO's overlong filter) is found."""
    g = torch.Generator().manual_seed(0)
    B, per_token, kind = 4, getattr(loss, "per_token", False), {f.name: f.type for f in FIELDS}
    rand = lambda *shape: torch.rand(*shape, generator=g, dtype=torch.float64)
    ones = lambda *counts: (torch.arange(K) < torch.tensor(counts)[:, None]).double()  # (B, K): counts[b] in prompt b
    x = {name: torch.randint(0, 5, (B, K), generator=g).double() if kind[name] is int else -5 * rand(B, K)
         for name in SCALARS}                                                            # (B, K) each
    truncated = ones(0, 1, 2, 0)                                                         # (B, K)
    length = torch.where(truncated > 0, T, torch.randint(1, T, (B, K), generator=g)).double()  # (B, K)
    mask = (torch.arange(T) < length[..., None]).double()                               # (B, K, T)
    x.update(prompt_id=7.0 * torch.arange(B)[:, None].expand(B, K), pi_ref_version=torch.zeros(B, K),
             for_step=-torch.ones(B, K), reward=ones(0, 1, 2, 3),
             truncated=truncated, length=length,
             prompt_length=torch.randint(3, 30, (B, 1), generator=g).double().expand(B, K))
    if per_token:
        x.update(token_mask=mask, behaviour_logps=-rand(B, K, T) * mask, ref_logps=-rand(B, K, T) * mask)
        x.update(logp_behaviour=x["behaviour_logps"].sum(-1), logp_ref=x["ref_logps"].sum(-1))
    leaf = (-rand(B, K, T) * mask if per_token else -5 * rand(B, K)).requires_grad_()

    def run(rows):  # the loss on prompts `rows`, x their number
        y = leaf[rows]
        value, stats = loss(logp=y.sum(-1) if per_token else y, **({"token_logp": y} if per_token else {}),
                            **{k: v[rows] for k, v in x.items()}, **options)
        taken = [k for k in stats if k in ("loss", "prompts", *Log.FIELDS)]
        if taken:
            raise ConfigError(f"statistic {', '.join(taken)} is named like a field the train rows hold already, "
                              f"whose value it would replace: rename it")
        return value * len(rows)
    whole = run(list(range(B)))
    if not torch.isfinite(whole):
        raise ValueError(f"its loss on it is {whole.item()}")
    grad_whole, = torch.autograd.grad(whole, leaf)
    for parts in (([0], [1, 2, 3]), ([0], [1], [2], [3])):
        split = sum(run(rows) for rows in parts)
        grad_split, = torch.autograd.grad(split, leaf)
        if not (torch.allclose(whole, split, rtol=1e-9, atol=1e-12)
                and torch.allclose(grad_whole, grad_split, rtol=1e-9, atol=1e-12)):
            return True
    return False


def check_resumable(cfg, ckpt: dict):
    """A checkpoint's run goes on only where it holds what the flags need: with --lag L the weights of the L steps
    before its step (its rounds are sampled by them), and for the loss its buffer's fields (a buffer made for TB
    holds no per-token log-probs of pi_ref)."""
    step, kept = ckpt["step"], {int(v) for v in ckpt.get("history", {})} | {ckpt["step"]}
    missing = sorted({max(0, r - cfg.lag) for r in range(step, step + cfg.lag)} - kept) if cfg.lag is not None else []
    span = lambda a, b: f"step {a}" if a == b else f"steps {a}-{b}"
    have = f"those of {span(min(kept), max(kept))}" if len(kept) > 1 else "none of them"
    most = step - min(kept)
    need(not missing, "lag", f"{cfg.lag} samples the rounds after step {step} with the weights of "
         f"{span(missing[0] if missing else 0, step - 1)}, and the checkpoint keeps {have}: resume with --lag "
         f"{most}{' or less' if most else ''}")
    arrays, loss = ckpt["buffer"], LOSSES.get(cfg.loss)
    absent = [f for f in (reads(loss) if loss else ()) if len(arrays["length"]) and
              (f not in arrays or not np.isfinite(arrays[f]).all())]
    need(not absent, "loss", f"{cfg.loss} reads {', '.join(absent)}, which the checkpoint's buffer does not hold (its "
         f"trajectories were made for another loss): resume with that loss, or start a new run")


def check_lag(cfg, searchers: int):
    """--lag L (every batch sampled by the weights of exactly L steps before)."""
    need(cfg.lag is None or cfg.lag >= 0, "lag", f"must be 0 (synchronous) or more, got {cfg.lag}")
    need(cfg.behaviour_logprobs == "vllm" or not cfg.lora_rank, "behaviour-logprobs", "trainer keeps a copy of all the "
         "weights; with --lora-rank the adapter's are not kept: leave it at vllm")
    if cfg.lag is None:
        return
    need(cfg.sync_every == 1, "sync-every", f"--lag publishes every step's weights (k = 1), got {cfg.sync_every}")
    need(cfg.initial_buffer == 0, "initial-buffer", "with --lag each step waits for its own rounds")
    rounds = searchers * cfg.round_prompts if cfg.searchers else cfg.prompts_per_step
    need(rounds >= cfg.prompts_per_step, "round-prompts", f"{searchers} searcher(s) x {cfg.round_prompts} prompts a "
         f"round cannot make a batch of B = {cfg.prompts_per_step} prompts")


def check_recipe(cfg):
    """The buffer's keeping, LoRA, weight decay, the reward's temperatures and the exploration's."""
    for flag in ("dedup_similarity", "dedup_edit"):
        value, name = getattr(cfg, flag), flag.replace("_", "-")
        need(0 <= value <= 1, name, f"must be in [0, 1], got {value}")
        need(value == 0 or cfg.buffer_keep == "best", name, "merges near-duplicates in the best buffer: pass "
             "--buffer-keep best")
    need(cfg.dedup_similarity == 0 or cfg.embedding_model, "dedup-similarity", "compares --embedding-model "
         "embeddings (--dedup-edit compares tokens)")
    need(cfg.lora_rank >= 0, "lora-rank", f"must be 0 (all weights) or more, got {cfg.lora_rank}")
    need(cfg.lora_alpha > 0, "lora-alpha", f"must be positive, got {cfg.lora_alpha}")
    need(not cfg.lora_rank or importlib.util.find_spec("peft"), "lora-rank", "the peft package is not installed (pip "
         "install peft)")
    need(cfg.weight_decay >= 0, "weight-decay", f"must be 0 or more, got {cfg.weight_decay}")
    need(cfg.reward_temp > 0, "reward-temp", f"must be positive, got {cfg.reward_temp}")
    need(cfg.gamma_final > 0, "gamma-final", f"must be positive, got {cfg.gamma_final}")
    low, high = cfg.explore_temp_min, cfg.explore_temp_max
    need(low == high == 0 or 0 < low <= high, "explore-temp-min", f"the exploration temperatures need 0 < "
         f"--explore-temp-min <= --explore-temp-max (both 0 = off), got {low} and {high}")


def flags_of(loss: str) -> tuple:
    """The Config fields loss `loss` reads by name (its `flags`); () where they are not a tuple of fields'
    names (the run's own loss is then refused: check_flags)."""
    flags, fields = getattr(LOSSES.get(loss), "flags", ()), {f.name for f in dataclasses.fields(Config)}
    return flags if isinstance(flags, tuple) and all(f in fields for f in flags) else ()


def acts_only() -> list:
    """(flag, where it acts, its words) of each flag that acts only in some runs (check_unused refuses one
    given elsewhere): its field's `acts` (runtime/config.py), a loss's knob (`arg(..., loss=True)`) with a
    loss whose `flags` do not name it, an anneal of T_R or gamma with a loss that reads neither."""
    declared = [(f.name, *f.metadata["acts"]) for f in dataclasses.fields(Config) if "acts" in f.metadata]
    return declared + [
        ("reward_temp_anneal_steps", lambda c: "reward_temp" in flags_of(c.loss), "a --loss reading --reward-temp"),
        ("gamma_anneal_steps", lambda c: "gamma_final" in flags_of(c.loss), "a --loss reading --gamma-final")] + [
        (f.name, lambda c, flag=f.name: flag in flags_of(c.loss),
         "--loss " + " or ".join(name for name in LOSSES if f.name in flags_of(name)))
        for f in dataclasses.fields(Config) if f.metadata.get("loss")]


def check_unused(cfg, given=None):
    """Flags that would change nothing, or make another flag change nothing, refused in one line: one given
    where it cannot act (acts_only: `given`'s values against `cfg`'s settings), a schedule's length without
    its end value, its end without its length, LoRA's alpha without LoRA."""
    defaults, given = {f.name: f.default for f in dataclasses.fields(cfg)}, given or cfg
    for flag, acts, where in acts_only():
        need(getattr(given, flag) == defaults[flag] or acts(cfg), flag.replace("_", "-"),
             f"acts only in {where}; here it would change nothing")
    final = cfg.beta if cfg.beta_final is None else cfg.beta_final  # None: --beta (check fills it in)
    moves = final != cfg.beta
    need(not cfg.beta_anneal_steps or moves, "beta-anneal-steps", f"anneals beta from --beta to --beta-final, which "
         f"is --beta ({cfg.beta:g}) here: pass a --beta-final")
    need(not cfg.beta_stop_step or moves, "beta-stop-step", f"sets beta to --beta-final, which is --beta ({cfg.beta:g}) "
         f"here: pass a --beta-final")
    need(not moves or cfg.beta_anneal_steps or cfg.beta_stop_step, "beta-final", f"without --beta-anneal-steps or "
         f"--beta-stop-step beta would be {final:g} from step 0 and --beta {cfg.beta:g} unused: pass one "
         f"of them, or --beta alone")
    need(not cfg.reward_temp_anneal_steps or cfg.reward_temp != 1, "reward-temp-anneal-steps", "anneals T_R from "
         "--reward-temp to 1, and --reward-temp is 1: pass a --reward-temp")
    need(not cfg.gamma_anneal_steps or cfg.gamma_final != 1, "gamma-anneal-steps", "anneals gamma from 1 to "
         "--gamma-final, and --gamma-final is 1: pass a --gamma-final")
    need(cfg.lora_rank or cfg.lora_alpha == defaults["lora_alpha"], "lora-alpha", "scales a LoRA adapter: pass "
         "--lora-rank too")


def encode(tokenizer, prompt: str, chat: bool) -> list[int]:
    """A prompt's token ids: as it is, or as the user's turn of the chat template with the assistant's begun (the
    template writes its own special tokens: none are added again)."""
    if not chat:
        return tokenizer(prompt).input_ids
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def check_task(cfg):
    """The task's flags (its entry of tasks.TASKS), data, model and tokenizer (and reward models), and the
    values they derive: the models' folders, the evaluation's headline score and the longest sequence.
    Returns (the Config with them, the Task, Data, the training problems)."""
    from transformers import AutoConfig

    need(cfg.task in tasks.TASKS, "task", f"unknown task {cfg.task!r} (choose from {', '.join(tasks.TASKS)})")
    task = tasks.get(cfg.task)
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    fields = list(defaults)  # other task files are imported only for a flag of Config's tasks section set
    # that this task does not own (another task's?): a file that waits at its top (a download) holds every run
    asked = [f for f in fields[fields.index("model"):fields.index("searchers")]
             if getattr(cfg, f) != defaults[f] and f not in task.flags]
    for name in tasks.names() if asked else ():  # those that load (a broken file's flags cannot be known)
        for flag in set(tasks.get(name).flags) & set(asked):
            need(name == cfg.task, flag.replace("_", "-"), f"belongs to the {name} task")
    cfg = dataclasses.replace(cfg, **task.check(cfg))
    train, test = task.load(cfg.data)
    train, test = ([dataclasses.replace(p, prompt=task.prompt(cfg, p.prompt)) for p in part] for part in (train, test))
    need(test, "task", f"{cfg.task}'s held-out split is empty (its load() gave no held-out problems): the "
         f"evaluations need one at least")
    test = test[: cfg.eval_limit] if cfg.eval_limit else test
    train = train * -(-cfg.prompts_per_step // len(train)) if task.fill else train
    if cfg.model == "tiny":  # warm-started on the task's demos where it has some, else on arith
        from runtime import tiny
        model_path = tiny.cached(cfg.task if task.demos else None)
    else:
        model_path = resolve_model(cfg.model)
    if cfg.lora_rank:
        lora.check_rank(model_path, cfg.lora_rank)
    tokenizer = load_tokenizer(model_path)
    need(tokenizer.eos_token_id is not None, "model", f"the tokenizer of {model_path} has no EOS token")
    paths = {f"{flag}_path": check_reward_model(getattr(cfg, flag), flag.replace("_", "-"))
             for flag in ("reward_model", "eval_reward_model") if getattr(cfg, flag)}
    cfg = dataclasses.replace(cfg, model_path=model_path, score=task.score, **paths)
    cfg = dataclasses.replace(cfg, eval_reward_model_path=cfg.eval_reward_model_path or cfg.reward_model_path)
    need(not task.chat or tokenizer.chat_template, "model", f"the {cfg.task} task's prompts are chat turns, and the "
         f"tokenizer of {model_path} has no chat template")
    unk = tokenizer.unk_token_id  # a tokenizer without byte fallback (the tiny one): a character it lacks
    if unk is not None:
        chars = set("".join(p.prompt for p in train + test))  # (an answer is the reward's to read, not the model's)
        lacking = sorted(c for c in chars if unk in tokenizer(c, add_special_tokens=False).input_ids)
        if lacking and int(os.environ.get("RANK", "0")) == 0:  # said, not refused: a model may do without them
            print(f"tba.py: warning: --task: {cfg.task}'s prompts use characters that the tokenizer of {model_path} "
                  f"lacks ({' '.join(map(repr, lacking[:10]))}): the model reads each as {tokenizer.unk_token}; "
                  f"write them with characters it has, or pass another --model", file=sys.stderr, flush=True)
    prompts = [encode(tokenizer, p.prompt, task.chat) for p in train]
    test_prompts = [encode(tokenizer, p.prompt, task.chat) for p in test]
    if task.max_prompt:
        short = lambda ids: [i for i in range(len(ids)) if len(ids[i]) <= task.max_prompt]
        keep, keep_test = short(prompts), short(test_prompts)
        train, prompts = [train[i] for i in keep], [prompts[i] for i in keep]
        test, test_prompts = [test[i] for i in keep_test], [test_prompts[i] for i in keep_test]
        need(train and test, "data", f"no {cfg.task} prompt of at most {task.max_prompt} tokens in the training "
             f"or held-out data")
    need(cfg.prompts_per_step <= len(train), "prompts-per-step", f"B = {cfg.prompts_per_step} distinct prompts a step, "
         f"but the task has {len(train)} training problems")
    need(cfg.initial_buffer <= cfg.buffer_capacity * len(train), "initial-buffer",
         f"{cfg.initial_buffer} trajectories can never be held: the buffer keeps at most --buffer-capacity "
         f"{cfg.buffer_capacity} x {len(train)} problems")
    longest = max(len(p) for p in prompts + test_prompts)
    need(not cfg.context or longest < cfg.context, "context", f"{cfg.context} tokens leave no room for a response "
         f"to the longest prompt's {longest} tokens")
    model_config = AutoConfig.from_pretrained(model_path)
    context = getattr(model_config, "max_position_embeddings", None)
    longest_sequence = min(longest + cfg.max_new_tokens, cfg.context or math.inf)
    need(cfg.score_batch is None or cfg.score_batch >= 1, "score-batch", f"must be at least 1, got {cfg.score_batch}")
    if cfg.score_batch is None:  # the longest sequences' logits in the run's dtype: 2 GiB at most, 256 sequences
        logits = longest_sequence * model_config.get_text_config().vocab_size * (4 if cfg.dtype == "float32" else 2)
        cfg = dataclasses.replace(cfg, score_batch=int(min(256, max(1, 2**31 // logits))))
    cfg = dataclasses.replace(cfg, max_model_len=longest_sequence)
    if context:
        need(longest_sequence <= context, "context" if longest_sequence == cfg.context else "max-new-tokens",
             f"{cfg.max_new_tokens} new tokens + the longest prompt's {longest} tokens"
             f"{f' (at most --context {cfg.context})' if cfg.context else ''} = {longest_sequence} exceeds the "
             f"model's context of {context} tokens")
    data = Data(prompts, [p.answer for p in train], test_prompts, [p.answer for p in test])
    return cfg, task, data, train
