"""TBA: Trajectory Balance with Asynchrony (Bartoldson et al., NeurIPS 2025), on one machine.

Searcher processes generate responses with vLLM and a local copy of the policy, score them and
push them to the trainer without ever waiting for it (searcher.py). The trainer keeps learning
from a replay buffer of everything searched so far (buffer.py) with the trajectory balance
objective (loss.py), which stays valid for off-policy data, and every `--sync-every` steps its
weights go to the searchers through shared tensors. This file holds the config, the process
layout and the trainer loop.

    torchrun --nproc_per_node=1 tba.py                  # the toy task on a laptop: a few minutes
    torchrun --nproc_per_node=1 tba.py --searchers 0    # the synchronous baseline, same code
    python tba.py --help                                # every flag
    bash run_gsm8k.sh                                   # the paper's GSM8K run on a 4-GPU node

Layout: torchrun starts the trainer ranks, which train one model with FSDP2 (`fully_shard`).
Rank 0 holds the replay buffer, samples each batch and broadcasts it, and spawns `--searchers`
searcher processes with torch.multiprocessing. On a GPU node trainer rank r uses GPU r and
searcher i GPU (ranks + i); on a CPU machine everything shares the cores, split evenly. Searcher 0
also evaluates, between two rounds, when the trainer asks. With `--searchers 0` (one trainer
process) the trainer runs the vLLM engine itself: it generates before each step and evaluates.

Departures from the authors' code (MPI + DeepSpeed + TRL): trajectories stream to the trainer
through a bounded queue instead of arriving at each sync, so "recent" data means data added since
the last sync, or the newest data until some arrives (buffer.py); weights travel through shared
memory / CUDA IPC instead of MPI; the learning-rate schedule is computed here (same shape as
transformers' warmup-stable-decay).
"""

import dataclasses
import glob
import json
import math
import os
import pickle
import shutil
import signal
import socket
import sys
import time
import typing
from queue import Empty
from dataclasses import dataclass, field

import searcher  # first: sets vLLM's environment before anything imports vllm
import numpy as np
import torch
import torch.distributed as dist

from buffer import ReplayBuffer
from loss import sequence_logprobs, tb_loss
from rewards import REWARDS
from searcher import Dead, Engine, collate, publish, share_weights, shared_weights, unique_pairs
from tasks import ConfigError, load_task


def arg(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    # --- model and task
    model: str = arg("tiny", "'tiny' (built and cached on first use), 'rho-math-1b' (realtreetune/rho-1b-sft-GSM8K), "
                             "a Hugging Face id or a local folder; it is also pi_ref")
    task: str = arg("arith", "'arith' (toy: two-digit addition, built in) or 'gsm8k'")
    data: str | None = arg(None, "folder with the task's train.jsonl and test.jsonl (gsm8k); default: the Hugging Face hub")
    # --- processes
    searchers: int = arg(1, "searcher processes (one GPU each on a GPU node); 0 = the synchronous baseline, "
                            "generating inside the trainer before each step")
    # --- TBA (paper's names: B, K, k, m)
    steps: int = arg(200, "trainer steps (optimizer updates)")
    prompts_per_step: int = arg(32, "B: prompts per training batch, and per search round of a searcher")
    samples_per_prompt: int = arg(8, "K: responses per prompt in a training batch (the TB loss's log Z is over them)")
    search_samples_per_prompt: int | None = arg(None, "responses a searcher draws per prompt (>= K; default K)")
    sync_every: int = arg(2, "k: trainer steps between weight syncs to the searchers")
    recency: float = arg(0.95, "m: probability that a batch prompt comes from the data added since the last sync")
    reward_inv_temp: float = arg(0.0, "inverse temperature of the reward softmax for draws from the whole buffer; "
                                      "0 = uniform")
    buffer_capacity: int = arg(100, "trajectories kept per prompt (the newest)")
    beta: float = arg(0.05, "KL coefficient: target pi_ref * exp(reward / beta)")
    beta_final: float | None = arg(None, "beta at the end of the anneal (default: --beta, no anneal)")
    beta_anneal_steps: int = arg(0, "steps of the linear anneal from --beta to --beta-final")
    # --- optimisation
    lr: float = arg(5e-5, "peak learning rate (AdamW)")
    warmup_steps: int = arg(0, "learning rate: linear warmup steps")
    stable_steps: int | None = arg(None, "learning rate: constant steps after warmup (default: until decay or the end)")
    decay_steps: int = arg(100, "learning rate: cosine decay steps to 0 after the stable phase (the toy run settles)")
    grad_clip: float = arg(1.0, "gradient norm clip")
    micro_batch: int = arg(256, "sequences per forward/backward pass (whole prompts: at least K)")
    # --- sampling and evaluation
    temperature: float = arg(1.0, "sampling temperature; log-probs come from logits / temperature")
    max_new_tokens: int = arg(8, "response length limit in tokens (toy answers: 3 digits and EOS; GSM8K: 512)")
    eval_every: int = arg(10, "steps between evaluations (greedy pass@1 on held-out problems); 0 = start and end only")
    eval_limit: int | None = arg(None, "evaluate on the first N held-out problems only")
    # --- run
    seed: int = arg(0, "seed of every random choice: prompts, sampling, batches")
    out: str | None = arg(None, "output folder (default: a new folder under runs/)")
    save_every: int = arg(0, "steps between checkpoints in OUT/checkpoint; 0 = only when stopped by a signal")
    resume: str | None = arg(None, "checkpoint folder to continue from")
    timeout: float = arg(600.0, "seconds any wait on another process may last before the run stops")
    dtype: str = arg("auto", "float32 | bfloat16 | auto (bfloat16 on GPUs, float32 on the CPU)")
    searcher_memory: float = arg(0.85, "GPU: fraction of a searcher GPU's memory for its vLLM engine")
    trainer_memory: float = arg(0.2, "GPU, --searchers 0: fraction of the trainer GPU's memory for its vLLM engine")
    # --- derived by check(), saved with the run; not flags
    device: str = field(default="", init=False)      # cuda | cpu
    threads: int = field(default=0, init=False)      # CPU threads per process
    model_path: str = field(default="", init=False)  # the local folder of --model
    max_model_len: int = field(default=0, init=False)  # longest prompt + max_new_tokens


def parse(argv) -> Config:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(Config):
        if not f.init:
            continue
        kind = next(t for t in (int, float, str) if f.type is t or t in typing.get_args(f.type))
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default,
                       help=f"{f.metadata['help']} (default: {f.default})")
    return Config(**vars(p.parse_args(argv)))


# --- checks and derived values: everything is refused here, before anything is spawned ---------
ALIASES = {"rho-math-1b": "realtreetune/rho-1b-sft-GSM8K"}


def resolve_model(name: str) -> str:
    """A local folder holding the model named by --model (building or fetching it if needed)."""
    import re

    if name == "tiny":
        import tiny
        return tiny.cached()
    name = ALIASES.get(name, name)
    if os.path.isdir(name):
        path = name
    elif re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", name) and not name.startswith("."):
        from huggingface_hub import snapshot_download
        patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]
        try:
            path = snapshot_download(name, allow_patterns=patterns, local_files_only=True)
        except Exception:
            try:
                path = snapshot_download(name, allow_patterns=patterns)
            except Exception as e:
                raise ConfigError(f"--model: {name!r} is not a local folder and could not be fetched from the "
                                  f"Hugging Face hub ({type(e).__name__})") from None
    else:
        raise ConfigError(f"--model: {name!r} does not exist (not 'tiny', an alias, a folder or a hub id)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"--model: {path} holds no model (no config.json)")
    return path


def check(cfg: Config, world: int):
    """Validate flags and data; fill in derived values. Returns (cfg, tokenizer, train, test, prompt ids)."""
    from transformers import AutoConfig, AutoTokenizer

    def need(ok, flag, msg):
        if not ok:
            raise ConfigError(f"--{flag}: {msg}")

    need(0 <= cfg.recency <= 1, "recency", f"must be in [0, 1], got {cfg.recency}")
    need(cfg.samples_per_prompt >= 2, "samples-per-prompt", f"K must be at least 2 (log Z is a mean over K), got {cfg.samples_per_prompt}")
    cfg.search_samples_per_prompt = cfg.search_samples_per_prompt or cfg.samples_per_prompt
    need(cfg.search_samples_per_prompt >= cfg.samples_per_prompt, "search-samples-per-prompt", "must be at least K")
    need(cfg.sync_every >= 1, "sync-every", f"k must be at least 1, got {cfg.sync_every}")
    need(cfg.steps >= 1, "steps", "must be at least 1")
    need(cfg.prompts_per_step >= 1 and cfg.prompts_per_step % world == 0, "prompts-per-step",
         f"must be a positive multiple of the {world} trainer rank(s), got {cfg.prompts_per_step}")
    need(cfg.searchers >= 0, "searchers", "must be 0 or more")
    need(cfg.searchers > 0 or world == 1, "searchers", "0 (the synchronous baseline) runs in one trainer process; "
         f"got {world} (vLLM cannot share a multi-process group)")
    need(cfg.beta > 0, "beta", "must be positive")
    cfg.beta_final = cfg.beta if cfg.beta_final is None else cfg.beta_final
    need(cfg.beta_final > 0, "beta-final", "must be positive")
    need(cfg.lr > 0, "lr", "must be positive")
    need(cfg.temperature > 0, "temperature", "must be positive (evaluation is greedy on its own)")
    need(cfg.max_new_tokens >= 1, "max-new-tokens", "must be at least 1")
    need(cfg.buffer_capacity >= 1, "buffer-capacity", "must be at least 1")
    need(cfg.micro_batch >= 1, "micro-batch", "must be at least 1")
    need(cfg.eval_every >= 0, "eval-every", "must be 0 or more")
    need(cfg.save_every >= 0, "save-every", "must be 0 or more")
    need(cfg.timeout > 0, "timeout", "must be positive")
    for flag in ("warmup_steps", "decay_steps", "beta_anneal_steps"):
        need(getattr(cfg, flag) >= 0, flag.replace("_", "-"), "must be 0 or more")
    need(cfg.dtype in ("auto", "float32", "bfloat16"), "dtype", f"unknown dtype {cfg.dtype!r}")
    if cfg.resume:
        need(os.path.isfile(os.path.join(cfg.resume, "trainer.pt")), "resume", f"{cfg.resume} is not a checkpoint folder")
    # devices: trainer rank r on GPU r, searcher i on GPU (ranks + i)
    gpus = torch.cuda.device_count()
    cfg.device = "cuda" if gpus else "cpu"
    if gpus:
        need(world + cfg.searchers <= gpus, "searchers",
             f"{cfg.searchers} searcher(s) + {world} trainer rank(s) need {world + cfg.searchers} GPUs, {gpus} visible")
    cfg.dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if gpus else "float32")
    cores = len(os.sched_getaffinity(0))
    cfg.threads = max(1, cores // (world + cfg.searchers))  # CPU: split the cores evenly between processes
    # task, model, tokenizer
    train, test = load_task(cfg.task, cfg.data)
    test = test[: cfg.eval_limit] if cfg.eval_limit else test
    cfg.model_path = resolve_model(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
    need(tokenizer.eos_token_id is not None, "model", f"the tokenizer of {cfg.model_path} has no EOS token")
    prompts = [tokenizer(p.prompt).input_ids for p in train]
    test_prompts = [tokenizer(p.prompt).input_ids for p in test]
    longest = max(len(p) for p in prompts + test_prompts)
    context = getattr(AutoConfig.from_pretrained(cfg.model_path), "max_position_embeddings", None)
    cfg.max_model_len = longest + cfg.max_new_tokens
    if context:
        need(cfg.max_model_len <= context, "max-new-tokens",
             f"{cfg.max_new_tokens} new tokens + the longest prompt's {longest} tokens = {cfg.max_model_len} "
             f"exceeds the model's context of {context} tokens")
    need(cfg.micro_batch >= cfg.samples_per_prompt, "micro-batch", "must hold at least one prompt's K sequences")
    cfg.out = cfg.out or (os.path.dirname(os.path.abspath(cfg.resume)) if cfg.resume
                          else os.path.join("runs", time.strftime("%Y%m%d-%H%M%S") + f"-{cfg.task}-s{cfg.searchers}"))
    if not cfg.resume and os.path.isdir(cfg.out) and os.listdir(cfg.out):
        raise ConfigError(f"--out: {cfg.out} exists and is not empty (pass --resume to continue a run)")
    return cfg, tokenizer, train, test, prompts, test_prompts


# --- schedules (the authors': beta annealed linearly, lr warmup-stable-decay) -------------------
def beta_at(cfg, step: int) -> float:
    frac = min(1.0, step / cfg.beta_anneal_steps) if cfg.beta_anneal_steps else 1.0
    return cfg.beta + (cfg.beta_final - cfg.beta) * frac


def lr_at(cfg, step: int) -> float:
    stable = cfg.stable_steps if cfg.stable_steps is not None else max(0, cfg.steps - cfg.warmup_steps - cfg.decay_steps)
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if step < cfg.warmup_steps + stable:
        return cfg.lr
    progress = (step - cfg.warmup_steps - stable) / max(1, cfg.decay_steps)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


# --- the trainer's model and its TB gradient ---------------------------------------------------------
def load_policy(path: str, device, dtype: str):
    """float32 weights, sharded with FSDP2 over the trainer ranks (per decoder layer, then the
    whole), computing in `dtype` (bf16 on GPUs) and reducing gradients in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    model.config.use_cache = False
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def tb_backward(model, groups, prompts_per_rank: float, prompts, pad, device, cfg, beta: float):
    """Accumulate the gradient of the TB loss over this rank's groups (K trajectories of one prompt
    each), in passes of whole prompts. Returns (sum of loss x prompts, sum of log Z, prompts)."""
    per_pass = max(1, cfg.micro_batch // cfg.samples_per_prompt)
    stats = torch.zeros(3, dtype=torch.float64)
    for i in range(0, len(groups), per_pass):
        part = groups[i:i + per_pass]
        pairs, index = unique_pairs([t for g in part for t in g], prompts)  # each distinct sequence once
        logp = sequence_logprobs(model, *collate(pairs, pad, device), cfg.temperature)         # (distinct,)
        logp = logp[torch.tensor(index, device=device)].view(len(part), cfg.samples_per_prompt)  # (b, K)
        logp_ref = torch.tensor([[t.logp_ref for t in g] for g in part], device=device)        # (b, K)
        reward = torch.tensor([[t.reward for t in g] for g in part], device=device)            # (b, K)
        loss, log_z = tb_loss(logp, logp_ref, reward, beta)
        # the mean over all B prompts: FSDP averages gradients over the ranks, each holding B / ranks
        (loss * len(part) / prompts_per_rank).backward()
        stats += torch.tensor([loss.item() * len(part), log_z.sum().item(), len(part)], dtype=torch.float64)
    return stats


# --- distributed helpers -------------------------------------------------------------------------
def init_distributed(cfg):
    """One process group even for a single process, so one code path serves 1 and N ranks."""
    if "RANK" not in os.environ:  # plain `python tba.py`: a group of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(s.getsockname()[1]))
    import datetime
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.timeout))
    return dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])


def full_state_dict(model) -> dict:
    """All ranks call; rank 0 gets the full weights on the CPU (Hugging Face names)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def broadcast(obj, rank):
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# --- checkpoints ---------------------------------------------------------------------------------
def save_checkpoint(cfg, rank, model, opt, buffer, weights, step, elapsed, tokenizer):
    """Model (Hugging Face format), optimizer, step (the schedules and per-step seeds derive from it),
    RNG state, replay buffer, and the weights the searchers hold if older than the model's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    sd = full_state_dict(model)
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return

    def write(folder):
        save_hf(model, sd, tokenizer, os.path.join(folder, "model"))
        synced = {n: t.cpu() for n, t in weights.tensors.items()} if weights.version.value != step else None
        torch.save(dict(optimizer=osd, step=step, elapsed=elapsed, synced=synced,
                        synced_version=weights.version.value, torch_rng=torch.get_rng_state()),
                   os.path.join(folder, "trainer.pt"))
        with open(os.path.join(folder, "buffer.pkl"), "wb") as f:
            pickle.dump(buffer, f, protocol=pickle.HIGHEST_PROTOCOL)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(vars(cfg), f, indent=1)
    atomic_checkpoint(cfg.out, step, write)


def atomic_checkpoint(out: str, step: int, write):
    """OUT/checkpoint is a link to the newest complete OUT/checkpoint-STEP: the new one is written
    under a temporary name, renamed, then the link is swapped in one rename, then the old one goes.
    A crash at any point leaves the link on a complete checkpoint."""
    name = f"checkpoint-{step:06d}"
    for stale in glob.glob(os.path.join(out, "checkpoint-*.tmp")):  # left by a crash mid-save
        shutil.rmtree(stale, ignore_errors=True)
    tmp = os.path.join(out, name + ".tmp")
    os.makedirs(tmp)
    write(tmp)
    shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    os.replace(tmp, os.path.join(out, name))
    link = os.path.join(out, "checkpoint")
    previous = os.path.realpath(link) if os.path.islink(link) else None
    if os.path.lexists(link + ".tmp"):
        os.remove(link + ".tmp")
    os.symlink(name, link + ".tmp")
    os.replace(link + ".tmp", link)
    if previous and os.path.basename(previous) != name:
        shutil.rmtree(previous, ignore_errors=True)


def save_hf(model, state_dict, tokenizer, path):
    model.save_pretrained(path, state_dict=state_dict)
    tokenizer.save_pretrained(path)


# --- the run -------------------------------------------------------------------------------------
class Stop(Exception):
    """A signal asked the run to stop (after a checkpoint)."""


def main(argv=None):
    cfg = parse(sys.argv[1:] if argv is None else argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank_env = int(os.environ.get("RANK", "0"))
    try:
        cfg, *data = check(cfg, world)
    except ConfigError as e:
        if rank_env == 0:
            print(f"tba.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    code = 0
    try:
        run(cfg, *data)
    except (Dead, FloatingPointError, TimeoutError) as e:  # a searcher died, a non-finite loss, a wait timed out
        print(f"tba.py: error: {e}", file=sys.stderr, flush=True)
        code = 1
    except Stop as e:
        print(f"tba.py: stopped by {e}; checkpoint in {os.path.join(cfg.out, 'checkpoint')}", file=sys.stderr, flush=True)
        code = 130 if str(e) == "SIGINT" else 143
    except KeyboardInterrupt:
        print("tba.py: stopped at once by a second signal, without a checkpoint", file=sys.stderr, flush=True)
        code = 130
    sys.exit(code)


def run(cfg, tokenizer, train_problems, test_problems, prompts, test_prompts):
    t_start = time.time()
    # --- signals: the first stops the run after a checkpoint; a second stops it at once
    stop_signal = []

    def on_signal(signum, frame):
        if stop_signal:
            raise KeyboardInterrupt
        stop_signal.append(signal.Signals(signum).name)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    rank, world, local_rank = init_distributed(cfg)
    device = torch.device(f"cuda:{local_rank}" if cfg.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(cfg.threads)  # before vLLM starts: it pins the thread count after
    answers = [p.answer for p in train_problems]
    test_answers = [p.answer for p in test_problems]
    ctx = torch.multiprocessing.get_context("spawn")
    procs, engine, channels = [], None, None
    log = Log(cfg, rank, t_start)

    try:
        # --- the searchers first (rank 0): their vLLM engines start while the trainer loads its model
        weights = shared_weights(ctx) if rank == 0 else None
        if rank == 0 and cfg.searchers:
            channels = (ctx.Queue(maxsize=4 * cfg.searchers), ctx.Event(), ctx.Queue())
            queue, stop, evals = channels
            for i in range(cfg.searchers):
                dev = f"cuda:{world + i}" if cfg.device == "cuda" else "cpu"
                p = ctx.Process(target=searcher.run, name=f"searcher-{i}", daemon=True,
                                args=(i, dict(vars(cfg)), weights, queue, stop, evals if i == 0 else None,
                                      prompts, answers, test_prompts, test_answers, dev))
                p.start()
                procs.append(p)
        # --- synchronous baseline: a vLLM engine inside the trainer (one process: see check())
        if cfg.searchers == 0:
            engine = Engine(cfg, cfg.model_path, cfg.model_path, str(device), cfg.trainer_memory,
                            prompts, answers, REWARDS[cfg.task])
        # --- the trainer's model: FSDP2 over the trainer ranks
        model = load_policy(os.path.join(cfg.resume, "model") if cfg.resume else cfg.model_path, device, cfg.dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

        # --- resume: step, optimizer, buffer, RNG, and the weights the searchers held
        step, buffer, ckpt = 0, ReplayBuffer(cfg.buffer_capacity, cfg.recency, cfg.reward_inv_temp), None
        if cfg.resume:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
            ckpt = torch.load(os.path.join(cfg.resume, "trainer.pt"), weights_only=False)
            set_optimizer_state_dict(model, opt, ckpt["optimizer"], options=StateDictOptions(full_state_dict=True))
            step, log.t0 = ckpt["step"], t_start - ckpt["elapsed"]
            torch.set_rng_state(ckpt["torch_rng"])
            with open(os.path.join(cfg.resume, "buffer.pkl"), "rb") as f:
                buffer = pickle.load(f)

        # --- the shared weights (rank 0 allocates them once), handed to the searchers
        sd = full_state_dict(model)
        if rank == 0:
            share_weights(sd, device, getattr(torch, cfg.dtype), weights=weights)
            weights.version.value = step
            if ckpt is not None and ckpt["synced"] is not None:  # the searchers held older weights
                publish(weights, ckpt["synced"], ckpt["synced_version"], lambda: None, cfg.timeout)
            for _ in procs:  # now the searchers may read them (shared memory / CUDA IPC handles, not copies)
                weights.handoff.put(weights.tensors)
            log.published[weights.version.value] = log.clock()
        del sd

        def alive():
            for i, p in enumerate(procs):
                if p.exitcode is not None:
                    raise Dead(f"searcher {i} (pid {p.pid}) died with exit code {p.exitcode}")

        def receive(until) -> float:
            """Move the searchers' messages into the buffer and the log; wait (polling, checking the
            searchers, signals and the timeout) until `until()` holds. Returns seconds waited."""
            return drain(channels[0], buffer, log, alive, lambda: until() or bool(stop_signal), cfg.timeout)

        def evaluate():
            """Greedy pass@1 on the held-out problems with the current weights."""
            if cfg.searchers:  # searcher 0 evaluates the newest published weights between rounds
                if rank == 0:
                    channels[2].put(step)
                return
            sd = full_state_dict(model)
            t0 = time.time()
            if engine.version != step:
                engine.load(list(sd.items()), step)
            log.eval(step, *engine.evaluate(test_prompts, test_answers), time.time() - t0, log.clock())
            log.overhead += time.time() - t0

        def sync_weights():
            """Publish the trainer's weights; searchers reload them before their next round."""
            sd = full_state_dict(model)
            if rank == 0:
                publish(weights, sd, step, alive, cfg.timeout)
                buffer.mark_sync()
                log.published[step] = log.clock()

        def checkpoint():
            t0 = time.time()
            save_checkpoint(cfg, rank, model, opt, buffer, weights, step, log.now(), tokenizer)
            log.overhead += time.time() - t0

        evaluate()
        while step < cfg.steps:
            t_step, wait = time.time(), 0.0
            # ===== collect: searched trajectories into the buffer ==============================
            if rank == 0 and cfg.searchers == 0 and not stop_signal:  # synchronous: generate here
                engine.sync(weights, alive, cfg.timeout)
                ids = np.random.default_rng([cfg.seed, step, 3]).choice(len(prompts), cfg.prompts_per_step, replace=False)
                trajectories, _ = engine.search(ids, cfg.search_samples_per_prompt, (cfg.seed, 0, step))
                buffer.add(trajectories)
                log.samples += len(trajectories)
            elif rank == 0 and cfg.searchers:  # TBA: whatever arrived; wait only at the start
                wait = receive(lambda: len(buffer.prompts) >= cfg.prompts_per_step)
            # ===== sample a batch: B prompts x K responses (TBA: recency m, reward softmax) =====
            batch = None  # stays None on rank 0 when a signal asked to stop
            if rank == 0 and not stop_signal:
                batch = buffer.sample(cfg.prompts_per_step, cfg.samples_per_prompt,
                                      np.random.default_rng([cfg.seed, step, 2]))
            batch = broadcast(batch, rank)
            if batch is None:
                checkpoint()
                raise Stop(stop_signal[0] if stop_signal else "a signal")
            mine = batch[rank * len(batch) // world:(rank + 1) * len(batch) // world]
            # ===== TB loss and update ============================================================
            beta, lr = beta_at(cfg, step), lr_at(cfg, step)
            for g in opt.param_groups:
                g["lr"] = lr
            stats = tb_backward(model, mine, len(batch) / world, prompts, pad, device, cfg, beta)
            dist.all_reduce(stats)
            if not math.isfinite(stats[0].item()):
                raise FloatingPointError(f"non-finite loss at step {step + 1}; the last good checkpoint, if any, "
                                         f"is {os.path.join(cfg.out, 'checkpoint')}")
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            # ===== sync weights to the searchers every k steps ===================================
            t_sync = time.time()
            if step % cfg.sync_every == 0:
                sync_weights()
            sync_seconds = time.time() - t_sync
            # ===== log ============================================================================
            if rank == 0:
                stale = [step - 1 - t.version for g in batch for t in g]
                log.row(kind="train", step=step, time=log.now(), loss=stats[0].item() / stats[2].item(),
                        reward=float(np.mean([t.reward for g in batch for t in g])),
                        log_z=stats[1].item() / stats[2].item(), beta=beta, lr=lr,
                        staleness=float(np.mean(stale)), staleness_max=int(max(stale)), wait=wait,
                        sync=sync_seconds, seconds=time.time() - t_step, samples=log.samples,
                        buffer=len(buffer), overhead=log.overhead)
            # ===== evaluate ======================================================================
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                evaluate()
            # ===== checkpoint =====================================================================
            if cfg.save_every and step % cfg.save_every == 0:
                checkpoint()

        # --- the end: the final weights to the searchers, the final evaluation, the final model
        if step % cfg.sync_every:
            sync_weights()
        evaluate()
        if rank == 0 and cfg.searchers:
            receive(lambda: log.evals and log.evals[-1]["version"] == cfg.steps)
            if stop_signal:
                checkpoint()
                raise Stop(stop_signal[0])
        sd = full_state_dict(model)
        if rank == 0:
            save_hf(model, sd, tokenizer, os.path.join(cfg.out, "final"))
            log.summary()
    finally:
        if channels is not None:
            shutdown(procs, *channels[:2], weights.handoff)
        if engine is not None:
            engine.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def drain(queue, buffer, log, alive, done, timeout: float) -> float:
    """Move every waiting message into the buffer (trajectories) or the log (evaluations); then, while
    not done(), wait for more, polling, checking the searchers and a timeout. Returns seconds waited."""
    waited, deadline = 0.0, time.time() + timeout
    while True:
        block = not done()
        t0 = time.time()
        try:
            msg = queue.get(timeout=searcher.WAIT) if block else queue.get_nowait()
        except Empty:
            alive()
            if not block:
                return waited
            waited += time.time() - t0
            if time.time() > deadline:
                raise TimeoutError(f"no data from the searchers in {timeout:.0f} s (see --timeout)")
            continue
        if block:
            waited += time.time() - t0
        if msg["kind"] == "eval":
            log.eval(msg["version"], msg["accuracy"], msg["example"], msg["seconds"], log.published[msg["version"]])
        else:
            buffer.add(msg["trajectories"])
            log.samples += len(msg["trajectories"])


def shutdown(procs, queue, stop, handoff):
    """Stop the searchers: ask (they finish their round), then kill; nothing is left behind."""
    stop.set()
    deadline = time.time() + 5
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.time()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    queue.cancel_join_thread()
    handoff.cancel_join_thread()


class Log:
    """metrics.jsonl rows, config.json, and the console (rank 0 writes; other ranks do nothing)."""

    def __init__(self, cfg, rank, t0):
        self.cfg, self.rank, self.t0 = cfg, rank, t0
        self.overhead = 0.0  # s the trainer spent evaluating and checkpointing (not learning)
        self.samples = 0     # trajectories received
        self.evals, self.published = [], {}  # eval rows; weight version -> (time, overhead) when made
        if rank == 0:
            os.makedirs(cfg.out, exist_ok=True)
            with open(os.path.join(cfg.out, "config.json"), "w") as f:
                json.dump(dict(vars(cfg), started=t0), f, indent=1)  # started: the Unix time of t = 0
            self.file = open(os.path.join(cfg.out, "metrics.jsonl"), "a")

    def now(self) -> float:
        return time.time() - self.t0

    def clock(self) -> tuple[float, float]:
        return self.now(), self.overhead

    def eval(self, version: int, accuracy: float, example: dict, seconds: float, made: tuple[float, float]):
        """An evaluation of the weights of step `version`; time and overhead: when they were made."""
        self.row(kind="eval", step=version, version=version, accuracy=accuracy, time=made[0], overhead=made[1],
                 seconds=seconds, example=example)

    def row(self, **row):
        if self.rank != 0:
            return
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if row["kind"] == "eval":
            self.evals.append(row)
            print(f"eval  step {row['step']:5d} | held-out accuracy {row['accuracy']:.3f}", flush=True)
        else:
            print(f"step {row['step']:5d} | reward {row['reward']:.3f} | loss {row['loss']:8.4f} | "
                  f"log_z {row['log_z']:8.3f} | beta {row['beta']:.4f} | lr {row['lr']:.2e} | "
                  f"stale {row['staleness']:.1f}/{row['staleness_max']} | wait {row['wait']:.2f}s | "
                  f"samples {row['samples']} | {row['time']:.0f}s", flush=True)

    def summary(self):
        first, last = self.evals[0], self.evals[-1]
        print(f"done: {self.cfg.steps} steps in {self.now():.0f} s | held-out accuracy {first['accuracy']:.3f} "
              f"(step {first['step']}) -> {last['accuracy']:.3f} (step {last['step']}) | {self.cfg.out}", flush=True)


if __name__ == "__main__":
    main()
