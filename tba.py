"""TBA: Trajectory Balance with Asynchrony (Bartoldson et al., NeurIPS 2025), from a laptop to several nodes.

Searcher processes generate responses with vLLM and a local copy of the policy, score them and
push them to the trainer without ever waiting for it (searcher.py). The trainer keeps learning
from a replay buffer of everything searched so far (buffer.py) with the trajectory balance
objective (loss.py), which stays valid for off-policy data, and every `--sync-every` steps its
weights go to the searchers through shared tensors (weights.py). This file holds the config, the
process layout and the trainer loop.

    torchrun --nproc_per_node=1 tba.py                  # the toy task on a laptop: about a minute
    torchrun --nproc_per_node=1 tba.py --searchers 0    # the synchronous baseline, same code
    python tba.py --help                                # every flag
    bash run_gsm8k.sh                                   # the paper's GSM8K run on a 4-GPU node

Layout: torchrun starts the trainer ranks, which train one model with FSDP2 (`fully_shard`).
Rank 0 holds the replay buffer, samples each batch and broadcasts it, and spawns `--searchers`
searcher processes with torch.multiprocessing. On a GPU node trainer rank r uses GPU r and
searcher i GPU (ranks + i); on a CPU machine everything shares the cores, split evenly. Searcher 0
also evaluates, between two rounds, when the trainer asks. With `--searchers 0` (one trainer
process) the trainer runs the vLLM engine itself: it generates before each step and evaluates.
Several nodes (`torchrun --nnodes N`): each node's first trainer process does for its node what
rank 0 does for the weights and searchers, and forwards its searchers' trajectories to rank 0
(nodes.py; `multi` below is None on one node).

Departures from the authors' code (MPI + DeepSpeed + TRL): trajectories stream to the trainer
through a bounded queue instead of arriving at each sync, so "recent" data means data added since
the last sync, or the newest data until some arrives (buffer.py); weights travel through shared
memory / CUDA IPC instead of MPI; the learning-rate schedule is computed here (same shape as
transformers' warmup-stable-decay). `--loss` swaps TB for an on-policy baseline (loss.py), for the
off-policy study of `bench.py` part 7; `--ref-reset-every` is TBA′ (the paper, Sec. 6).
"""

import os
import signal
import sys


def stopped_at_start(signum, frame):
    """Ctrl-C or SIGTERM while importing and checking: nothing runs yet, so stop quietly."""
    print(f"tba.py: stopped by {signal.Signals(signum).name} during start-up", file=sys.stderr, flush=True)
    os._exit(128 + signum)  # 130 / 143; no process has been spawned yet


if __name__ == "__main__":  # before the heavy imports below, which take seconds
    signal.signal(signal.SIGINT, stopped_at_start)
    signal.signal(signal.SIGTERM, stopped_at_start)

import contextlib  # noqa: E402  (after the handlers: a signal during these imports stops quietly)
import dataclasses
import glob
import json
import math
import shutil
import socket
import time
import typing
from dataclasses import dataclass, field
from queue import Empty

import searcher  # first: sets vLLM's environment before anything imports vllm
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import nodes
from buffer import ReplayBuffer
from log import Log
from loss import LOSSES, collate, sequence_logprobs, unique_pairs
from searcher import Engine
from tasks import ConfigError, load_task
from weights import Dead, aliases, allocate, create, gather, publish


def arg(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    # --- model and task
    model: str = arg("tiny", "'tiny' (built and cached on first use), 'rho-math-1b' (realtreetune/rho-1b-sft-GSM8K), "
                             "a Hugging Face id or a local folder; it is also pi_ref")
    task: str = arg("arith", "'arith' (toy: two-digit addition, built in), 'gsm8k', 'tldr' (needs --reward-model) "
                             "or 'redteam' (needs --victim, --classifier, --embedding-model)")
    data: str | None = arg(None, "folder with the task's JSONL files (gsm8k: train, test; tldr: train, validation); "
                                 "default: the Hugging Face hub")
    reward_model: str | None = arg(None, "a sequence classifier with one output (folder or hub id) that scores "
                                         "prompt + response; replaces the task's string reward")
    eval_reward_model: str | None = arg(None, "tldr: the judge of the evaluation's win rate (default: --reward-model)")
    non_eos_penalty: bool = arg(False, "a response that never produced EOS gets -1 instead of its reward-model score")
    # --- red-teaming (redteam.py): the attacker is --model; the evaluation samples --eval-limit attacks (default 1,024)
    victim: str | None = arg(None, "redteam: the victim, a causal LM (folder or hub id) that answers each attack")
    classifier: str | None = arg(None, "redteam: the reward's judge (folder or hub id): a sequence classifier with an "
                                       "unsafe label, or a causal LM judge in the style of Llama Guard")
    unsafe_label: str | None = arg(None, "redteam: the sequence classifier's unsafe label (default: the one named "
                                         "unsafe, toxic, hate, harmful or offensive in its id2label)")
    embedding_model: str | None = arg(None, "redteam: the sentence embedder of the evaluation's diversity "
                                            "(Lee et al.: sentence-transformers/all-MiniLM-L6-v2)")
    victim_max_new_tokens: int | None = arg(None, "redteam: the victim's response length in tokens (default: Lee "
                                                  "et al.'s, 64 with a chat template, 30 without)")
    victim_responses: int = arg(5, "redteam: the victim's responses to each attack; the reward is the mean of "
                                   "their log P(unsafe)")
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
    initial_buffer: int = arg(0, "trajectories that must have arrived before the first training step")
    beta: float = arg(0.05, "KL coefficient: target pi_ref * exp(reward / beta)")
    beta_final: float | None = arg(None, "beta at the end of the anneal (default: --beta, no anneal)")
    beta_anneal_steps: int = arg(0, "steps of the linear anneal from --beta to --beta-final")
    beta_stop_step: int = arg(0, "from this step (update) on, beta is --beta-final at once, cutting the anneal "
                                 "short (the authors' TL;DR: 32 of a 128-step anneal); 0 = never")
    ref_reset_every: int = arg(0, "TBA′: every N steps pi_ref becomes the current policy (the paper: 50); 0 = never")
    # --- objective (loss.py)
    loss: str = arg("tb", "tb (trajectory balance: the method) | rloo | grpo (on-policy baselines for the "
                          "off-policy study)")
    clip: float = arg(0.2, "grpo: clip range of the importance ratio")
    lag: int = arg(0, "staleness study: the searchers get the weights of step t - LAG instead of step t")
    # --- optimisation
    lr: float = arg(5e-5, "peak learning rate (AdamW)")
    warmup_steps: int = arg(0, "learning rate: linear warmup steps")
    stable_steps: int | None = arg(None, "learning rate: constant steps after warmup (default: until decay or the end)")
    decay_steps: int = arg(100, "learning rate: decay steps to 0 after the stable phase, shaped by --lr-decay (the "
                                "toy run settles)")
    grad_clip: float = arg(1.0, "gradient norm clip; 0 = none")
    lr_decay: str = arg("cosine", "shape of the decay to 0 over --decay-steps: cosine | linear (transformers' "
                                  "default, the authors' TL;DR)")
    trainer_dtype: str = arg("float32", "the trainer's weights and AdamW state: float32 (master weights, computing "
                                        "in --dtype) | bfloat16 (as the authors' GSM8K run: small updates round away)")
    micro_batch: int = arg(256, "sequences per forward/backward pass (whole prompts: at least K)")
    activation_checkpointing: bool = arg(False, "recompute each decoder block's activations in the backward pass "
                                                "instead of keeping them (less memory, about 1/3 more compute; "
                                                "the same numbers)")
    # --- sampling and evaluation
    temperature: float = arg(1.0, "sampling temperature; log-probs come from logits / temperature")
    max_new_tokens: int = arg(8, "response length limit in tokens (toy answers: 3 digits and EOS; GSM8K: 512)")
    eval_every: int = arg(10, "steps between evaluations (on held-out problems); 0 = start and end only")
    eval_limit: int | None = arg(None, "evaluate on the first N held-out problems only")
    eval_temperature: float = arg(0.0, "sampling temperature of the evaluation's responses; 0 = greedy "
                                       "(the authors' TL;DR evaluation: 0.01)")
    # --- run
    seed: int = arg(0, "seed of every random choice: prompts, sampling, batches")
    out: str | None = arg(None, "output folder (default: a new folder under runs/)")
    save_every: int = arg(0, "steps between checkpoints in OUT/checkpoint; 0 = only when stopped by a signal")
    resume: str | None = arg(None, "checkpoint folder to continue from")
    log_every: int = arg(10, "steps between console lines when the output is not a terminal (a terminal gets a bar)")
    wandb: str | None = arg(None, "also log the metrics to this Weights & Biases project (optional: pip install wandb)")
    timeout: float = arg(600.0, "seconds any wait on another process may last before the run stops; also how "
                                "long a searcher may send nothing before the run stops (after a checkpoint)")
    max_staleness: int = arg(100, "S: the trainer waits (polling) while the newest data received was sampled by "
                                  "weights more than S (+ --lag) steps old; 0 = no bound")
    dtype: str = arg("auto", "float32 | bfloat16 | float16 | auto (bfloat16 on GPUs that have it, float16 on "
                             "older GPUs, float32 on the CPU)")
    searcher_memory: float = arg(0.7, "GPU: fraction of a searcher GPU's memory for its vLLM engine (the rest: "
                                      "pi_ref and its log-probs)")
    trainer_memory: float = arg(0.2, "GPU, --searchers 0: fraction of the trainer GPU's memory for its vLLM engine")
    # --- emulation (bench.py part 9): the regime TBA is for, on a machine that is not in it
    generation_slowdown: float = arg(1.0, "experiment knob: every search round's generation takes X times as long as "
                                          "vLLM's (it sleeps X - 1 times that: no core used), as if a bigger model "
                                          "generated on devices of its own; evaluation is not slowed; 1 = off")
    # --- derived by check(), saved with the run; not flags
    device: str = field(default="", init=False)      # cuda | cpu
    threads: int = field(default=0, init=False)      # CPU threads per process
    model_path: str = field(default="", init=False)  # the local folder of --model
    max_model_len: int = field(default=0, init=False)  # longest prompt + max_new_tokens
    score: str = field(default="accuracy", init=False)  # the evaluation's headline figure
    reward_model_path: str | None = field(default=None, init=False)       # local folder of --reward-model
    eval_reward_model_path: str | None = field(default=None, init=False)  # local folder of the judge
    victim_path: str | None = field(default=None, init=False)           # redteam: local folders of the victim,
    classifier_path: str | None = field(default=None, init=False)       # the classifier
    embedding_model_path: str | None = field(default=None, init=False)  # and the embedder
    classifier_kind: str | None = field(default=None, init=False)       # redteam: 'sequence' or 'judge'

    def __post_init__(self):  # derived fields start at their defaults, so that vars(cfg) holds them all
        for f in dataclasses.fields(self):
            if not f.init:
                setattr(self, f.name, f.default)


def parse(argv) -> Config:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(Config):
        if not f.init:
            continue
        name, help = "--" + f.name.replace("_", "-"), f"{f.metadata['help']} (default: {f.default})"
        if f.type is bool:
            p.add_argument(name, action=argparse.BooleanOptionalAction, default=f.default, help=help)
            continue
        kind = next(t for t in (int, float, str) if f.type is t or t in typing.get_args(f.type))
        p.add_argument(name, type=kind, default=f.default, help=help)
    return Config(**vars(p.parse_args(argv)))


# --- checks and derived values: everything is refused here, before anything is spawned ---------
ALIASES = {"rho-math-1b": "realtreetune/rho-1b-sft-GSM8K"}


def resolve_model(name: str, flag: str = "model") -> str:
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
                raise ConfigError(f"--{flag}: {name!r} is not a local folder and could not be fetched from the "
                                  f"Hugging Face hub ({type(e).__name__})") from None
    else:
        raise ConfigError(f"--{flag}: {name!r} does not exist (not 'tiny', an alias, a folder or a hub id)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"--{flag}: {path} holds no model (no config.json)")
    return path


TLDR_MAX_PROMPT = 512  # tokens


def check_reward_model(name: str, flag: str) -> str:
    """The local folder of a reward model: a sequence classifier with exactly one output, and its tokenizer."""
    from transformers import AutoConfig
    path = resolve_model(name, flag)
    config = AutoConfig.from_pretrained(path)
    kinds = getattr(config, "architectures", None) or []
    if not any(k.endswith("ForSequenceClassification") for k in kinds):
        raise ConfigError(f"--{flag}: {path} is not a sequence classifier (architectures: {', '.join(kinds) or 'none'})")
    if config.num_labels != 1:
        raise ConfigError(f"--{flag}: {path} has {config.num_labels} outputs; a reward model has exactly one")
    load_tokenizer(path, flag)
    return path


def check_redteam(cfg):
    """The red-teaming models (redteam.py): a causal LM victim, a classifier of either kind, an embedder,
    each with its tokenizer."""
    from transformers import AutoConfig
    import redteam

    cfg.victim_path = resolve_model(cfg.victim, "victim")
    config = AutoConfig.from_pretrained(cfg.victim_path)
    kinds = getattr(config, "architectures", None) or []
    if redteam.classifier_kind(config) != "judge":  # i.e. a causal LM
        raise ConfigError(f"--victim: {cfg.victim_path} is not a causal LM (architectures: {', '.join(kinds) or 'none'})")
    load_tokenizer(cfg.victim_path, "victim")
    cfg.classifier_path = resolve_model(cfg.classifier, "classifier")
    config = AutoConfig.from_pretrained(cfg.classifier_path)
    cfg.classifier_kind = redteam.classifier_kind(config)
    if cfg.classifier_kind is None:
        raise ConfigError(f"--classifier: {cfg.classifier_path} is neither a sequence classifier nor a causal LM "
                          f"(architectures: {', '.join(getattr(config, 'architectures', None) or []) or 'none'})")
    if cfg.classifier_kind == "sequence":
        try:
            redteam.unsafe_index(config, cfg.unsafe_label)
        except ValueError as e:
            raise ConfigError(f"--{'unsafe-label' if cfg.unsafe_label else 'classifier'}: {cfg.classifier_path} has {e}") from None
    elif cfg.unsafe_label:
        raise ConfigError(f"--unsafe-label: {cfg.classifier_path} is a causal LM judge; its verdict is the token \"unsafe\"")
    load_tokenizer(cfg.classifier_path, "classifier")
    cfg.embedding_model_path = resolve_model(cfg.embedding_model, "embedding-model")
    load_tokenizer(cfg.embedding_model_path, "embedding-model")


def load_tokenizer(path: str, flag: str = "model"):
    """The tokenizer saved beside the model, or a one-line refusal naming what is missing."""
    from transformers import AutoTokenizer
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.isfile(os.path.join(path, f)) for f in files):
        raise ConfigError(f"--{flag}: {path} has no tokenizer (none of {', '.join(files)}); save the model's "
                          f"tokenizer beside it (tokenizer.save_pretrained)")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ConfigError(f"--{flag}: the tokenizer in {path} does not load ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:160]})") from None


def check_gpus(cfg, world: int):
    """GPU settings that would fail inside a spawned process: refuse them here, in one line."""
    gpus = torch.cuda.device_count()
    used = range(world + cfg.searchers)
    if len(used) > gpus:
        raise ConfigError(f"--searchers: {cfg.searchers} searcher(s) + {world} trainer rank(s) need "
                          f"{len(used)} GPUs, {gpus} visible")
    # vLLM refuses bf16 below compute capability 8.0 (vllm/platforms/cuda.py:636-654, checking GPU 0
    # only); torch.cuda.is_bf16_supported() says True there (emulation) and checks one device
    oldest = min((torch.cuda.get_device_capability(i), i) for i in used)
    if cfg.dtype == "auto":
        cfg.dtype = "bfloat16" if oldest[0] >= (8, 0) else "float16"
    if cfg.dtype == "bfloat16" and oldest[0] < (8, 0):
        raise ConfigError(f"--dtype: bfloat16 needs compute capability 8.0 or newer; GPU {oldest[1]} has "
                          f"{'.'.join(map(str, oldest[0]))} (use --dtype float16)")
    if cfg.searchers and compute_mode(0) == 3:  # NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
        raise ConfigError("--searchers: GPU 0 is in EXCLUSIVE_PROCESS compute mode, but the searchers open the "
                          "shared weights there beside the trainer; set it to DEFAULT (nvidia-smi -i 0 -c DEFAULT)")


def compute_mode(index: int) -> int | None:
    """NVML compute mode of CUDA device `index` (as torch numbers it), or None without NVML. vLLM ships
    nvidia-ml-py as vllm.third_party.pynvml (vllm/utils/import_utils.py:24-52); NVML numbers GPUs
    physically, so the device is found by its UUID."""
    try:
        import pynvml
    except ImportError:
        from vllm.third_party import pynvml
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        uuid = uuid if uuid.startswith(("GPU-", "MIG-")) else "GPU-" + uuid
        return pynvml.nvmlDeviceGetComputeMode(pynvml.nvmlDeviceGetHandleByUUID(uuid))
    except pynvml.NVMLError:  # a MIG device or a UUID NVML does not know: the mode is unknown, as without NVML
        return None
    finally:
        pynvml.nvmlShutdown()


def check(cfg: Config, world: int):
    """Validate flags and data; fill in derived values.
    Returns (cfg, tokenizer, train, test, prompt ids, test prompt ids, checkpoint or None)."""
    from transformers import AutoConfig

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
    need(cfg.temperature > 0, "temperature", "must be positive (the evaluation has its own: --eval-temperature)")
    need(cfg.max_new_tokens >= 1, "max-new-tokens", "must be at least 1")
    need(cfg.buffer_capacity >= 1, "buffer-capacity", "must be at least 1")
    need(cfg.micro_batch >= 1, "micro-batch", "must be at least 1")
    need(cfg.grad_clip >= 0, "grad-clip", "must be 0 (no clipping) or more")
    need(cfg.eval_every >= 0, "eval-every", "must be 0 or more")
    need(cfg.eval_limit is None or cfg.eval_limit >= 1, "eval-limit", "must be at least 1")
    need(cfg.save_every >= 0, "save-every", "must be 0 or more")
    need(cfg.log_every >= 1, "log-every", "must be at least 1")
    need(cfg.timeout > 0, "timeout", "must be positive")
    need(cfg.generation_slowdown >= 1, "generation-slowdown", f"must be 1 (off) or more, got {cfg.generation_slowdown}")
    need(cfg.max_staleness >= 0, "max-staleness", "must be 0 (no bound) or more")
    check_environment()
    for flag in ("warmup_steps", "decay_steps", "beta_anneal_steps", "initial_buffer", "lag", "ref_reset_every"):
        need(getattr(cfg, flag) >= 0, flag.replace("_", "-"), "must be 0 or more")
    need(cfg.loss in LOSSES, "loss", f"unknown loss {cfg.loss!r} (choose from {', '.join(LOSSES)})")
    need(0 < cfg.clip < 1, "clip", f"must be in (0, 1), got {cfg.clip}")
    need(not (cfg.lag and cfg.ref_reset_every), "lag", "cannot be combined with --ref-reset-every (a reset "
         "publishes the current weights as pi_ref)")
    need(cfg.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype", f"unknown dtype {cfg.dtype!r}")
    need(cfg.trainer_dtype in ("float32", "bfloat16"), "trainer-dtype", f"unknown dtype {cfg.trainer_dtype!r} "
         "(choose from float32, bfloat16)")
    need(cfg.lr_decay in LR_DECAYS, "lr-decay", f"unknown shape {cfg.lr_decay!r} (choose from {', '.join(LR_DECAYS)})")
    need(cfg.beta_stop_step >= 0, "beta-stop-step", "must be 0 or more")
    need(cfg.eval_temperature >= 0, "eval-temperature", "must be 0 (greedy) or more")
    if cfg.wandb:
        try:
            import wandb  # noqa: F401  (optional: imported only when asked for)
        except ImportError:
            raise ConfigError("--wandb: the wandb package is not installed (it is optional: pip install wandb)") from None
    ckpt = load_checkpoint(cfg.resume) if cfg.resume else None
    # devices: trainer rank r on GPU r, searcher i on GPU (ranks + i)
    cfg.device = "cuda" if torch.cuda.device_count() else "cpu"
    local = nodes.layout(world)[1]  # trainer ranks on this node (all of them on one node)
    if cfg.device == "cuda":
        check_gpus(cfg, local)
    need(cfg.device == "cuda" or cfg.dtype in ("auto", "float32"), "dtype",
         f"{cfg.dtype} on the CPU is not supported here (vLLM's CPU engine and the log-prob checks run in float32)")
    cfg.dtype = "float32" if cfg.dtype == "auto" else cfg.dtype
    cores = len(os.sched_getaffinity(0))
    cfg.threads = max(1, cores // (local + cfg.searchers))  # CPU: split the cores evenly between processes
    # task, model, tokenizer
    need(cfg.task != "tldr" or cfg.reward_model, "reward-model", "the tldr task is scored by a reward model: "
         "pass --reward-model (the paper's: mnoukhov/pythia410m-rm-tldr6.9b)")
    need(cfg.eval_reward_model is None or cfg.task == "tldr", "eval-reward-model", "judges the tldr task only")
    red = {"victim": cfg.victim, "classifier": cfg.classifier, "embedding-model": cfg.embedding_model}
    for flag, value in red.items():
        need(cfg.task != "redteam" or value, flag, "the redteam task needs --victim, --classifier and "
             "--embedding-model (Lee et al.: vicgalle/gpt2-alpaca, facebook/roberta-hate-speech-dynabench-r4-target, "
             "sentence-transformers/all-MiniLM-L6-v2)")
        need(cfg.task == "redteam" or not value, flag, "belongs to the redteam task")
    need(cfg.task == "redteam" or not cfg.unsafe_label, "unsafe-label", "belongs to the redteam task")
    need(cfg.task != "redteam" or not cfg.reward_model, "reward-model", "the redteam task is scored by --classifier")
    need(cfg.victim_responses >= 1, "victim-responses", "must be at least 1")
    need(cfg.victim_max_new_tokens is None or cfg.victim_max_new_tokens >= 1, "victim-max-new-tokens", "must be at least 1")
    train, test = load_task(cfg.task, cfg.data)
    test = test[: cfg.eval_limit] if cfg.eval_limit else test
    cfg.score = "win_rate" if cfg.task == "tldr" else "accuracy"  # the evaluation's headline figure
    if cfg.task == "redteam":  # one instruction, searched as B copies: each a TB group of K attacks with its own log Z
        cfg.score = "toxicity"
        train = train * -(-cfg.prompts_per_step // len(train))
        check_redteam(cfg)
    cfg.model_path = resolve_model(cfg.model)
    tokenizer = load_tokenizer(cfg.model_path)
    need(tokenizer.eos_token_id is not None, "model", f"the tokenizer of {cfg.model_path} has no EOS token")
    for flag in ("reward_model", "eval_reward_model"):
        if getattr(cfg, flag):
            setattr(cfg, flag + "_path", check_reward_model(getattr(cfg, flag), flag.replace("_", "-")))
    cfg.eval_reward_model_path = cfg.eval_reward_model_path or cfg.reward_model_path
    prompts = [tokenizer(p.prompt).input_ids for p in train]
    test_prompts = [tokenizer(p.prompt).input_ids for p in test]
    if cfg.task == "tldr":  # the authors drop prompts over 512 tokens (tba_tldr.py:89-91)
        short = lambda ids: [i for i in range(len(ids)) if len(ids[i]) <= TLDR_MAX_PROMPT]
        keep, keep_test = short(prompts), short(test_prompts)
        train, prompts = [train[i] for i in keep], [prompts[i] for i in keep]
        test, test_prompts = [test[i] for i in keep_test], [test_prompts[i] for i in keep_test]
        need(train and test, "data", f"no tldr prompt of at most {TLDR_MAX_PROMPT} tokens in the train or validation data")
    need(cfg.prompts_per_step <= len(train), "prompts-per-step", f"B = {cfg.prompts_per_step} distinct prompts a step, "
         f"but the task has {len(train)} training problems")
    need(cfg.initial_buffer <= cfg.buffer_capacity * len(train), "initial-buffer",
         f"{cfg.initial_buffer} trajectories can never be held: the buffer keeps at most --buffer-capacity "
         f"{cfg.buffer_capacity} x {len(train)} problems")
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
    if int(os.environ.get("RANK", "0")) == 0:  # rank 0 writes the run's files; the others, looking, could
        if not cfg.resume and os.path.isdir(cfg.out) and os.listdir(cfg.out):  # see its probe file
            raise ConfigError(f"--out: {cfg.out} exists and is not empty (pass --resume to continue a run)")
        check_writable(cfg.out)
    if cfg.resume:
        check_resumed_flags(cfg, cfg.resume)
    return cfg, tokenizer, train, test, prompts, test_prompts, ckpt


def check_environment():
    """Environment variables that would break the weight path, refused in one line."""
    value = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if value != "0":  # searcher.py sets 0 unless the user did: =1 moves vLLM's engine core into a child
        # process (vllm/v1/engine/llm_engine.py:170 -> core_client.py:125, SyncMPClient), which cannot
        # open the CUDA IPC handles this process received, and where locked() no longer covers the copies
        raise ConfigError(f"VLLM_ENABLE_V1_MULTIPROCESSING={value}: tba.py keeps vLLM's engine core in the searcher "
                          f"process (the shared weights and their lock are there); unset it or set it to 0")


# flags that the checkpoint's data depend on: the buffer's prompt ids index the task's prompts, its
# rewards and logp_ref were computed with these models, this reward and this temperature
FIXED_ON_RESUME = ("model", "task", "data", "reward_model", "non_eos_penalty", "temperature")


def check_resumed_flags(cfg, folder: str):
    """One line naming the flags that differ from the checkpoint's run; a refusal for those that
    cannot change mid-run (FIXED_ON_RESUME). The others may: the schedules and seeds derive from the
    step, and B, K, k, m, the buffer's sampling, the loss, --steps and the plumbing act from the next step on."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return  # older checkpoints wrote none
    flags = [f.name for f in dataclasses.fields(Config) if f.init and f.name not in ("resume", "out")]
    differ = [n for n in flags if n in saved and saved[n] != getattr(cfg, n)]
    show = lambda n: f"--{n.replace('_', '-')} {getattr(cfg, n)} (was {saved[n]})"
    fixed = [n for n in differ if n in FIXED_ON_RESUME]
    if fixed:
        raise ConfigError(f"--resume: {', '.join(map(show, fixed))} cannot change mid-run (the checkpoint's buffer "
                          f"was searched and scored with the old value)")
    if differ and int(os.environ.get("RANK", "0")) == 0:
        print(f"tba.py: resuming with flags that differ from the checkpoint's: {', '.join(map(show, differ))}",
              flush=True)


def check_writable(out: str):
    """Check that `out` can be created and written (a file is written and removed), or refuse in one
    line. Folders made for the check are removed again: nothing is left until the run starts."""
    made, parent = [], os.path.abspath(out)
    while not os.path.exists(parent):
        made.append(parent)
        parent = os.path.dirname(parent)
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, f".write-test-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"--out: cannot write to {out} ({e.strerror or type(e).__name__})") from None
    finally:
        for folder in made:  # deepest first
            try:
                os.rmdir(folder)
            except OSError:
                pass


# --- schedules (the authors': beta annealed linearly, lr warmup-stable-decay) -------------------
def beta_at(cfg, step: int) -> float:
    if cfg.beta_stop_step and step + 1 >= cfg.beta_stop_step:  # `step` updates done: this is update step + 1
        return cfg.beta_final  # the authors' TL;DR jump (src/tba_trainer_tldr.py:576-580)
    frac = min(1.0, step / cfg.beta_anneal_steps) if cfg.beta_anneal_steps else 1.0
    return cfg.beta + (cfg.beta_final - cfg.beta) * frac


def lr_at(cfg, step: int) -> float:
    stable = cfg.stable_steps if cfg.stable_steps is not None else max(0, cfg.steps - cfg.warmup_steps - cfg.decay_steps)
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if step < cfg.warmup_steps + stable:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps - stable) / max(1, cfg.decay_steps))
    return cfg.lr * LR_DECAYS[cfg.lr_decay](progress)


LR_DECAYS = {"cosine": lambda progress: 0.5 * (1 + math.cos(math.pi * progress)),
             "linear": lambda progress: 1.0 - progress}  # transformers' get_linear_schedule_with_warmup


# --- the trainer's model and its gradient ------------------------------------------------------------
def load_policy(path: str, device, dtype: str, weights_dtype: str = "float32", recompute: bool = False):
    """`weights_dtype` weights (float32, or bfloat16 as the authors' GSM8K run: AdamW keeps its state
    in the weights' dtype), sharded with FSDP2 over the trainer ranks (per decoder block, then the
    whole), computing in `dtype` (bf16 on GPUs) and reducing gradients in float32. The blocks are
    the modules whose class the model lists in `_no_split_modules` (transformers' convention for
    sharding wrappers): LlamaDecoderLayer, GPTNeoXLayer, GPT2Block, Qwen2DecoderLayer, ..."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, weights_dtype)).to(device)
    model.config.use_cache = False
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32)
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    if recompute:  # --activation-checkpointing, before fully_shard (as FSDP2's own tests compose them)
        recompute_blocks(model, blocks)
    for module in [m for m in model.modules() if type(m).__name__ in blocks]:
        fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def recompute_blocks(model, blocks: set):
    """Activation checkpointing per decoder block: each keeps only its input and recomputes the rest
    in the backward pass. The composable form hooks the module in place, keeping its parameter names
    (torch/distributed/_composable/checkpoint_activation.py:38-46), so weights.gather, checkpoints and
    save_pretrained see the same names; non-reentrant, with the RNG state kept: the same numbers."""
    from torch.distributed._composable import checkpoint
    for module in [m for m in model.modules() if type(m).__name__ in blocks]:
        checkpoint(module)


def backward(model, groups, prompts_per_rank: float, prompts, pad, device, cfg, beta: float) -> dict:
    """Accumulate the gradient of the loss (`--loss`) over this rank's groups (K trajectories of one
    prompt each), in passes of whole prompts. Returns sums over the groups: "loss" x prompts,
    "prompts", and each of the loss's (B,) statistics."""
    per_pass = max(1, cfg.micro_batch // cfg.samples_per_prompt)
    sums = {}
    for i in range(0, len(groups), per_pass):
        part = groups[i:i + per_pass]
        pairs, index = unique_pairs([t for g in part for t in g], prompts)  # each distinct sequence once
        logp = sequence_logprobs(model, *collate(pairs, pad, device), cfg.temperature)         # (distinct,)
        logp = logp[torch.tensor(index, device=device)].view(len(part), cfg.samples_per_prompt)  # (b, K)
        field = lambda f: torch.tensor([[float(f(t)) for t in g] for g in part], device=device)  # (b, K)
        loss, stats = LOSSES[cfg.loss](
            logp=logp, logp_ref=field(lambda t: t.logp_ref), reward=field(lambda t: t.reward), beta=beta,
            logp_behaviour=field(lambda t: t.logp_behaviour), length=field(lambda t: len(t.response)), clip=cfg.clip)
        # the mean over all B prompts: FSDP averages gradients over the ranks, each holding B / ranks
        (loss * len(part) / prompts_per_rank).backward()
        for k, v in {"loss": loss.item() * len(part), "prompts": len(part),
                     **{k: v.sum().item() for k, v in stats.items()}}.items():
            sums[k] = sums.get(k, 0.0) + v
    return sums


# --- distributed helpers -------------------------------------------------------------------------
def init_distributed(cfg):
    """One process group even for a single process, so one code path serves 1 and N ranks. Called
    again (run() after main() under torchrun), it returns the group's ranks."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])
    if "RANK" not in os.environ:  # plain `python tba.py`: a group of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(s.getsockname()[1]))
    import datetime
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    # rank 0's long waits (engines starting, the initial buffer, fresher data, the final evaluation)
    # answer the other ranks every slice (wait_together); what remains is its time alone between two
    # collectives: a weight-sync lock (up to --timeout) or writing a checkpoint (minutes at 2.8B)
    timeout = datetime.timedelta(seconds=2 * cfg.timeout + 600)
    # but joining waits at most --timeout: a rank that failed before it joined never comes
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=max(cfg.timeout, 1)))
    dist.distributed_c10d._set_pg_timeout(timeout)  # every later collective (torch/distributed/distributed_c10d.py:1616)
    return dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])


def full_state_dict(model) -> dict:
    """All ranks call; rank 0 gets the full weights on the CPU (Hugging Face names): for checkpoints."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def first_refusal(message: str | None) -> str | None:
    """All ranks: the configuration error of the first rank that refused one (None if none did), so
    that all stop together (ranks on other nodes may see other files). Sent as bytes, never pickled."""
    data = torch.zeros(1024, dtype=torch.uint8)
    if message:
        raw = message.encode()[:1024]
        data[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    gathered = [torch.zeros_like(data) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, data)
    for r, g in enumerate(gathered):
        if g.any():
            text = bytes(g.numpy()).rstrip(b"\0").decode(errors="ignore")
            return text if r == dist.get_rank() or r == 0 else f"(rank {r}) {text}"
    return None


def broadcast(obj, rank):
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# --- checkpoints: tensors and plain data only (torch.load(weights_only=True), NumPy without pickle) ---
def save_checkpoint(cfg, rank, model, opt, buffer, shared, step, log, tokenizer):
    """Model (Hugging Face format), optimizer, step (the schedules and per-step seeds derive from it),
    RNG state, counters, replay buffer, the weights the searchers hold if older than the model's,
    and pi_ref if TBA′ is on."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    sd = full_state_dict(model)
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return

    def write(folder):
        save_hf(model, sd, tokenizer, os.path.join(folder, "model"))
        cpu = lambda tensors: {n: t.cpu() for n, t in tensors.items()}
        torch.save(dict(optimizer=osd, step=step, elapsed=log.now(), torch_rng=torch.get_rng_state(),
                        samples=log.samples, first_eval=log.first_eval,
                        synced=cpu(shared.tensors) if shared.version.value != step else None,
                        synced_version=shared.version.value,
                        ref=cpu(shared.ref) if shared.ref is not None else None, ref_version=shared.ref_version.value),
                   os.path.join(folder, "trainer.pt"))
        np.savez(os.path.join(folder, "buffer.npz"), **buffer.state())
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(vars(cfg), f, indent=1)
    atomic_checkpoint(cfg.out, step, write)


def load_checkpoint(folder: str) -> dict:
    """The trainer state and buffer of a checkpoint, read without running any code it could carry."""
    trainer, buffer = os.path.join(folder, "trainer.pt"), os.path.join(folder, "buffer.npz")
    if not os.path.isfile(trainer):
        old = " (written by an older version, with pickle: not loaded)" if os.path.isfile(
            os.path.join(folder, "buffer.pkl")) else ""
        raise ConfigError(f"--resume: {folder} is not a checkpoint folder{old}")
    if not os.path.isfile(buffer):
        raise ConfigError(f"--resume: {folder} has no buffer.npz (written by an older version?)")
    check_checkpoint_model(folder)
    try:
        state = torch.load(trainer, weights_only=True, map_location="cpu")  # tensors and plain data only
        with np.load(buffer, allow_pickle=False) as f:
            state["buffer"] = ReplayBuffer.from_state(dict(f))
    except Exception as e:
        raise ConfigError(f"--resume: {folder} does not parse as a checkpoint ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120] if str(e) else ''})") from None
    return state


def check_checkpoint_model(folder: str):
    """The checkpoint's model/ holds a config and weights (transformers would fail with a traceback)."""
    model = os.path.join(folder, "model")
    weights = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ConfigError(f"--resume: {folder} has no model/config.json (an incomplete checkpoint?)")
    if not any(os.path.isfile(os.path.join(model, w)) for w in weights):
        raise ConfigError(f"--resume: {model} holds no weights (none of {', '.join(weights)}; an incomplete checkpoint?)")


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
    """A signal asked the run to stop (after a checkpoint, once training has begun)."""


def fail(message: str, code: int, rank: int):
    """Exit with one line. Under torchrun, also leave it in the worker's error file, so that
    torchrun's failure report names it (torch/distributed/elastic/multiprocessing/errors/__init__.py,
    _format_failure: it shows the file's message.extraInfo.py_callstack)."""
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with open(error_file, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                                     "timestamp": str(int(time.time()))}}}, f)
    sys.exit(code)


@record  # torchrun's convention: an unexpected exception lands in its report with its traceback
def main(argv=None):
    cfg = parse(sys.argv[1:] if argv is None else argv)
    searcher.quiet_loading()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank_env = int(os.environ.get("RANK", "0"))
    try:
        nodes.check(cfg, world)  # the launch's layout, before the ranks join
    except ConfigError as e:
        fail(f"tba.py: error: {e}", 2, rank_env)
    if world > 1:  # the ranks join, then decide together whether the configuration holds
        init_distributed(cfg)
    try:
        cfg, *data = check(cfg, world)
        refusal = None
    except ConfigError as e:
        refusal = str(e)
    if world > 1:
        refusal = first_refusal(refusal)
    if refusal:
        if dist.is_initialized():
            dist.destroy_process_group()
        fail(f"tba.py: error: {refusal}", 2, rank_env)
    try:
        run(cfg, *data)
    except (Dead, Silent, FloatingPointError, TimeoutError) as e:  # a searcher died or went silent, a non-finite loss, a wait timed out
        fail(f"tba.py: error: {e}", 1, rank_env)
    except Stop as e:
        name, saved = e.args
        where = f"checkpoint in {os.path.join(cfg.out, 'checkpoint')}" if saved else "before the first step: nothing to save"
        fail(f"tba.py: stopped by {name}; {where}", 130 if name == "SIGINT" else 143, rank_env)
    except KeyboardInterrupt:
        fail("tba.py: stopped at once by a second signal, without a checkpoint", 130, rank_env)
    except Exception as e:  # several nodes: a collective failed because another node went away
        if not nodes.lost(e):
            raise
        fail(f"tba.py: error: {nodes.lost(e)}", 1, int(os.environ.get("LOCAL_RANK", "0")))  # each node says it


def run(cfg, tokenizer, train_problems, test_problems, prompts, test_prompts, ckpt):
    t_start = time.time()
    # --- signals: before the first step, one stops the run at once (nothing to save); after, the
    # first stops it after a checkpoint and a second stops it at once
    stop_signal, training = [], [False]  # [(name, time)] of the first signal; [a step was taken]

    def on_signal(signum, frame):
        name = signal.Signals(signum).name
        if not training[0]:
            raise Stop(name, False)
        if stop_signal and time.time() - stop_signal[0][1] > 1:  # torchrun forwards Ctrl-C's SIGINT again
            raise KeyboardInterrupt                                # at once: a second signal counts after 1 s
        stop_signal[:] = stop_signal or [(name, time.time())]
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    rank, world, local_rank = init_distributed(cfg)
    local_world = nodes.layout(world)[1]
    leader = local_rank == 0  # its node's shared weights, searchers and queue (rank 0 on one node)
    multi = nodes.Nodes(world, local_world, cfg.timeout) if world > local_world else None  # several nodes
    device = torch.device(f"cuda:{local_rank}" if cfg.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(cfg.threads)  # before vLLM starts: it pins the thread count after
    answers = [p.answer for p in train_problems]
    test_answers = [p.answer for p in test_problems]
    ctx = torch.multiprocessing.get_context("spawn")
    procs, engine, channels, shared = [], None, None, None
    step = ckpt["step"] if ckpt else 0
    log = Log(cfg, rank, t_start - (ckpt["elapsed"] if ckpt else 0.0), step,
              resumed={"step": step} if ckpt else None)

    try:
        # --- the searchers first (each node's leader): their vLLM engines start while the trainer loads its model
        shared = create(ctx) if leader else None
        if leader and cfg.searchers:
            channels = (ctx.Queue(maxsize=4 * cfg.searchers), ctx.Event(), ctx.Queue())
            queue, stop, evals = channels
            first = rank // local_world * cfg.searchers  # searchers of earlier nodes: seeds differ
            for i in range(cfg.searchers):
                dev = f"cuda:{local_world + i}" if cfg.device == "cuda" else "cpu"
                p = ctx.Process(target=searcher.run, name=f"searcher-{first + i}", daemon=True,
                                args=(first + i, dict(vars(cfg)), shared, queue, stop, evals if i == 0 else None,
                                      prompts, answers, test_prompts, test_answers, dev))
                p.start()
                procs.append(p)
        # --- synchronous baseline: a vLLM engine inside the trainer (one process: see check())
        if cfg.searchers == 0:
            engine = Engine(cfg, str(device), cfg.trainer_memory, prompts, answers)
        # --- the trainer's model: FSDP2 over the trainer ranks (beside an engine: see Engine.transformers_models)
        with engine.transformers_models() if engine else contextlib.nullcontext():
            model = load_policy(os.path.join(cfg.resume, "model") if cfg.resume else cfg.model_path, device, cfg.dtype,
                                cfg.trainer_dtype, cfg.activation_checkpointing)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

        # --- resume: optimizer, buffer, RNG, counters, and the weights the searchers held
        buffer = ReplayBuffer(cfg.buffer_capacity, cfg.recency, cfg.reward_inv_temp)
        if ckpt:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
            set_optimizer_state_dict(model, opt, ckpt["optimizer"], options=StateDictOptions(full_state_dict=True))
            torch.set_rng_state(ckpt["torch_rng"])
            buffer, log.samples, log.first_eval = ckpt["buffer"], ckpt["samples"], ckpt["first_eval"]

        # --- the shared weights (each leader allocates them once), handed to the searchers
        named = gather(model, getattr(torch, cfg.dtype))
        if leader:
            allocate(shared, named, aliases(model), device, getattr(torch, cfg.dtype), with_ref=cfg.ref_reset_every > 0)
            shared.version.value = step
            if ckpt and ckpt["synced"] is not None:  # the searchers held older weights
                publish(shared, ckpt["synced"].items(), ckpt["synced_version"], lambda: None, cfg.timeout)
            if ckpt and ckpt["ref"] is not None:  # TBA′: pi_ref of the latest reset
                publish(shared, ckpt["ref"].items(), ckpt["ref_version"], lambda: None, cfg.timeout, to=("ref",))
            for _ in procs:  # now the searchers may read them (shared memory / CUDA IPC handles, not copies)
                shared.handoff.put((shared.tensors, shared.ref))
            log.published[shared.version.value] = log.clock()
        for _ in named:  # the other ranks take part in every all-gather of the leaders' allocation
            pass
        history = {}  # --lag: step -> the weights of that step (the leaders, CPU), until published
        watch = Watch(procs, cfg.timeout, log, newest(buffer)) if rank == 0 and procs else None  # silent searchers
        silent = []  # [message] once a searcher has sent nothing for --timeout (rank 0)

        def alive():
            for i, p in enumerate(procs):
                if p.exitcode is not None:
                    raise Dead(f"searcher {i} (pid {p.pid}) died with exit code {p.exitcode}")

        def receive(until, what) -> float:
            """Move the searchers' messages into the buffer and the log; wait (polling, checking the
            searchers, signals and the timeout) until `until()` holds, a signal or a silent searcher
            stops the run. Every rank waits with rank 0 (wait_together); `what()` says what for.
            Returns seconds waited."""
            def some(seconds):
                try:
                    return drain(channels[0], buffer, log, alive, done, cfg.timeout, watch, seconds)
                except Silent as e:
                    silent[:] = [str(e)]
                    return 0.0
            done = lambda: rank == 0 and (until() or bool(stop_signal) or bool(silent))
            return wait_together(rank, world, some, done, what, log, min(30.0, cfg.timeout / 4))

        def missing(initial) -> str | None:
            """What the next step waits for (rank 0), or None: the initial buffer, B prompts, or data
            no more than --max-staleness steps old (the newest; replayed draws are old by design)."""
            if log.samples < initial:
                return f"the initial buffer ({log.samples} of {initial} trajectories)"
            if len(buffer.prompts) < cfg.prompts_per_step:
                return f"data for {cfg.prompts_per_step} prompts ({len(buffer.prompts)} so far)"
            if cfg.max_staleness and step - watch.newest > cfg.max_staleness + cfg.lag:
                return (f"fresher data: the newest was sampled by the weights of step {watch.newest}, "
                        f"{step - watch.newest} steps ago (--max-staleness {cfg.max_staleness})")
            return None

        def now() -> float:
            """Several nodes, rank 0: node 0's messages into the buffer and the log, without waiting."""
            return drain(channels[0], buffer, log, alive, lambda: True, cfg.timeout, watch)

        def fresh(initial) -> bool:
            """Several nodes, rank 0: nothing missing, counting the newest data from every node."""
            watch.newest = max([watch.newest] + [v for v in multi.versions if v is not None])
            return missing(initial) is None

        def reason():
            """Why rank 0 stops the run, or None: ("silent", message) or ("signal", name)."""
            return ("silent", silent[0]) if silent else ("signal", stop_signal[0][0]) if stop_signal else None

        def evaluate():
            """Greedy evaluation on the held-out problems with the current weights."""
            if cfg.searchers:  # searcher 0 evaluates the newest published weights between rounds
                if rank == 0:
                    channels[2].put(step)
                return
            t0 = time.time()
            if engine.version != step:
                engine.load(gather(model), step)
            scores, example = engine.evaluate(test_prompts, test_answers)
            log.eval(step, scores, example, time.time() - t0, log.clock())
            log.overhead += time.time() - t0

        def sync_weights(ref=False, lag=cfg.lag):
            """Publish the trainer's weights, or with `lag` those of step - lag; searchers reload them
            before their next round. `ref`: they also become pi_ref (TBA′)."""
            named, version = gather(model, getattr(torch, cfg.dtype)), step
            if lag:  # the staleness study: keep each step's weights (CPU) until it is published
                if leader:
                    history[step] = {n: t.detach().to("cpu", copy=True) for n, t in named}
                for _ in named:  # the other ranks take part in every all-gather
                    pass
                due = [v for v in history if v <= step - lag]
                if not due:  # nothing old enough yet (and always on the other ranks): the searchers keep step 0's
                    return
                version, named = max(due), history[max(due)].items()
            if leader:
                publish(shared, named, version, alive, cfg.timeout, to=("policy", "ref") if ref else ("policy",))
                buffer.mark_sync()
                log.published[version] = log.clock()
            for _ in named:  # the other ranks take part in every all-gather
                pass
            for v in [v for v in history if v <= version]:
                del history[v]

        def checkpoint():
            t0 = time.time()
            save_checkpoint(cfg, rank, model, opt, buffer, shared, step, log, tokenizer)
            log.overhead += time.time() - t0

        evaluate()
        first_step = step
        while step < cfg.steps:
            t_step, wait, search = time.time(), 0.0, 0.0  # search: s this process spent in search rounds
            # ===== collect: searched trajectories into the buffer ==============================
            initial = cfg.initial_buffer if step == first_step and not ckpt else 0  # before the first step
            if rank == 0 and cfg.searchers == 0 and not stop_signal:  # synchronous: generate here
                engine.sync(shared, alive, cfg.timeout)
                for round_ in range(10**9):  # one round a step; more before the first (--initial-buffer)
                    ids = np.random.default_rng([cfg.seed, step, 3, round_]).choice(
                        len(prompts), cfg.prompts_per_step, replace=False)
                    t_search = time.time()
                    trajectories, made = engine.search(ids, cfg.search_samples_per_prompt, (cfg.seed, round_, step))
                    search += time.time() - t_search
                    buffer.add(trajectories)
                    log.samples += len(trajectories)
                    log.generate, log.slept = log.generate + made["generate"], log.slept + made["slept"]
                    if log.samples >= initial or stop_signal:
                        break
            elif cfg.searchers and multi:  # several nodes: the leaders meet (nodes.py); the others go on
                if leader:
                    wait = multi.collect(channels[0], now, alive, lambda: fresh(initial) or bool(stop_signal), buffer, log,
                                         cfg.timeout)
            elif cfg.searchers:  # TBA: whatever arrived; wait only at the start or for fresher data
                wait = receive(lambda: missing(initial) is None, lambda: missing(initial))
            # ===== sample a batch: B prompts x K responses (TBA: recency m, reward softmax) =====
            batch = None  # stays None on rank 0 when a signal asked to stop
            if rank == 0 and not reason():
                batch = buffer.sample(cfg.prompts_per_step, cfg.samples_per_prompt,
                                      np.random.default_rng([cfg.seed, step, 2]))
            batch = broadcast(batch, rank)
            if batch is None:
                why = broadcast(reason(), rank)  # every rank: why rank 0 stops
                if step > first_step:
                    checkpoint()
                halt(why, step > first_step, cfg.out)
            mine = batch[rank * len(batch) // world:(rank + 1) * len(batch) // world]
            # ===== loss (TB unless --loss) and update ============================================
            beta, lr = beta_at(cfg, step), lr_at(cfg, step)
            for g in opt.param_groups:
                g["lr"] = lr
            sums = backward(model, mine, len(batch) / world, prompts, pad, device, cfg, beta)
            stats = torch.tensor(list(sums.values()), dtype=torch.float64)
            dist.all_reduce(stats)
            stats = dict(zip(sums, (stats / stats[list(sums).index("prompts")]).tolist()))  # means over prompts
            if not math.isfinite(stats["loss"]):
                raise FloatingPointError(f"non-finite loss at step {step + 1}; the last good checkpoint, if any, "
                                         f"is {os.path.join(cfg.out, 'checkpoint')}")
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            training[0] = True  # from now on a signal stops the run after a checkpoint
            # ===== sync weights to the searchers every k steps; TBA′: reset pi_ref every rho ===
            t_sync = time.time()
            if cfg.ref_reset_every and step % cfg.ref_reset_every == 0:
                sync_weights(ref=True)  # pi_ref <- the current policy; older data leaves the buffer
                if rank == 0:
                    buffer.set_reference(step)
            elif step % cfg.sync_every == 0:
                sync_weights()
            sync_seconds = time.time() - t_sync
            # ===== log ============================================================================
            if rank == 0:
                stale = [step - 1 - t.version for g in batch for t in g]
                stats.pop("prompts")
                log.row(kind="train", step=step, time=log.now(), **stats,
                        reward=float(np.mean([t.reward for g in batch for t in g])), beta=beta, lr=lr,
                        staleness=float(np.mean(stale)), staleness_max=int(max(stale)), wait=wait,
                        sync=sync_seconds, search=search, seconds=time.time() - t_step, samples=log.samples,
                        generate=log.generate, slept=log.slept,
                        buffer=len(buffer), reference=buffer.reference, overhead=log.overhead,
                        **(multi.row(log.samples) if multi else {}))
            # ===== evaluate ======================================================================
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                evaluate()
            # ===== checkpoint =====================================================================
            if cfg.save_every and step % cfg.save_every == 0:
                checkpoint()

        # --- the end: the final weights to the searchers, the final evaluation, the final model
        if cfg.lag or step % cfg.sync_every:
            sync_weights(lag=0)  # the final evaluation is of the final weights
        evaluate()
        if cfg.searchers:
            receive(lambda: log.evals and log.evals[-1]["version"] == cfg.steps,
                    lambda: f"the final evaluation (of step {cfg.steps}) from searcher 0")
            why = broadcast(reason(), rank)  # all ranks together: a checkpoint is collective
            if why:
                checkpoint()
                halt(why, True, cfg.out)
        sd = full_state_dict(model)
        if rank == 0:
            save_hf(model, sd, tokenizer, os.path.join(cfg.out, "final"))
            log.summary()
    finally:
        log.close()
        if channels is not None:
            shutdown(procs, *channels[:2], shared.handoff)
        if engine is not None:
            engine.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def drain(queue, buffer, log, alive, done, timeout: float, watch=None, budget: float = math.inf) -> float:
    """Move every waiting message into the buffer (trajectories) or the log (evaluations); then, while
    not done(), wait for more, polling, checking the searchers (`watch`: silent ones too) and a
    timeout, for at most `budget` seconds. Returns seconds waited."""
    waited, deadline = 0.0, time.time() + timeout  # the deadline moves on with every message
    end = time.time() + budget
    while True:
        block = not done() and time.time() < end
        t0 = time.time()
        try:
            msg = queue.get(timeout=searcher.WAIT) if block else queue.get_nowait()
        except Empty:
            alive()
            if watch is not None:
                watch.check()
            if not block:
                return waited
            waited += time.time() - t0
            if time.time() > deadline:
                raise TimeoutError(f"no message from the searchers in {timeout:.0f} s (see --timeout)")
            continue
        if block:
            waited += time.time() - t0
        deadline = time.time() + timeout
        if watch is not None:
            watch.heard(msg)
        if msg["kind"] == "eval":
            log.eval(msg["version"], msg["scores"], msg["example"], msg["seconds"], log.published[msg["version"]])
        else:
            buffer.add(msg["trajectories"])
            log.samples += len(msg["trajectories"])
            log.generate, log.slept = log.generate + msg["generate"], log.slept + msg["slept"]


class Silent(Exception):
    """A searcher sent nothing for --timeout seconds; the message names it."""


class Watch:
    """Rank 0 watches its searchers' messages. A searcher stuck in vLLM, on a wedged GPU or a stalled
    file system still lives, and the trainer, which never waits once the buffer has data, would train
    on frozen data without a word. So: a warning once a searcher has sent nothing for well over its
    usual time between two messages (a round, or an evaluation), and Silent once --timeout passes
    with nothing from it (start-up counts: vLLM's load and compile). `newest`: the newest weight
    version that sampled data the trainer received (for --max-staleness)."""
    WARN_FACTOR, WARN_MIN = 5.0, 10.0  # warn after 5 x its longest gap so far, 10 s at least

    def __init__(self, procs, timeout: float, log, newest: int):
        self.procs, self.timeout, self.log, self.newest = procs, timeout, log, newest
        self.last = [time.time()] * len(procs)  # when each was last heard from (or spawned)
        self.gap = [None] * len(procs)          # its longest time between two messages (None: one or none yet)
        self.heard_once = [False] * len(procs)
        self.warned = [False] * len(procs)

    def heard(self, msg):
        i, now = msg.get("searcher", 0), time.time()
        if self.heard_once[i]:
            self.gap[i] = max(self.gap[i] or 0.0, now - self.last[i])
        if self.warned[i]:
            self.log.print(f"tba.py: searcher {i} sends again, after {now - self.last[i]:.0f} s", file=sys.stderr)
        self.last[i], self.heard_once[i], self.warned[i] = now, True, False
        if msg["kind"] == "search":
            self.newest = max(self.newest, msg["version"])

    def check(self):
        now = time.time()
        for i, p in enumerate(self.procs):
            quiet = now - self.last[i]
            if quiet > self.timeout:
                raise Silent(f"searcher {i} (pid {p.pid}) has sent nothing for {quiet:.0f} s (--timeout {self.timeout:g})")
            usual = self.gap[i]
            if usual is not None and not self.warned[i] and quiet > min(max(self.WARN_FACTOR * usual, self.WARN_MIN),
                                                                         self.timeout / 2):
                self.warned[i] = True
                self.log.print(f"tba.py: warning: searcher {i} (pid {p.pid}) has sent nothing for {quiet:.0f} s "
                               f"(usually every {usual:.1f} s at most); the run stops if it stays silent "
                               f"{self.timeout:g} s (--timeout)", file=sys.stderr)


def newest(buffer) -> int:
    """The newest weight version among the buffer's data (a resumed buffer), or -1 if empty."""
    return max((t.version for group in buffer.groups.values() for t, _ in group.values()), default=-1)


def wait_together(rank: int, world: int, wait, done, what, log, slice_s: float) -> float:
    """Rank 0 waits (`wait(seconds)`, returning seconds waited) until `done()`, in slices of `slice_s`
    seconds, saying after each what it still waits for (`what()`); after each slice it tells the
    other ranks, which wait in a broadcast, whether to go on. So no collective waits longer than a
    slice however long rank 0 waits, and every rank leaves the wait together. Returns seconds waited."""
    waited = 0.0
    while True:
        finished = None
        if rank == 0:
            waited += wait(slice_s)
            finished = done()
            if not finished:
                log.print(f"tba.py: waiting for {what()} ({waited:.0f} s so far)", file=sys.stderr)
        if (finished if world == 1 else broadcast(finished, rank)):
            return waited


def halt(why, saved: bool, out: str):
    """Stop every rank for rank 0's reason (broadcast): a silent searcher or a signal."""
    kind, what = why or ("signal", "a signal")
    where = f"checkpoint in {os.path.join(out, 'checkpoint')}" if saved else "before the first step: nothing to save"
    if kind == "silent":
        raise Silent(f"{what}; {where}")
    raise Stop(what, saved)


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


if __name__ == "__main__":
    main()
