"""The run's configuration: one typed Config whose field helps are `--help`, the parsing of the
command line, the checks, and the schedules that derive from it.

`check` refuses bad input in one line naming the flag (ConfigError; tba.py exits with status 2)
before anything is spawned or written: values out of range, flags of another task, a model folder
without weights or tokenizer, a reward model with more than one output, a batch the data cannot
fill, a context too short for prompt + response, GPU settings a spawned process would fail on
(too few GPUs, bf16 below compute capability 8.0, EXCLUSIVE_PROCESS mode), an --out that exists or
cannot be written, and a --resume whose checkpoint is incomplete or whose run used other values of
the flags that cannot change mid-run. It also fills in the derived values (paths, devices, dtype,
threads, the longest sequence) once, so that the rest of the code reads them from `cfg`.
"""

import dataclasses
import math
import time
import os
import typing
from dataclasses import dataclass, field

import torch

from runtime import nodes
from runtime import vllm_env
from runtime.checkpoint import check_resumed_flags, load_checkpoint
from runtime.errors import ConfigError
from runtime.hub import load_tokenizer, resolve_model
from runtime.log import check_out
from loss import LOSSES
from rewards import check_reward_model
from tasks import TASKS, Data


MAX_REUSE = 1.0  # --max-reuse's default with searchers (docs/performance.md, part 9)


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
    prompts_per_step: int = arg(32, "B: prompts per training batch")
    round_prompts: int | None = arg(None, "prompts per search round of a searcher (default: B / N rounded up, N the "
                                          "searchers of all nodes: their rounds together make one batch; the "
                                          "authors' GSM8K: 3 = 7 / 3 rounded up)")
    samples_per_prompt: int = arg(8, "K: responses per prompt in a training batch (the TB loss's log Z is over them)")
    search_samples_per_prompt: int | None = arg(None, "responses a searcher draws per prompt (>= K; default K)")
    sync_every: int = arg(1, "k: trainer steps between weight syncs to the searchers (the toy: every step, for "
                             "fresher data; the authors' GSM8K: 2)")
    recency: float = arg(0.95, "m: probability that a batch prompt comes from the data added since the last sync")
    reward_inv_temp: float = arg(0.0, "inverse temperature of the reward softmax for draws from the whole buffer; "
                                      "0 = uniform")
    buffer_capacity: int = arg(100, "trajectories kept per prompt (see --buffer-keep)")
    buffer_keep: str = arg("newest", "what the buffer keeps per prompt for draws by reward: newest (TBA's) | best "
                                     "(the highest log R = log pi_ref + r / beta, near-duplicates merged into the "
                                     "better one: Lee et al.'s red-teaming buffer); recent draws are the same in both")
    dedup_similarity: float = arg(0.0, "--buffer-keep best: two attacks whose --embedding-model embeddings have a "
                                       "cosine similarity above this are near-duplicates (Lee et al., Llama victims: "
                                       "0.4); 0 = not by embedding")
    dedup_edit: float = arg(0.0, "--buffer-keep best: two responses whose token edit distance is below this x "
                                 "their summed lengths are near-duplicates (Lee et al., GPT-2: 0.25); 0 = not by edit "
                                 "distance; with both 0 only exact duplicates are")
    initial_buffer: int = arg(0, "trajectories that must have arrived before the first training step")
    beta: float = arg(0.05, "KL coefficient: target pi_ref * exp(reward / beta)")
    beta_final: float | None = arg(None, "beta at the end of the anneal (default: --beta, no anneal)")
    beta_anneal_steps: int = arg(0, "steps of the linear anneal from --beta to --beta-final")
    beta_stop_step: int = arg(0, "from this step (update) on, beta is --beta-final at once, cutting the anneal "
                                 "short (the authors' TL;DR: 32 of a 128-step anneal); 0 = never")
    reward_temp: float = arg(1.0, "T_R at step 0, annealed linearly to 1: TB's log R = (log pi_ref / gamma + r / "
                                  "beta) / T_R (Lee et al.: 2 over 500 steps); 1 = off")
    reward_temp_anneal_steps: int = arg(0, "steps of the anneal of T_R from --reward-temp to 1")
    gamma_final: float = arg(1.0, "gamma, the prior's temperature in log R, annealed linearly from 1 to this (Lee et "
                                  "al.: 1.2 over 2,000 steps for Llama victims, 1 for GPT-2); 1 = off")
    gamma_anneal_steps: int = arg(0, "steps of the anneal of gamma from 1 to --gamma-final")
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
    weight_decay: float = arg(0.0, "AdamW's decoupled weight decay (Lee et al.'s red-teaming: torch's default 0.01)")
    lora_rank: int = arg(0, "train a LoRA adapter of this rank on peft's default target modules instead of all "
                            "weights (lora.py; Lee et al.: 32); 0 = all weights")
    lora_alpha: int = arg(16, "LoRA's alpha: the update is (alpha / rank) B A (Lee et al.: 16)")
    lr_decay: str = arg("cosine", "shape of the decay to 0 over --decay-steps: cosine | linear (transformers' "
                                  "default, the authors' TL;DR)")
    trainer_dtype: str = arg("float32", "the trainer's weights: float32 (master weights, computing in --dtype) | "
                                        "bfloat16 (as the authors' GSM8K run: small updates round away); AdamW's "
                                        "moments are float32 either way")
    micro_batch: int = arg(256, "sequences per forward/backward pass (whole prompts: at least K)")
    activation_checkpointing: bool = arg(False, "recompute each decoder block's activations in the backward pass "
                                                "instead of keeping them (less memory, about 1/3 more compute; "
                                                "the same numbers)")
    # --- sampling and evaluation
    temperature: float = arg(1.0, "sampling temperature; log-probs come from logits / temperature")
    explore_temp_min: float = arg(0.0, "exploration: half of a searcher's requests sample at a temperature drawn "
                                       "uniformly from [this, --explore-temp-max] instead of --temperature (log-probs "
                                       "stay at --temperature; Lee et al.: 0.5 to 2); 0 = off")
    explore_temp_max: float = arg(0.0, "the top of the exploration temperatures")
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
    max_reuse: float | None = arg(None, "R: the trainer takes a step only while the trajectories it has drawn for "
                                        "training stay within R times those it has received, over the run (it "
                                        "waits for data otherwise); 0 = no cap; default: 1 with searchers, "
                                        "none with --searchers 0 (every step searches its own)")
    max_staleness: int = arg(100, "S: the trainer waits (polling) while the newest data received was sampled by "
                                  "weights more than S (+ --lag) steps old; 0 = no bound")
    dtype: str = arg("auto", "float32 | bfloat16 | float16 | auto (bfloat16 on GPUs that have it, float16 on "
                             "older GPUs, float32 on the CPU)")
    searcher_memory: float | None = arg(None, "GPU: fraction of a searcher GPU's memory for its vLLM engine(s) "
                                              "(redteam: the attacker's, the victim's and the judge's, split from "
                                              "the models' sizes); default: what the models the searcher loads "
                                              "beside them leave (pi_ref, reward models, the evaluation's), "
                                              "computed from their sizes, at most 0.9")
    trainer_memory: float = arg(0.2, "GPU, --searchers 0: fraction of the trainer GPU's memory for its vLLM engine")
    # --- emulation (tools/bench.py part 9): the regime TBA is for, on a machine that is not in it
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


def parse(argv, description: str = "") -> Config:
    import argparse

    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
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
def need(ok, flag: str, msg: str):
    """Refuse in one line naming the flag unless `ok`."""
    if not ok:
        raise ConfigError(f"--{flag}: {msg}")


def check(cfg: Config, world: int):
    """Validate flags and data; fill in derived values.
    Returns (cfg, Data, checkpoint or None)."""
    need(0 <= cfg.recency <= 1, "recency", f"must be in [0, 1], got {cfg.recency}")
    need(cfg.samples_per_prompt >= 2, "samples-per-prompt", f"K must be at least 2 (log Z is a mean over K), got {cfg.samples_per_prompt}")
    if cfg.search_samples_per_prompt is None:  # not given: K (an explicit 0 is refused below, not taken as K)
        cfg.search_samples_per_prompt = cfg.samples_per_prompt
    need(cfg.search_samples_per_prompt >= cfg.samples_per_prompt, "search-samples-per-prompt",
         f"must be at least K = {cfg.samples_per_prompt}, got {cfg.search_samples_per_prompt}")
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
    for flag in ("searcher_memory", "trainer_memory"):
        need(getattr(cfg, flag) is None or 0 < getattr(cfg, flag) < 1, flag.replace("_", "-"),
             f"must be a fraction in (0, 1), got {getattr(cfg, flag)}")
    need(cfg.generation_slowdown >= 1, "generation-slowdown", f"must be 1 (off) or more, got {cfg.generation_slowdown}")
    need(cfg.max_staleness >= 0, "max-staleness", "must be 0 (no bound) or more")
    need(cfg.max_reuse is None or cfg.max_reuse >= 0, "max-reuse", f"must be 0 (no cap) or more, got {cfg.max_reuse}")
    need(not (cfg.max_reuse and cfg.searchers == 0), "max-reuse", "caps the asynchronous trainer's replay; with "
         "--searchers 0 every step searches its own data")
    cfg.max_reuse = (MAX_REUSE if cfg.searchers else 0.0) if cfg.max_reuse is None else cfg.max_reuse
    need(cfg.round_prompts is None or cfg.round_prompts >= 1, "round-prompts", f"must be at least 1, got {cfg.round_prompts}")
    need(cfg.round_prompts is None or cfg.searchers, "round-prompts", "sizes a searcher's round; with --searchers 0 "
         "the trainer searches B prompts before each step")
    # N searchers' rounds of B / N prompts together make one batch: its data comes from weights about as
    # fresh whatever N (rounds of B each, 4 searchers fed steps from data 5-7 steps stale: docs/performance.md)
    every = cfg.searchers * nodes.layout(world)[0]
    if cfg.searchers and cfg.round_prompts is None:  # synchronous: none (the trainer searches B prompts a step)
        cfg.round_prompts = -(-cfg.prompts_per_step // every)
    check_recipe(cfg)
    vllm_env.check()
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
        from runtime import processes  # the GPU checks sit beside the processes they guard
        processes.check_gpus(cfg, local)
    need(cfg.device == "cuda" or cfg.dtype in ("auto", "float32"), "dtype",
         f"{cfg.dtype} on the CPU is not supported here (vLLM's CPU engine and the log-prob checks run in float32)")
    cfg.dtype = "float32" if cfg.dtype == "auto" else cfg.dtype
    cores = len(os.sched_getaffinity(0))
    cfg.threads = max(1, cores // (local + cfg.searchers))  # CPU: split the cores evenly between processes
    tokenizer, train, test, prompts, test_prompts = check_task(cfg)
    need(cfg.micro_batch >= cfg.samples_per_prompt, "micro-batch", "must hold at least one prompt's K sequences")
    if cfg.device == "cuda":
        processes.check_memory(cfg, local)
    cfg.out = cfg.out or (os.path.dirname(os.path.abspath(cfg.resume)) if cfg.resume
                          else os.path.join("runs", time.strftime("%Y%m%d-%H%M%S") + f"-{cfg.task}-s{cfg.searchers}"))
    if int(os.environ.get("RANK", "0")) == 0:  # rank 0 writes the run's files; the others, looking, could
        check_out(cfg.out, cfg.resume)            # see its probe file
    if cfg.resume:
        check_resumed_flags(cfg, cfg.resume)
    return cfg, Data(prompts, [p.answer for p in train], test_prompts, [p.answer for p in test]), ckpt


def check_recipe(cfg: Config):
    """The buffer's keeping, LoRA, weight decay, the reward's temperatures and the exploration's."""
    need(cfg.buffer_keep in ("newest", "best"), "buffer-keep", f"unknown {cfg.buffer_keep!r} (choose from newest, best)")
    for flag in ("dedup_similarity", "dedup_edit"):
        value, name = getattr(cfg, flag), flag.replace("_", "-")
        need(0 <= value <= 1, name, f"must be in [0, 1], got {value}")
        need(value == 0 or cfg.buffer_keep == "best", name, "merges near-duplicates in the best buffer: pass "
             "--buffer-keep best")
    need(cfg.dedup_similarity == 0 or cfg.embedding_model, "dedup-similarity", "compares --embedding-model "
         "embeddings: the redteam task only (--dedup-edit compares tokens, for any task)")
    need(cfg.lora_rank >= 0, "lora-rank", f"must be 0 (all weights) or more, got {cfg.lora_rank}")
    need(cfg.lora_alpha > 0, "lora-alpha", f"must be positive, got {cfg.lora_alpha}")
    if cfg.lora_rank:
        try:
            import peft  # noqa: F401  (needed only with --lora-rank)
        except ImportError:
            raise ConfigError("--lora-rank: the peft package is not installed (pip install peft)") from None
    need(cfg.weight_decay >= 0, "weight-decay", f"must be 0 or more, got {cfg.weight_decay}")
    need(cfg.reward_temp > 0, "reward-temp", f"must be positive, got {cfg.reward_temp}")
    need(cfg.gamma_final > 0, "gamma-final", f"must be positive, got {cfg.gamma_final}")
    need(cfg.loss == "tb" or (cfg.reward_temp == 1 and cfg.gamma_final == 1), "reward-temp",
         f"T_R and gamma shape TB's log R; --loss {cfg.loss} has none (leave --reward-temp and --gamma-final at 1)")
    for flag in ("reward_temp_anneal_steps", "gamma_anneal_steps"):
        need(getattr(cfg, flag) >= 0, flag.replace("_", "-"), "must be 0 or more")
    low, high = cfg.explore_temp_min, cfg.explore_temp_max
    need(low == high == 0 or 0 < low <= high, "explore-temp-min", f"the exploration temperatures need 0 < "
         f"--explore-temp-min <= --explore-temp-max (both 0 = off), got {low} and {high}")


def check_task(cfg: Config):
    """The task's flags (its entry of tasks.TASKS), data, model and tokenizer (and reward models); fills in
    their paths, the evaluation's headline score and the longest sequence.
    Returns (tokenizer, train, test, prompt ids, test prompt ids)."""
    from transformers import AutoConfig

    need(cfg.task in TASKS, "task", f"unknown task {cfg.task!r} (choose from {', '.join(TASKS)})")
    task = TASKS[cfg.task]
    for name, other in TASKS.items():
        for flag in other.flags:
            need(name == cfg.task or not getattr(cfg, flag), flag.replace("_", "-"), f"belongs to the {name} task")
    task.check(cfg)
    need(cfg.victim_responses >= 1, "victim-responses", "must be at least 1")
    need(cfg.victim_max_new_tokens is None or cfg.victim_max_new_tokens >= 1, "victim-max-new-tokens", "must be at least 1")
    train, test = task.load(cfg.data)
    test = test[: cfg.eval_limit] if cfg.eval_limit else test
    cfg.score = task.score
    train = train * -(-cfg.prompts_per_step // len(train)) if task.fill else train
    if cfg.model == "tiny":
        from runtime import tiny
        cfg.model_path = tiny.cached()
    else:
        cfg.model_path = resolve_model(cfg.model)
    tokenizer = load_tokenizer(cfg.model_path)
    need(tokenizer.eos_token_id is not None, "model", f"the tokenizer of {cfg.model_path} has no EOS token")
    for flag in ("reward_model", "eval_reward_model"):
        if getattr(cfg, flag):
            setattr(cfg, flag + "_path", check_reward_model(getattr(cfg, flag), flag.replace("_", "-")))
    cfg.eval_reward_model_path = cfg.eval_reward_model_path or cfg.reward_model_path
    prompts = [tokenizer(p.prompt).input_ids for p in train]
    test_prompts = [tokenizer(p.prompt).input_ids for p in test]
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
    context = getattr(AutoConfig.from_pretrained(cfg.model_path), "max_position_embeddings", None)
    cfg.max_model_len = longest + cfg.max_new_tokens
    if context:
        need(cfg.max_model_len <= context, "max-new-tokens",
             f"{cfg.max_new_tokens} new tokens + the longest prompt's {longest} tokens = {cfg.max_model_len} "
             f"exceeds the model's context of {context} tokens")
    return tokenizer, train, test, prompts, test_prompts


# --- schedules (the authors': beta annealed linearly, lr warmup-stable-decay; Lee et al.'s T_R and gamma) ---
def beta_at(cfg, step: int) -> float:
    if cfg.beta_stop_step and step + 1 >= cfg.beta_stop_step:  # `step` updates done: this is update step + 1
        return cfg.beta_final  # the authors' TL;DR jump (src/tba_trainer_tldr.py:576-580)
    frac = min(1.0, step / cfg.beta_anneal_steps) if cfg.beta_anneal_steps else 1.0
    return cfg.beta + (cfg.beta_final - cfg.beta) * frac


def reward_temp_at(cfg, step: int) -> float:
    """T_R: --reward-temp at step 0, then linearly to 1 (Lee et al.'s get_total_reward_temp,
    trainers/gfn_trainer.py:253-258; their steps count from 1, ours from 0 like beta_at's)."""
    frac = min(1.0, step / cfg.reward_temp_anneal_steps) if cfg.reward_temp_anneal_steps else 1.0
    return cfg.reward_temp + (1.0 - cfg.reward_temp) * frac


def gamma_at(cfg, step: int) -> float:
    """gamma: 1 at step 0, then linearly to --gamma-final (their get_lm_reward_temp, gfn_trainer.py:260-264)."""
    frac = min(1.0, step / cfg.gamma_anneal_steps) if cfg.gamma_anneal_steps else 1.0
    return 1.0 + (cfg.gamma_final - 1.0) * frac


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
