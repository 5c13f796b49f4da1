"""Every flag of a run: one flat, typed, frozen `Config`, whose fields' helps are `--help`, in four sections
(`Config.SECTIONS`): the paper's knobs, the tasks and recipes (a task's own flags are named by its entry:
tasks/task.py), the plumbing, and the experiment knobs. runtime/checks.py parses the command line into it,
checks it and returns a new one with the derived values (the last fields) filled in; nothing writes to it
after that. Where a default comes from (the paper, the authors' code, Lee et al.'s): docs/departures.md.
"""

from dataclasses import dataclass, field
from typing import ClassVar


def arg(default, help: str, **more):
    """A flag: its default and one-line help (`--help`). `choices`: the only values it takes (anything else is
    refused in one line, runtime.checks); `loss=True`: a loss's own knob, refused with a loss whose `flags` do
    not name it (runtime.checks.acts_only); `fixed=True`: it changes what the data already searched means (its
    rewards, pi_ref's log-probs, what the buffer keeps), so a --resume that changes it is refused
    (runtime.checkpoint.fixed_on_resume); `acts=MODE`: the only runs where it acts (the modes below), so that
    given another value than its default in any other run it is refused in one line (runtime.checks)."""
    return field(default=default, metadata={"help": help, **more})


def loss_reads(c, field: str) -> bool:  # whether the run's --loss reads a trajectory field (loss.py)
    from loss import LOSSES, reads, tb_loss
    return field in reads(LOSSES.get(c.loss, tb_loss))


# Where a flag acts (`arg(..., acts=...)`): a test of the run's Config, and the words of its refusal.
STREAMING = (lambda c: c.lag is None, "streaming: with --lag every batch is its step's rounds, each "
             "trajectory used once")
REPLAY = (lambda c: c.lag is None and c.searchers > 0, "the streaming trainer's replay of what searchers "
          "sent: with --lag every batch is its step's rounds, with --searchers 0 every step searches its own "
          "data")
LAG_PER_TOKEN = (lambda c: c.lag is not None and loss_reads(c, "behaviour_logps"), "--lag, for a loss that "
                 "reads per-token behaviour log-probs (--loss drgrpo, tbprime): the weights that sampled a "
                 "batch are then one step's")
SEARCHING = (lambda c: c.lag is None and c.searchers > 0, "streaming with searchers (with --lag each round is one "
             "step's weights' and waits for them; with --searchers 0 the trainer searches between its steps)")
SEARCHERS = (lambda c: c.searchers > 0, "a run with searchers (with --searchers 0 the trainer evaluates)")
EMULATED = (lambda c: c.generation_slowdown != 1 or c.train_slowdown != 1, "the emulated device time "
            "(--generation-slowdown or --train-slowdown above 1)")
DECODING = (lambda c: c.generation_slowdown != 1, "the emulated decoding (--generation-slowdown above 1)")
GPU_DECODING = (lambda c: c.decode_cost == "gpu", "GPU-shaped emulated decoding (--decode-cost gpu)")


def derived(default):  # filled in by runtime.checks.check and saved with the run; not a flag
    return field(default=default, metadata={"derived": True})


@dataclass(frozen=True)
class Config:
    """Every flag, its default and its one-line help (`--help`); frozen (the module docstring says more)."""
    # --help's groups, each beginning at its field (the sections below)
    SECTIONS: ClassVar[dict] = {
        "steps": "the paper's knobs: TBA (B, K, k, m), its objective and its schedules",
        "model": "tasks and recipes", "searchers": "plumbing: processes, devices, memory, files",
        "generation_slowdown": "experiment knobs: emulated devices, the evaluation's timing (docs/performance.md)"}
    # ===== the paper's knobs: TBA (B, K, k, m), its objective and its schedules ======================
    steps: int = arg(200, "trainer steps (optimizer updates)")
    prompts_per_step: int = arg(32, "B: prompts per training batch")
    round_prompts: int | None = arg(None, "prompts per search round of a searcher (default: B / N rounded up, "
                                          "N the searchers of all nodes)")
    samples_per_prompt: int = arg(8, "K: responses per prompt in a training batch (log Z is their mean)")
    search_samples_per_prompt: int | None = arg(None, "responses a searcher draws per prompt (>= K; default: K)")
    sync_every: int = arg(1, "k: trainer steps between weight syncs to the searchers")
    recency: float = arg(0.95, "m: probability that a batch prompt comes from the data added since the last sync",
                         acts=STREAMING)
    reward_inv_temp: float = arg(0.0, "inverse temperature of the reward softmax of whole-buffer draws; 0 = uniform",
                                 acts=STREAMING)
    buffer_capacity: int = arg(100, "distinct responses kept per prompt", fixed=True, acts=STREAMING)
    duplicates: str = arg("count", "a batch draws each distinct response as often as the searchers sent it (count) "
                                   "| once (collapse: the authors' buffer)", choices=("count", "collapse"),
                         acts=STREAMING)
    initial_buffer: int = arg(0, "trajectories that must have arrived before the first training step")
    max_reuse: float | None = arg(None, "R: draws for training at most R times the trajectories kept, over the run; "
                                        "0 = no cap; default: 1 with searchers, 0 without", acts=REPLAY)
    max_staleness: int = arg(100, "S: wait while the newest data was sampled more than S steps ago; 0 = never",
                             acts=STREAMING)
    beta: float = arg(0.05, "KL coefficient: the target is pi_ref * exp(reward / beta)")
    beta_final: float | None = arg(None, "beta at the end of its anneal, or from --beta-stop-step (default: --beta, "
                                         "no anneal)")
    beta_anneal_steps: int = arg(0, "steps of the linear anneal from --beta to --beta-final")
    beta_stop_step: int = arg(0, "from this update on, beta is --beta-final at once; 0 = never")
    ref_reset_every: int = arg(0, "TBA′: every N steps pi_ref becomes the current policy; 0 = never")
    loss: str = arg("tb", "the objective, a function of loss.py's LOSSES: {losses} (tb: trajectory balance, the "
                          "method; tbprime: TBA′'s update for MATH; rloo, grpo, drgrpo: baselines)")
    clip: float = arg(0.2, "grpo: clip range of the importance ratio", loss=True)
    is_cap: float = arg(8.0, "drgrpo, tbprime: the truncation c of the per-token importance ratio "
                             "min(pi / mu, c)", loss=True)
    importance_weights: bool = arg(True, "tbprime: weight each token by min(pi / mu, c) (off: the plain "
                                         "gradient)", loss=True)
    norm: str = arg("response", "drgrpo, tbprime: each response's token sum divided by its length (response) | its "
                                "prompt's and its own (sequence: the authors' MATH runs) | --max-new-tokens (budget: "
                                "Liu et al.'s Dr. GRPO)", choices=("response", "sequence", "budget"),
                    loss=True)
    behaviour_logprobs: str = arg("vllm", "--lag: the importance ratio's behaviour log-probs are vLLM's, of the tokens "
                                          "as sampled (vllm) | recomputed by the trainer with the weights of step n - L "
                                          "(trainer: the authors')", choices=("vllm", "trainer"),
                                  acts=LAG_PER_TOKEN)
    lag: int | None = arg(None, "L: every batch of step n is sampled by the weights of step n - L exactly (0: "
                                "synchronous, the searchers waiting for each step's weights); default: stream")
    keep_full: bool = arg(False, "streaming: a finished response's slot in a searcher's engine takes the next prompt "
                                 "at once and a prompt is sent when its responses are done, not with its round; new "
                                 "weights load in flight (docs/performance.md, part 9)", acts=SEARCHING)
    lr: float = arg(5e-5, "peak learning rate (AdamW)")
    warmup_steps: int = arg(0, "learning rate: linear warmup steps")
    stable_steps: int | None = arg(None, "learning rate: constant steps after warmup (default: until the decay)")
    decay_steps: int = arg(100, "learning rate: steps of the decay to 0 after the stable phase")
    lr_decay: str = arg("cosine", "shape of the decay: cosine | linear", choices=("cosine", "linear"))  # runtime.policy.lr_at
    grad_clip: float = arg(1.0, "gradient norm clip; 0 = none")
    weight_decay: float = arg(0.0, "AdamW's decoupled weight decay")
    adam_betas: str = arg("0.9,0.999", "AdamW's betas: beta1,beta2")
    temperature: float = arg(1.0, "sampling temperature; log-probs come from logits / temperature", fixed=True)
    max_new_tokens: int = arg(8, "response length limit in tokens")
    context: int = arg(0, "tokens of prompt and response together: a response stops at this or --max-new-tokens, "
                          "the first reached; 0 = --max-new-tokens alone")
    eval_every: int = arg(10, "steps between evaluations on held-out problems; 0 = at the start and end only")
    eval_limit: int | None = arg(None, "evaluate on the first N held-out problems only")
    eval_temperature: float = arg(0.0, "sampling temperature of the evaluation's responses; 0 = greedy")
    # ===== tasks and recipes ===========================================================================
    model: str = arg("tiny", "'tiny' (shipped in runtime/tiny-arith; a task's with demos() built on first use), 'rho-math-1b', a hub id or a local folder; also pi_ref", fixed=True)
    task: str = arg("arith", "a file of tasks/: {tasks} (arith: the toy)", fixed=True)
    data: str | None = arg(None, "folder of the task's JSONL files (default: the Hugging Face hub)", fixed=True)
    reward_model: str | None = arg(None, "a one-output sequence classifier (folder or hub id) that replaces the "
                                         "task's string reward", fixed=True)
    eval_reward_model: str | None = arg(None, "tldr: the judge of the evaluation's win rate (default: --reward-model)")
    non_eos_penalty: bool = arg(False, "a response that never produced EOS gets -1 instead of its reward-model score", fixed=True)
    victim: str | None = arg(None, "redteam: the victim, a causal LM (folder or hub id) that answers each attack", fixed=True)
    classifier: str | None = arg(None, "redteam: a sequence classifier with an unsafe label, or a causal LM judge", fixed=True)
    unsafe_label: str | None = arg(None, "redteam: the classifier's unsafe label (default: found by its name)", fixed=True)
    embedding_model: str | None = arg(None, "redteam: the sentence embedder of the evaluation's diversity")
    victim_max_new_tokens: int | None = arg(None, "redteam: the victim's response length (default: 64 with a chat "
                                                  "template, 30 without)", fixed=True)
    victim_responses: int = arg(5, "redteam: the victim's responses to each attack (the reward is their mean)", fixed=True)
    math_grader: str = arg("math-verify", "math: a boxed answer equal to the solution's by string after Hendrycks' "
                                          "normalisation, or by math-verify (math-verify) | by the authors' sympy "
                                          "check with its guards (authors)", choices=("math-verify", "authors"), fixed=True)
    math_prompt: str = arg("braces", "math: the instruction's example boxes as meant, \\boxed{12} (braces) | as the "
                                     "authors' f-string printed them, \\boxed12 (authors)", choices=("braces", "authors"), fixed=True)
    buffer_keep: str = arg("newest", "newest (TBA's buffer) | best (Lee et al.'s: the best by log R per prompt)",
                           choices=("newest", "best"), fixed=True)
    dedup_similarity: float = arg(0.0, "--buffer-keep best: attacks whose embeddings' cosine is above this are "
                                       "near-duplicates; 0 = off", fixed=True)
    dedup_edit: float = arg(0.0, "--buffer-keep best: responses whose edit distance is below this x their lengths "
                                 "are near-duplicates; 0 = off", fixed=True)
    reward_temp: float = arg(1.0, "T_R of log R = (log pi_ref / gamma + r / beta) / T_R: at step 0, annealed to 1 "
                                  "over --reward-temp-anneal-steps, else constant; 1 = off", loss=True)
    reward_temp_anneal_steps: int = arg(0, "steps of the linear anneal of T_R from --reward-temp to 1; 0 = T_R constant")
    gamma_final: float = arg(1.0, "gamma, the prior's temperature in log R: at the end of its anneal from 1 over "
                                  "--gamma-anneal-steps, else constant; 1 = off", loss=True)
    gamma_anneal_steps: int = arg(0, "steps of the linear anneal of gamma from 1 to --gamma-final; 0 = gamma constant")
    explore_temp_min: float = arg(0.0, "half of a searcher's requests sample at a temperature drawn from [this, "
                                       "--explore-temp-max]; 0 = off")
    explore_temp_max: float = arg(0.0, "the top of the exploration temperatures")
    lora_rank: int = arg(0, "train a LoRA adapter of this rank (at most the targets' width) on the modules peft "
                            "targets for the architecture; 0 = all weights")
    lora_alpha: int = arg(16, "LoRA's alpha (with --lora-rank): the update is (alpha / rank) B A")
    trainer_dtype: str = arg("float32", "the trainer's weights: float32 | bfloat16 (AdamW's moments stay float32)",
                             choices=("float32", "bfloat16"))
    # ===== plumbing: processes, devices, memory, files ====================================================
    searchers: int = arg(1, "searcher processes (a GPU each on a GPU node); 0 = the trainer searches between its "
                            "steps (with --lag 0: the on-policy synchronous baseline)")
    seed: int = arg(0, "seed of every random choice: prompts, sampling, batches")
    out: str | None = arg(None, "output folder (default: a new folder under runs/)")
    save_every: int = arg(0, "steps between checkpoints in OUT/checkpoint; 0 = only when stopped by a signal")
    resume: str | None = arg(None, "checkpoint folder to continue from")
    log_every: int = arg(10, "steps between console lines when the output is not a terminal")
    wandb: str | None = arg(None, "also log the metrics to this Weights & Biases project (pip install wandb)")
    timeout: float = arg(600.0, "seconds any wait on another process may last, and a searcher may stay silent")
    start_timeout: float = arg(600.0, "seconds a searcher may take to start (vLLM's import, the model's load and "
                                      "compile) before its first message")
    dtype: str = arg("auto", "float32 | bfloat16 | float16 | auto (bf16 on GPUs that have it, float32 on the CPU)",
                     choices=("auto", "float32", "bfloat16", "float16"))
    searcher_memory: float | None = arg(None, "GPU: share of a searcher GPU for its vLLM engines (default: what "
                                              "the models beside them leave, at most 0.9)")
    trainer_memory: float = arg(0.2, "GPU, --searchers 0: share of the trainer GPU for its vLLM engine")
    micro_batch: int = arg(256, "the trainer's sequences per forward/backward pass (fewer than K: the group's "
                                "statistics in passes of as many first, without gradient)")
    score_batch: int | None = arg(None, "a searcher's sequences per scoring pass (pi_ref's log-probs, reward models, "
                                        "the evaluation's); default: what 2 GiB of logits hold, at most 256")
    activation_checkpointing: bool = arg(False, "recompute each decoder block in the backward pass (less memory)")
    # ===== experiment knobs: emulated devices and the evaluation's timing (tools/bench.py, docs/performance.md) =====
    generation_slowdown: float = arg(1.0, "experiment knob: each decoding step takes X times its cost alone "
                                          "(emulated by sleeping); 1 = off")
    train_slowdown: float = arg(1.0, "experiment knob: each training step (sample, loss, update) takes Y times its "
                                     "cost alone (emulated by sleeping), and its weights leave after it; 1 = off")
    evaluator: str = arg("searcher", "experiment knob: searcher 0 evaluates between its rounds (searcher) | the trainer "
                                     "keeps each evaluation's weights on the host and evaluates them after the last "
                                     "step, each row at the time its weights were made (after: a comparison of "
                                     "asynchrony that no evaluation may disturb)", choices=("searcher", "after"),
                         acts=SEARCHERS)
    calibration: str | None = arg(None, "experiment knob: a JSON file of the emulated costs alone (seconds_per_token, "
                                        "train_step: tools/bench.py measures them), instead of each run's own",
                                acts=EMULATED)
    decode_cost: str = arg("linear", "experiment knob, with --generation-slowdown: a decoding step costs each running "
                                     "sequence's share (linear) | a fixed part and a small part a sequence, as on a "
                                     "GPU (gpu)", choices=("linear", "gpu"), acts=DECODING)
    decode_shape: str = arg("rho-math-1b", "experiment knob, with --decode-cost gpu: whose decoding step it is shaped "
                                           "as (a fixed part, and a part a sequence from its KV cache's bytes a token "
                                           "over its weights')", choices=("rho-math-1b", "qwen2.5-7b", "llama-2-7b"),
                             acts=GPU_DECODING)
    response_lengths: str = arg("real", "experiment knob, with --generation-slowdown: a response's emulated decoding "
                                        "steps are its own (real) | its own times a draw from the long tail of a real "
                                        "model's GSM8K answers (gsm8k)", choices=("real", "gsm8k"),
                                 acts=DECODING)
    # ===== derived by runtime.checks.check, saved with the run; not flags ==============================
    device: str = derived("")                         # cuda | cpu
    threads: int = derived(0)                         # CPU threads per process
    model_path: str = derived("")                     # the local folder of --model
    max_model_len: int = derived(0)                   # longest prompt + max_new_tokens, at most --context
    score: str = derived("accuracy")                  # the evaluation's headline figure (the task's)
    loss_pools: bool = derived(False)                 # --loss pools across prompts: whole batches (checks.loss_pools)
    given: tuple | None = derived(None)               # the flags the command line gave (None: not parsed from one)
    resumes: tuple = derived(())                      # each --resume of the run: its step, what changed (checks)
    reward_model_path: str | None = derived(None)     # local folder of --reward-model
    eval_reward_model_path: str | None = derived(None)  # local folder of the judge
    victim_path: str | None = derived(None)           # redteam: local folders of the victim,
    classifier_path: str | None = derived(None)       # the classifier
    embedding_model_path: str | None = derived(None)  # and the embedder
    classifier_kind: str | None = derived(None)       # redteam: 'sequence' or 'judge'
