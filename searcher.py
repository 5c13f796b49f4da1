"""A searcher: a vLLM engine with a local copy of the policy, sampling, rewards, reference log-probs.

TBA's searchers (Sec. 3.1) keep generating and never wait for training. Each round a searcher
takes `prompts_per_step` training prompts at random, samples `search_samples_per_prompt`
responses to each with vLLM, scores them with the task's reward, computes their summed
log-probs under pi_ref (a frozen copy of the initial model, logits / temperature), and puts the
trajectories on the bounded queue to the trainer. Before each round it checks the weight
version: if the trainer published new weights it reloads them into vLLM and resets the prefix
cache (vLLM never clears it after new weights arrive; stale cached prefixes would keep the old
policy's values).

Weights travel through `SharedWeights`: tensors allocated once by trainer rank 0 and handed to
every searcher through a queue once the trainer has loaded its model (searchers start first, so
their engines come up meanwhile), in shared memory on the CPU and as CUDA IPC handles on a GPU (the
tensors then stay on the trainer's GPU and vLLM copies from them peer to peer), plus a version
counter and a lock. `Engine` is the same code in a searcher process and, with `--searchers 0`
(the synchronous baseline), inside the trainer. Searcher 0 also evaluates (greedy pass@1 on the
held-out problems) after a round when the trainer has asked for it.
"""

import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from queue import Empty, Full
from types import SimpleNamespace

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep the engine in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")           # GiB of KV cache on the CPU
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import numpy as np
import torch

from buffer import Trajectory
from loss import sequence_logprobs

WAIT = 1.0  # s: every blocking wait polls at this period and checks that the other side lives


class Dead(RuntimeError):
    """Another process of the run died; the message names it."""


@dataclass
class SharedWeights:
    tensors: dict | None  # Hugging Face parameter name -> shared tensor (tied names share one tensor)
    version: object  # mp.Value("q"): trainer step of the weights in `tensors` (0 = initial model)
    lock: object  # mp.Lock: held while `tensors` are written or read
    handoff: object  # mp.Queue: `tensors`, once per searcher, for searchers started before they existed


def acquire(lock, alive, timeout: float):
    """Take `lock`, polling; `alive()` raises Dead if the process we wait for has died."""
    deadline = time.monotonic() + timeout
    while not lock.acquire(timeout=WAIT):
        alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"weight-sync lock not free after {timeout:.0f} s")


def shared_weights(ctx) -> SharedWeights:
    """The version counter, lock and handoff queue, made before the searchers are spawned; the
    tensors follow with `share_weights` (the searchers start their engines meanwhile)."""
    return SharedWeights(None, ctx.Value("q", 0), ctx.Lock(), ctx.Queue())


def share_weights(state_dict: dict, device, dtype, ctx=None, weights=None) -> SharedWeights:
    """Allocate the shared copy of the weights that searchers read (trainer rank 0, once), into
    `weights` or new SharedWeights; the caller puts `tensors` on the handoff queue for searchers."""
    weights = weights or shared_weights(ctx)
    tensors, by_storage = {}, {}
    for name, t in state_dict.items():
        key = (t.data_ptr(), t.shape)
        if key not in by_storage:  # tied weights (embeddings = LM head) share one tensor
            shared = torch.empty(t.shape, dtype=dtype, device=device)
            shared.copy_(t)
            by_storage[key] = shared.share_memory_() if shared.device.type == "cpu" else shared
        tensors[name] = by_storage[key]
    weights.tensors = tensors
    return weights


def receive_weights(weights: SharedWeights, stop):
    """Searcher side: wait for the trainer's handoff (unless the tensors came at spawn), polling,
    never on a stopped or dead trainer."""
    while weights.tensors is None and not stop.is_set():
        try:
            weights.tensors = weights.handoff.get(timeout=WAIT)
        except Empty:
            parent_alive()


def publish(weights: SharedWeights, state_dict: dict, version: int, alive, timeout: float):
    """Trainer side of a weight sync: copy the full weights in, then move the version."""
    acquire(weights.lock, alive, timeout)
    try:
        for name, shared in weights.tensors.items():
            shared.copy_(state_dict[name], non_blocking=True)
        if any(t.is_cuda for t in weights.tensors.values()):
            torch.cuda.synchronize()
        weights.version.value = version
    finally:
        weights.lock.release()


class Engine:
    """vLLM plus the frozen reference model, for searching, scoring and evaluation."""

    def __init__(self, cfg, model_path: str, ref_path: str, device: str, memory: float,
                 prompts: list[list[int]], answers: list[str], reward):
        from vllm import LLM

        self.cfg, self.prompts, self.answers, self.reward = cfg, prompts, answers, reward
        self.device = torch.device(device)
        kwargs = dict(model=model_path, dtype=cfg.dtype, seed=cfg.seed, max_model_len=cfg.max_model_len,
                      logprobs_mode="processed_logprobs",  # behaviour log-probs after temperature
                      enforce_eager=self.device.type == "cpu", enable_prefix_caching=True)
        if self.device.type == "cuda":  # pick this GPU without hiding the others (CUDA IPC needs them)
            kwargs.update(device_ids=[self.device.index], gpu_memory_utilization=memory)
        else:  # vLLM's sampler torch.compiles its log-prob gather on first use: 3-4 s of C++ build
            # per process on the CPU, for no speed-up there (this process only; GPUs keep compiling)
            torch._dynamo.config.disable = True
        self.llm = LLM(**kwargs)
        self.version = 0  # trainer step of the weights loaded (0 = the initial model)
        self.ref_path, self.ref = ref_path, None  # pi_ref, loaded on the first search

    # --- weights ---------------------------------------------------------------------------
    def load(self, named_tensors, version: int):
        """Reload weights into vLLM (Hugging Face names) and drop the prefix cache."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
        self.llm.reset_prefix_cache()
        self.version = version

    def sync(self, weights: SharedWeights, alive, timeout: float) -> bool:
        """Load the published weights if their version moved; True if it did."""
        if weights.version.value == self.version:
            return False
        acquire(weights.lock, alive, timeout)
        try:  # read under the lock: the trainer cannot overwrite them half-way
            self.load(list(weights.tensors.items()), weights.version.value)
        finally:
            weights.lock.release()
        return True

    # --- searching -------------------------------------------------------------------------
    def search(self, prompt_ids, n: int, seed: tuple) -> tuple[list[Trajectory], dict]:
        """n sampled responses to each prompt, scored, with reference and behaviour log-probs."""
        from vllm import SamplingParams

        params = [SamplingParams(n=n, temperature=self.cfg.temperature, max_tokens=self.cfg.max_new_tokens,
                                 logprobs=0,  # the sampled token's log-prob: gives cumulative_logprob
                                 seed=int(np.random.SeedSequence([*seed, int(p)]).generate_state(1)[0]))
                  for p in prompt_ids]  # a seed per request: sampling is reproducible from the run's seed
        outputs = self.llm.generate([{"prompt_token_ids": self.prompts[p]} for p in prompt_ids], params,
                                    use_tqdm=False)
        trajectories = []
        for p, out in zip(prompt_ids, outputs):
            for c in out.outputs:
                trajectories.append(Trajectory(
                    prompt_id=int(p), response=np.asarray(c.token_ids, dtype=np.int32),
                    reward=self.reward(c.text, self.answers[p]), logp_ref=0.0,
                    logp_behaviour=float(c.cumulative_logprob), version=self.version))
        if self.ref is None:  # frozen pi_ref: the initial model
            from transformers import AutoModelForCausalLM
            self.ref = AutoModelForCausalLM.from_pretrained(self.ref_path, dtype=getattr(torch, self.cfg.dtype))
            self.ref.to(self.device).eval().requires_grad_(False)
        pairs, index = unique_pairs(trajectories, self.prompts)
        logp_ref = self.logprobs(self.ref, pairs)
        for t, i in zip(trajectories, index):
            t.logp_ref = logp_ref[i]
        tokens = sum(len(t.response) for t in trajectories)
        return trajectories, {"tokens": tokens}

    @torch.no_grad()
    def logprobs(self, model, pairs: list[tuple[list[int], np.ndarray]]) -> list[float]:
        """Summed log-probs of (prompt, response) pairs under a transformers model, in micro-batches."""
        out = []
        for i in range(0, len(pairs), self.cfg.micro_batch):
            batch = collate(pairs[i:i + self.cfg.micro_batch], 0, self.device)
            out += sequence_logprobs(model, *batch, self.cfg.temperature).tolist()
        return out

    def close(self):
        """Shut the engine down (it also tears down the process group it shares with this process)."""
        self.llm.llm_engine.engine_core.shutdown()

    def score(self, prompt: list[int], response: list[int]) -> float:
        """vLLM's summed log-prob of a fixed response (raw logits: temperature 1), for checks."""
        from vllm import SamplingParams

        out = self.llm.generate([{"prompt_token_ids": prompt + list(response)}],
                                SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        return sum(out.prompt_logprobs[len(prompt) + i][tok].logprob for i, tok in enumerate(response))

    # --- evaluation ------------------------------------------------------------------------
    def evaluate(self, prompts: list[list[int]], answers: list[str]) -> tuple[float, dict]:
        """Greedy pass@1 with the loaded weights, and the first problem's completion as an example."""
        from vllm import SamplingParams

        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                    SamplingParams(temperature=0.0, max_tokens=self.cfg.max_new_tokens),
                                    use_tqdm=False)
        rewards = [self.reward(o.outputs[0].text, a) for o, a in zip(outputs, answers)]
        example = dict(prompt=self.llm.get_tokenizer().decode(prompts[0], skip_special_tokens=True),
                       completion=outputs[0].outputs[0].text, reward=rewards[0])
        return float(np.mean(rewards)), example


def unique_pairs(trajectories, prompts) -> tuple[list, list[int]]:
    """The distinct (prompt, response) pairs among `trajectories`, and each trajectory's index into
    them: log-probs are computed once per distinct sequence (sampling repeats short answers often)."""
    pairs, seen, index = [], {}, []
    for t in trajectories:
        key = (t.prompt_id, t.response.tobytes())
        if key not in seen:
            seen[key] = len(pairs)
            pairs.append((prompts[t.prompt_id], t.response))
        index.append(seen[key])
    return pairs, index


def collate(pairs, pad: int, device):
    """(prompt, response) pairs -> input_ids, attention_mask, response_mask, each (N, T), right-padded."""
    T = max(len(p) + len(r) for p, r in pairs)
    ids = torch.full((len(pairs), T), pad, dtype=torch.long)
    attention = torch.zeros((len(pairs), T), dtype=torch.long)
    response = torch.zeros((len(pairs), T), dtype=torch.long)
    for i, (p, r) in enumerate(pairs):
        n, m = len(p), len(r)
        ids[i, :n] = torch.as_tensor(p)
        ids[i, n:n + m] = torch.as_tensor(r, dtype=torch.long)
        attention[i, :n + m] = 1
        response[i, n:n + m] = 1
    return ids.to(device), attention.to(device), response.to(device)


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE")


def parent_alive():
    parent = mp.parent_process()
    if parent is not None and not parent.is_alive():
        raise Dead("the trainer (parent process) is gone")


def watchdog():
    """Exit at once if the trainer dies, even while this process is busy inside vLLM."""
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


def run(index: int, cfg: dict, weights: SharedWeights, queue, stop, evals, prompts, answers,
        test_prompts, test_answers, device: str):
    """Searcher process main: search, push, reload weights when they move, until told to stop.
    Searcher 0 also answers evaluation requests (`evals`) between rounds."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # signals to the whole group: the trainer decides, then stops us
        signal.signal(sig, signal.SIG_IGN)
    for k in list(os.environ):  # drop torchrun's variables: vLLM makes its own one-process group
        if k in TORCHRUN_VARS or k.startswith("TORCHELASTIC_"):
            del os.environ[k]
    threading.Thread(target=watchdog, daemon=True).start()
    cfg = SimpleNamespace(**cfg)
    from rewards import REWARDS
    try:
        torch.set_num_threads(cfg.threads)  # before vLLM starts: it pins the thread count after
        engine = Engine(cfg, cfg.model_path, cfg.model_path, device, cfg.searcher_memory, prompts, answers,
                        REWARDS[cfg.task])
        rng = np.random.default_rng([cfg.seed, index, 1])
        round_ = 0
        receive_weights(weights, stop)
        while not stop.is_set():
            engine.sync(weights, parent_alive, cfg.timeout)
            t0 = time.time()
            ids = rng.choice(len(prompts), size=min(cfg.prompts_per_step, len(prompts)), replace=False)
            trajectories, stats = engine.search(ids, cfg.search_samples_per_prompt, (cfg.seed, index + 1, round_))
            put(queue, dict(kind="search", searcher=index, version=engine.version, trajectories=trajectories,
                            seconds=time.time() - t0, **stats), stop)
            round_ += 1
            if drain_requests(evals):  # after a round, so that the trainer gets its first data first
                engine.sync(weights, parent_alive, cfg.timeout)  # the newest published weights
                t0 = time.time()
                accuracy, example = engine.evaluate(test_prompts, test_answers)
                put(queue, dict(kind="eval", version=engine.version, accuracy=accuracy, example=example,
                                seconds=time.time() - t0), stop)
    except Dead:
        sys.exit(3)
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    finally:
        queue.cancel_join_thread()  # never block exit on undelivered data


def drain_requests(evals) -> bool:
    """True if any evaluation was requested since the last call (requests coalesce)."""
    requested = False
    while evals is not None:
        try:
            evals.get_nowait()
            requested = True
        except Empty:
            return requested
    return requested
