"""A searcher: a vLLM engine with a local copy of the policy, sampling, rewards, reference log-probs.

TBA's searchers (Sec. 3.1) keep generating and never wait for training. Each round a searcher
takes `round_prompts` training prompts at random, samples `search_samples_per_prompt` responses
to each with vLLM, scores them with the task's reward, computes their summed log-probs under pi_ref
(a frozen copy of the initial model, logits / temperature), and puts the trajectories on the bounded
queue to the trainer. Before each round it checks the weight version: if the trainer published new
weights it reloads them into vLLM and resets the prefix cache (vLLM never clears it after new weights
arrive; stale cached prefixes would keep the old policy's values).

This file is the searcher's loop (`run`, below) and its `Engine`: generate, score, pi_ref, reload,
evaluate. The task's reward and evaluation come from its scorer (tasks/task.py); the weights arrive
through runtime/weights.py (shared tensors, a version counter and a lock: its docstring gives the
protocol); vLLM's options and workarounds are in runtime/vllm_env.py. `Engine` is the same code in a
searcher process and, with `--searchers 0` (the synchronous baseline), inside the trainer. Searcher 0
(of node 0) also evaluates (greedy, on the held-out problems) after a round when the trainer has asked
for it, with a beat to the trainer after each part, so that a long evaluation is not taken for silence.
"""

import itertools
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from queue import Empty, Full

from runtime import vllm_env

vllm_env.set_up()  # before torch and vLLM are imported, here and in the fork server, which imports this file

import numpy as np
import torch

import tasks
from buffer import Trajectory
from loss import collate, sequence_logprobs, unique_pairs
from runtime import seeds, slowdown
from runtime.errors import Dead
from runtime.weights import WAIT, SharedWeights, locked, receive


# ===== the searcher's loop: its side of the paper's Algorithm 1 ==================================
def run(index: int, cfg, weights: SharedWeights, channels, data, device: str):
    """Searcher process main: search, push, reload weights when they move, until told to stop.
    Searcher 0 also answers evaluation requests (`channels.evals`) between rounds."""
    become_searcher()
    try:
        torch.set_num_threads(cfg.threads)  # before vLLM starts: it pins the thread count after
        vllm_env.quiet_loading()
        engine = Engine(cfg, device, cfg.searcher_memory, data.prompts, data.answers,
                        evaluates=channels.evals is not None)
        if cfg.generation_slowdown != 1:
            slowdown.calibrate_alone(engine, *channels.calibration, cfg, parent_alive)
        rng = np.random.default_rng([cfg.seed, index, seeds.SEARCH_PROMPTS])
        receive(weights, channels.stop, parent_alive)
        for round_ in itertools.count():
            if channels.stop.is_set():
                break
            # ===== reload the weights if the trainer published new ones =========================
            engine.sync(weights, parent_alive, cfg.timeout)
            # ===== search: sample, score, pi_ref's log-probs; push to the trainer =================
            t0 = time.time()
            ids = rng.choice(len(data.prompts), size=min(cfg.round_prompts, len(data.prompts)), replace=False)
            trajectories, stats = engine.search(ids, cfg.search_samples_per_prompt, (cfg.seed, index + 1, round_))
            put(channels.queue, dict(kind="search", searcher=index, version=engine.version, trajectories=trajectories,
                                     seconds=time.time() - t0, **stats), channels.stop)
            # ===== evaluate, if asked (after a round: the trainer gets its first data first) ======
            requested = drain_requests(channels.evals)
            if requested is not None:
                if engine.version != requested:  # the weights asked for if it holds them (the initial
                    engine.sync(weights, parent_alive, cfg.timeout)  # model's), else the newest
                t0 = time.time()
                beat = lambda done: put(channels.queue, dict(kind="beat", searcher=index, done=done), channels.stop)
                scores, example = engine.evaluate(data.test_prompts, data.test_answers, beat)
                put(channels.queue, dict(kind="eval", searcher=index, version=engine.version, scores=scores,
                                         example=example, seconds=time.time() - t0), channels.stop)
    except Dead:
        sys.exit(3)
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    finally:
        channels.queue.cancel_join_thread()  # never block exit on undelivered data


class Engine:
    """vLLM (the searcher's copy of the policy), pi_ref and the task's scorer, for searching, scoring and
    evaluation."""

    def __init__(self, cfg, device: str, memory: float, prompts: list[list[int]], answers: list[str],
                 evaluates: bool = True):
        from transformers import AutoTokenizer
        self.cfg, self.prompts, self.answers = cfg, prompts, answers
        self.device = torch.device(device)
        task = tasks.get(cfg.task)
        self.split = {}  # on a GPU: `memory`, split between this process's vLLM engines (the task may add some)
        if self.device.type == "cuda":
            from runtime import gpu  # (the models are counted on the meta device: before vLLM rewrites classes)
            self.split = gpu.memory_split(torch.cuda.get_device_properties(self.device).total_memory, memory,
                                          *gpu.memory_needs(cfg, task, evaluates))
        self.llms = []  # the vLLM engines in this process: the policy's first
        self.llm = self.start_llm(cfg.model_path, next(iter(self.split.values()), memory), cfg.max_model_len,
                                  logprobs_mode="processed_logprobs")  # behaviour log-probs after temperature
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        self.version = 0          # trainer step of the weights loaded (0 = the initial model)
        self.pi_ref_version = 0   # trainer step whose weights pi_ref holds (TBA′; 0 = the initial model)
        self.per_token = None     # --generation-slowdown: s a generated token costs this engine alone
        self.pi_ref_model = None  # loaded on the first search (`pi_ref`)
        self.scorer = task.scorer(self, task, evaluates)

    # --- searching -------------------------------------------------------------------------
    def generate(self, prompt_ids, n: int, seed: tuple):
        """vLLM's n samples of each prompt, and the seconds they took."""
        from vllm import SamplingParams

        params = [SamplingParams(n=n, temperature=self.explore(seed, p), max_tokens=self.cfg.max_new_tokens,
                                 logprobs=0,  # the sampled token's log-prob: gives cumulative_logprob
                                 seed=int(np.random.SeedSequence([*seed, int(p)]).generate_state(1)[0]))
                  for p in prompt_ids]  # a seed per request: sampling is reproducible from the run's seed
        t0 = time.time()
        outputs = self.llm.generate([{"prompt_token_ids": self.prompts[p]} for p in prompt_ids], params,
                                    use_tqdm=False)
        return outputs, time.time() - t0

    def search(self, prompt_ids, n: int, seed: tuple) -> tuple[list[Trajectory], dict]:
        """n sampled responses to each prompt, scored, with reference and behaviour log-probs."""
        outputs, generate = self.generate(prompt_ids, n, seed)
        tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
        alone = tokens * self.per_token if self.per_token else generate  # the generation's cost alone
        slept = slowdown.slow_down(generate, alone, self.cfg.generation_slowdown)
        done = [(int(p), c) for p, out in zip(prompt_ids, outputs) for c in out.outputs]
        texts = [c.text for _, c in done]
        rewards = self.scorer.reward([self.prompts[p] for p, _ in done], [c.token_ids for _, c in done], texts,
                                     [self.answers[p] for p, _ in done])
        trajectories = [Trajectory(prompt_id=p, response=np.asarray(c.token_ids, dtype=np.int32), reward=float(r),
                                   logp_ref=0.0, logp_behaviour=float(c.cumulative_logprob), version=self.version,
                                   pi_ref_version=self.pi_ref_version)
                        for (p, c), r in zip(done, rewards)]
        pairs, index = unique_pairs(trajectories, self.prompts)
        logp_ref = self.logprobs(self.pi_ref(), pairs, self.cfg.temperature)
        for t, i in zip(trajectories, index):
            t.logp_ref = logp_ref[i]
        self.scorer.annotate(trajectories, texts)
        return trajectories, {"tokens": tokens, "generate": generate, "slept": slept, "parts": self.scorer.seconds,
                              "charged": alone * self.cfg.generation_slowdown, "per_token": self.per_token}

    def explore(self, seed: tuple, prompt) -> float:
        """A request's sampling temperature: --temperature, or with --explore-temp-min half the time one drawn
        uniformly from [min, max] (Lee et al.'s online batches, trainers/gfn_trainer.py:279-285). TB's log-probs
        stay at --temperature: the request is then off-policy, which TB allows."""
        low, high = self.cfg.explore_temp_min, self.cfg.explore_temp_max
        rng = np.random.default_rng([*seed, int(prompt), seeds.EXPLORE])
        return float(rng.uniform(low, high)) if low and rng.random() < 0.5 else self.cfg.temperature

    # --- pi_ref ----------------------------------------------------------------------------
    def pi_ref(self):
        """pi_ref, a transformers model on this device (frozen: the initial model until a TBA′ reset)."""
        if self.pi_ref_model is None:
            self.pi_ref_model = self.transformers_copy(self.cfg.model_path)
        return self.pi_ref_model

    @torch.no_grad()
    def logprobs(self, model, pairs: list[tuple[list[int], np.ndarray]], temperature: float) -> list[float]:
        """Summed log-probs of (prompt, response) pairs under a transformers model, in micro-batches."""
        out = []
        for i in range(0, len(pairs), self.cfg.micro_batch):
            batch = collate(pairs[i:i + self.cfg.micro_batch], 0, self.device)
            out += sequence_logprobs(model, *batch, temperature).tolist()
        return out

    def transformers_copy(self, path: str):
        """A frozen transformers model on this device, in the run's dtype."""
        from transformers import AutoModelForCausalLM
        with self.beside():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, self.cfg.dtype))
        return model.to(self.device).eval().requires_grad_(False)

    # --- weights ---------------------------------------------------------------------------
    def load(self, named_tensors, version: int):
        """Reload weights into vLLM (Hugging Face names) and drop the prefix cache."""
        named_tensors = list(named_tensors)  # read twice where the scorer keeps a copy
        self.scorer.loaded(named_tensors)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
        # vLLM never drops cached prefixes after new weights: they would keep the old policy's KV
        # values. reset_prefix_cache() returns False when blocks are still in use
        # (vllm/v1/core/block_pool.py:837-845); between two rounds none are, so False is a bug to stop on.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(f"vLLM could not reset its prefix cache after loading the weights of step {version}")
        self.version = version

    def sync(self, weights: SharedWeights, alive, timeout: float) -> bool:
        """Load the published weights if their version moved, and pi_ref if it was reset (TBA′);
        True if anything moved. Read under the lock: the trainer cannot overwrite them half-way."""
        if weights.version.value == self.version and weights.pi_ref_version.value == self.pi_ref_version:
            return False
        with locked(weights, alive, timeout, self.device):
            if weights.version.value != self.version:
                self.load(list(weights.tensors.items()), weights.version.value)
            if weights.pi_ref_version.value != self.pi_ref_version:
                self.pi_ref().load_state_dict(weights.pi_ref, strict=False)
                self.pi_ref_version = weights.pi_ref_version.value
        return True

    # --- evaluation ------------------------------------------------------------------------
    def evaluate(self, prompts: list[list[int]], answers: list[str], beat=lambda done: None) -> tuple[dict, dict]:
        """The task's scores of the loaded weights on held-out prompts, and an example (its scorer's
        `evaluate`: by default one response to each prompt, in parts, each followed by `beat`)."""
        return self.scorer.evaluate(prompts, answers, beat)

    def respond(self, prompts: list[list[int]]) -> tuple[list[list[int]], list[str]]:
        """One response to each prompt, greedy or at --eval-temperature: token ids and text."""
        from vllm import SamplingParams
        params = SamplingParams(temperature=self.cfg.eval_temperature, max_tokens=self.cfg.max_new_tokens,
                                seed=self.cfg.seed if self.cfg.eval_temperature else None)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs], [o.outputs[0].text for o in outputs]

    # --- the vLLM engines of this process --------------------------------------------------
    def start_llm(self, path: str, memory: float | None, max_model_len: int, **extra):
        """A vLLM engine of the model at `path` on this device, beside this process's others (the policy's;
        a task's own, started by its scorer): `memory` its share of the GPU (runtime/vllm_env.llm_options)."""
        from vllm import LLM
        self.llms.append(LLM(**vllm_env.llm_options(self.cfg, path, self.device, memory, max_model_len), **extra))
        return self.llms[-1]

    def beside(self):
        """Build transformers models beside the engines inside this (runtime/vllm_env.eager_transformers)."""
        return vllm_env.eager_transformers(self.llm)

    def close(self):
        """Shut the engines down, the policy's last (it also tears down the process group it shares with this
        process)."""
        for llm in reversed(self.llms):
            llm.llm_engine.engine_core.shutdown()

    def logprob(self, prompt: list[int], response: list[int]) -> float:
        """vLLM's summed log-prob of a fixed response (raw logits: temperature 1), for checks."""
        from vllm import SamplingParams

        out = self.llm.generate([{"prompt_token_ids": prompt + list(response)}],
                                SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        return sum(out.prompt_logprobs[len(prompt) + i][tok].logprob for i, tok in enumerate(response))


# --- the searcher's side of the fleet (runtime/fleet.py): its process, the queue, evaluation requests ------
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE")


def become_searcher():
    """Signals to the whole group are the trainer's to decide (it then stops us); torchrun's variables go
    (vLLM makes its own one-process group); a watchdog exits at once if the trainer dies, even while this
    process is busy inside vLLM."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    for k in list(os.environ):
        if k in TORCHRUN_VARS or k.startswith("TORCHELASTIC_"):
            del os.environ[k]
    threading.Thread(target=watchdog, daemon=True).start()


def parent_alive():
    parent = mp.parent_process()
    if parent is not None and not parent.is_alive():
        raise Dead("the trainer (parent process) is gone")


def watchdog():
    while True:
        time.sleep(WAIT)
        try:
            parent_alive()
        except Dead:
            os._exit(3)


def put(queue, message, stop):
    """Put on the bounded queue, waiting while it is full, but never on a stopped or dead trainer."""
    while not stop.is_set():
        try:
            return queue.put(message, timeout=WAIT)
        except Full:
            parent_alive()


def drain_requests(evals) -> int | None:
    """The newest step whose evaluation was requested since the last call (requests coalesce), or None."""
    requested = None
    while evals is not None:
        try:
            step = evals.get_nowait()
            requested = step if requested is None else max(requested, step)
        except Empty:
            return requested
    return requested
