"""A searcher: a vLLM engine with a local copy of the policy, sampling, rewards, reference log-probs.

TBA's searchers (Sec. 3.1) keep generating and never wait for training. Each round a searcher
takes `round_prompts` training prompts at random, samples `search_samples_per_prompt`
responses to each with vLLM, scores them with the task's reward, computes their summed
log-probs under pi_ref (a frozen copy of the initial model, logits / temperature), and puts the
trajectories on the bounded queue to the trainer. Before each round it checks the weight
version: if the trainer published new weights it reloads them into vLLM and resets the prefix
cache (vLLM never clears it after new weights arrive; stale cached prefixes would keep the old
policy's values).

Weights arrive through `weights.py` (shared tensors, a version counter and a lock: its docstring
gives the protocol). `Engine` is the same code in a searcher process and, with `--searchers 0`
(the synchronous baseline), inside the trainer. Searcher 0 (of node 0) also evaluates (greedy, on
the held-out problems) after a round when the trainer has asked for it, with a beat to the trainer
after each part of the evaluation, so that a long one is not taken for silence.
"""

import contextlib
import math
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from queue import Empty, Full
from types import SimpleNamespace

from runtime import vllm_env

vllm_env.set_up()  # before torch and vLLM are imported, here and in the fork server, which imports this file
# The CPU's fork server (processes.fork_server) imports this file first. torchrun stops a rank with
# SIGTERM to its whole process group, the server included, which ignores only SIGINT (Python 3.11,
# multiprocessing/forkserver.py:196): dead, it reports every searcher as exit code 255
# (multiprocessing/popen_forkserver.py:69-72). So it ignores SIGTERM as the searchers do (run), and
# ends with the trainer.
FORK_SERVER = "TBA_FORK_SERVER"  # set while processes.fork_server starts the server
if os.environ.pop(FORK_SERVER, None):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

import numpy as np
import torch

from runtime import seeds
from buffer import Trajectory
from runtime.errors import Dead
from loss import collate, sequence_logprobs, unique_pairs
from rewards import RewardModel, batched
from tasks import TASKS
from runtime.weights import WAIT, SharedWeights, acquire, locked, receive


class Engine:
    """vLLM (the searcher's copy of the policy), pi_ref and the reward, for searching, scoring and
    evaluation."""

    def __init__(self, cfg, device: str, memory: float, prompts: list[list[int]], answers: list[str],
                 evaluates: bool = True):
        self.cfg, self.prompts, self.answers = cfg, prompts, answers
        self.task = TASKS[cfg.task]  # its reward and its evaluation
        self.device = torch.device(device)
        split = {}  # on a GPU: `memory` split between the policy's engine and red-teaming's victim's and judge's
        if self.device.type == "cuda":  # (memory_needs builds models on the meta device: before vLLM rewrites
            split = memory_split(torch.cuda.get_device_properties(self.device).total_memory, memory,  # classes)
                                 *memory_needs(cfg, evaluates))
        self.engines = []  # the vLLM engines in this process: the policy's, then red-teaming's victim and judge
        self.llm = self.start(cfg.model_path, next(iter(split.values()), memory), cfg.max_model_len,
                              logprobs_mode="processed_logprobs")  # behaviour log-probs after temperature
        from transformers import AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        self.version = 0      # trainer step of the weights loaded (0 = the initial model)
        self.per_token = None  # --generation-slowdown: s a generated token costs this engine alone (calibrate)
        self.ref_version = 0  # trainer step whose weights pi_ref holds (TBA′; 0 = the initial model)
        self.ref = self.judge = None  # pi_ref, loaded on the first search; the evaluation's judge
        if cfg.victim_path:  # red-teaming: the victim answers, the classifier judges (redteam.py)
            self.reward, self.embedder = self.red_team_reward(split), None
        else:  # the task's reward, or a reward model in its place
            self.reward = (self.reward_model(cfg.reward_model_path) if cfg.reward_model_path
                           else batched(self.task.reward))
        # tldr, on the engine that evaluates: a transformers copy of the policy for the evaluation's
        # full-vocabulary KL, kept at vLLM's weights by load(). vLLM 0.32 can return whole
        # distributions (SamplingParams(logprobs=-1) with LLM(max_logprobs=-1): vllm/sampling_params.py:921-926,
        # vllm/config/model.py:282-286, vllm/v1/sample/sampler.py:123-127), but only for the engine's whole
        # life (its search rounds too, and -1 turns off a GPU sharding of the sampler,
        # vllm/config/vllm.py:3051-3054), as logprobs_mode's values (here after the evaluation's temperature
        # 0.01, not pi_theta's), and as one Python {token: Logprob} dict per position: 50k entries x
        # 128 tokens x 6.5k responses. A copy costs the policy's weights once more on this device
        # and one forward per response.
        self.policy = self.transformers_copy(cfg.model_path) if self.task.score == "win_rate" and evaluates else None
        self.sft = None  # the initial pi_ref, for the evaluation once TBA′ has reset pi_ref

    @contextlib.contextmanager
    def transformers_models(self):
        """Build transformers models in this process (pi_ref, reward models, the synchronous trainer's
        policy) inside this. vLLM serves architectures it has no native code for (GPT-NeoX, i.e. Pythia,
        in 0.32: vllm/model_executor/models/registry.py:709-716) through its Transformers backend, which
        rewrites the transformers decoder class in place (vllm/compilation/decorators.py:359, 434, 756,
        via vllm/model_executor/models/transformers/base.py:172): its __init__ then needs a current vLLM
        config, and its __call__ runs vLLM's torch.compile wrapper unless that config's compilation is
        off. A copy of the engine's config with compilation off gives plain eager models, with log-probs
        and gradients equal to a process without vLLM; for natively served models it changes nothing."""
        import copy
        from vllm.config import CompilationConfig, CompilationMode, set_current_vllm_config
        config = copy.copy(self.llm.llm_engine.vllm_config)
        config.compilation_config = CompilationConfig(mode=CompilationMode.NONE)
        with set_current_vllm_config(config):
            yield

    def reward_model(self, path: str):
        with self.transformers_models():
            return RewardModel(path, self.device, self.cfg.dtype, self.tokenizer, self.cfg.non_eos_penalty,
                               batch=self.cfg.micro_batch)

    def red_team_reward(self, split: dict):
        """The victim, and a judge of the causal-LM kind, on vLLM engines of their own beside the policy's (on a
        GPU with `split`'s shares of it); a sequence classifier in transformers (docs/tasks.md says why)."""
        from tasks import redteam
        cfg = self.cfg
        llm = self.start(cfg.victim_path, split.get("victim"), redteam.context(cfg.victim_path))
        victim = redteam.Victim(cfg.victim_path, llm, cfg.victim_responses, cfg.victim_max_new_tokens)
        if cfg.classifier_kind == "judge":
            llm = self.start(cfg.classifier_path, split.get("judge"), redteam.context(cfg.classifier_path))
            classifier = redteam.Judge(cfg.classifier_path, llm)
        else:
            with self.transformers_models():
                classifier = redteam.SequenceClassifier(cfg.classifier_path, self.device, cfg.dtype, cfg.unsafe_label,
                                                        cfg.micro_batch)
        return redteam.Reward(victim, classifier, self.tokenizer.eos_token_id, cfg.seed)

    def start(self, path: str, memory: float | None, max_model_len: int, **extra):
        """A vLLM engine of the model at `path` on this device, kept in this process beside any others (vLLM 0.32
        lets one process hold several: the later ones reuse its one-rank torch.distributed group and model-parallel
        groups, vllm/distributed/parallel_state.py:1905, 1988, 2366-2404, vllm/v1/worker/gpu_worker.py:1664-1678).
        `memory`: its fraction of the GPU (gpu_memory_utilization); on the CPU its KV cache is sized to this run."""
        from vllm import LLM
        kwargs = dict(model=path, dtype=self.cfg.dtype, seed=self.cfg.seed, max_model_len=max_model_len,
                      enforce_eager=self.device.type == "cpu", enable_prefix_caching=True,
                      use_tqdm_on_load=False, **extra)  # its loading bar would break the trainer's
        if self.device.type == "cuda":  # pick this GPU without hiding the others (CUDA IPC needs them)
            kwargs.update(device_ids=[self.device.index], gpu_memory_utilization=memory)
            # vLLM caches its compiled graphs under VLLM_CACHE_ROOT by rank
            # (vllm/compilation/decorators.py:565-584, vllm/compilation/backends.py:1074-1084), and every
            # engine here is rank 0 of its own, while Inductor's code hard-codes the device index: engines
            # on other GPUs would load each other's artifacts. A cache per device index; read when the
            # engine starts (vllm/envs.py).
            import vllm.envs
            root, own = vllm.envs.VLLM_CACHE_ROOT, f"tba-cuda{self.device.index}"
            os.environ["VLLM_CACHE_ROOT"] = root if os.path.basename(root) == own else os.path.join(root, own)
        else:  # vLLM's sampler torch.compiles its log-prob gather on first use: 3-4 s of C++ build
            # per process on the CPU, for no speed-up there (this process only; GPUs keep compiling)
            torch._dynamo.config.disable = True
            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # the user's GiB, else what this run needs
                kwargs.update(kv_cache_memory_bytes=cpu_kv_cache_bytes(path, self.cfg.dtype, max_model_len))
            # A seeded request whose prefill is split over two engine steps crashes the CPU engine: the runner
            # rewinds its generator (vllm/v1/worker/gpu_model_runner.py:3498-3502), which a CPU generator
            # cannot ("CPU Generator does not use offset"). Whole prefills only, as vLLM's own CPU platform
            # does for MLA (vllm/platforms/cpu.py:516-530). It happens once a round's prompts pass the
            # 4,096-token step budget (red-teaming: 32 x 8 requests of a 223-token prompt).
            kwargs.update(enable_chunked_prefill=False)
        self.engines.append(LLM(**kwargs))
        return self.engines[-1]

    # --- weights ---------------------------------------------------------------------------
    def load(self, named_tensors, version: int):
        """Reload weights into vLLM (Hugging Face names) and drop the prefix cache."""
        if self.policy is not None:  # the evaluation's copy follows: read the tensors twice
            named_tensors = list(named_tensors)
            unexpected = self.policy.load_state_dict(dict(named_tensors), strict=False).unexpected_keys
            if unexpected:
                raise RuntimeError(f"weights the evaluation's policy copy does not have: {unexpected[:3]}")
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
        if weights.version.value == self.version and weights.ref_version.value == self.ref_version:
            return False
        with locked(weights, alive, timeout, self.device):
            if weights.version.value != self.version:
                self.load(list(weights.tensors.items()), weights.version.value)
            if weights.ref_version.value != self.ref_version:
                self.reference().load_state_dict(weights.ref, strict=False)
                self.ref_version = weights.ref_version.value
        return True

    def reference(self):
        """pi_ref, a transformers model on this device (frozen: the initial model until a reset)."""
        if self.ref is None:
            self.ref = self.transformers_copy(self.cfg.model_path)
        return self.ref

    def transformers_copy(self, path: str):
        """A frozen transformers model on this device, in the run's dtype."""
        from transformers import AutoModelForCausalLM
        with self.transformers_models():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, self.cfg.dtype))
        return model.to(self.device).eval().requires_grad_(False)

    def initial_reference(self):
        """The SFT model (the initial pi_ref): pi_ref itself unless TBA′ has reset it."""
        if self.ref_version == 0:
            return self.reference()
        if self.sft is None:
            self.sft = self.transformers_copy(self.cfg.model_path)
        return self.sft

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

    def calibrate(self, count: int, n: int, timed: bool = True):
        """--generation-slowdown: a round of `count` prompts x n, to warm the engine up, or (`timed`) to
        measure the seconds a generated token costs it, warm and (the caller sees to it) alone. Prompts and
        seeds of their own: the run's samples do not change; the prefix cache is emptied around them."""
        rng = np.random.default_rng([self.cfg.seed, seeds.CALIBRATION])
        ids = rng.choice(len(self.prompts), min(count, len(self.prompts)), replace=False)
        self.llm.reset_prefix_cache()
        outputs, seconds = self.generate(ids, n, (self.cfg.seed, seeds.CALIBRATION, seeds.CALIBRATION, int(timed)))
        self.llm.reset_prefix_cache()
        if timed:
            self.per_token = seconds / max(1, sum(len(c.token_ids) for o in outputs for c in o.outputs))

    def search(self, prompt_ids, n: int, seed: tuple) -> tuple[list[Trajectory], dict]:
        """n sampled responses to each prompt, scored, with reference and behaviour log-probs."""
        outputs, generate = self.generate(prompt_ids, n, seed)
        tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
        alone = tokens * self.per_token if self.per_token else generate  # the generation's cost alone
        slept = slow_down(generate, alone, self.cfg.generation_slowdown)
        done = [(int(p), c) for p, out in zip(prompt_ids, outputs) for c in out.outputs]
        rewards = self.reward([self.prompts[p] for p, _ in done], [c.token_ids for _, c in done],
                              [c.text for _, c in done], [self.answers[p] for p, _ in done])
        trajectories = [Trajectory(prompt_id=p, response=np.asarray(c.token_ids, dtype=np.int32), reward=float(r),
                                   logp_ref=0.0, logp_behaviour=float(c.cumulative_logprob), version=self.version,
                                   ref_version=self.ref_version)
                        for (p, c), r in zip(done, rewards)]
        pairs, index = unique_pairs(trajectories, self.prompts)
        logp_ref = self.logprobs(self.reference(), pairs, self.cfg.temperature)
        for t, i in zip(trajectories, index):
            t.logp_ref = logp_ref[i]
        if self.cfg.dedup_similarity:  # the best buffer compares attacks by their embeddings (buffer.py)
            for t, e in zip(trajectories, self.sentence_embedder()([c.text for _, c in done]).cpu().numpy()):
                t.embedding = e
        timed = getattr(self.reward, "seconds", {})  # red-teaming: the victim's and the classifier's s
        return trajectories, {"tokens": tokens, "generate": generate, "slept": slept, **timed,
                              "charged": alone * self.cfg.generation_slowdown, "per_token": self.per_token}

    def explore(self, seed: tuple, prompt) -> float:
        """A request's sampling temperature: --temperature, or with --explore-temp-min half the time one drawn
        uniformly from [min, max] (Lee et al.'s online batches, trainers/gfn_trainer.py:279-285). TB's log-probs
        stay at --temperature: the request is then off-policy, which TB allows."""
        low, high = self.cfg.explore_temp_min, self.cfg.explore_temp_max
        rng = np.random.default_rng([*seed, int(prompt), seeds.EXPLORE])
        return float(rng.uniform(low, high)) if low and rng.random() < 0.5 else self.cfg.temperature

    def sentence_embedder(self):
        """The red-teaming embedder (--embedding-model), loaded on first use: the evaluation's diversity and
        the best buffer's near-duplicates."""
        if self.embedder is None:
            from tasks import redteam
            with self.transformers_models():
                self.embedder = redteam.Embedder(self.cfg.embedding_model_path, self.device, self.cfg.dtype,
                                                 self.cfg.micro_batch)
        return self.embedder

    @torch.no_grad()
    def logprobs(self, model, pairs: list[tuple[list[int], np.ndarray]], temperature: float) -> list[float]:
        """Summed log-probs of (prompt, response) pairs under a transformers model, in micro-batches."""
        out = []
        for i in range(0, len(pairs), self.cfg.micro_batch):
            batch = collate(pairs[i:i + self.cfg.micro_batch], 0, self.device)
            out += sequence_logprobs(model, *batch, temperature).tolist()
        return out

    def close(self):
        """Shut the engines down, the policy's last (it also tears down the process group it shares with this
        process)."""
        for llm in reversed(self.engines):
            llm.llm_engine.engine_core.shutdown()

    def logprob(self, prompt: list[int], response: list[int]) -> float:
        """vLLM's summed log-prob of a fixed response (raw logits: temperature 1), for checks."""
        from vllm import SamplingParams

        out = self.llm.generate([{"prompt_token_ids": prompt + list(response)}],
                                SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        return sum(out.prompt_logprobs[len(prompt) + i][tok].logprob for i, tok in enumerate(response))

    # --- evaluation ------------------------------------------------------------------------
    def evaluate(self, prompts: list[list[int]], answers: list[str], beat=lambda done: None) -> tuple[dict, dict]:
        """One response to each prompt with the loaded weights (greedy, or at --eval-temperature): their
        scores, and the first problem's as an example. Tasks with an exact answer: {"accuracy"} (pass@1).
        With a reward model (tldr), as the authors' eval_tldr/: "score" (the mean training reward),
        "win_rate" (the judge, --eval-reward-model, scores the response above the reference summary),
        "kl_ref_theta_per_token" (the mean over responses of the per-token mean of the full-vocabulary
        KL(pi_ref || pi_theta) along the response, pi_ref the SFT model), "ppl_sft" (the mean over
        responses of exp(mean NLL of the response tokens under the SFT model)) and "ppl_sft_authors"
        (the same NLL summed, divided by the whole sequence's predicted tokens, prompt included: what
        their src/perplexity.py:50-57 computes, the perplexity of the paper's Table 1).
        Every score is a mean over responses, taken over parts of a search round's size (B x responses
        per prompt; 256 at least, vLLM's batch of sequences on the CPU), each followed by beat(prompts
        done): a searcher's evaluation can outlast --timeout (the TL;DR one at 2.8B, the 6.9B judge over
        the whole validation split: about 15 minutes on an A100), and the trainer's watch hears a beat
        after each part, while a part that hangs is silence."""
        if self.task.score == "toxicity":  # red-teaming: sampled attacks: asr, toxicity, diversity, unique
            return self.evaluate_redteam(prompts)
        size = max(256, self.cfg.prompts_per_step * self.cfg.search_samples_per_prompt)
        rows, example = {}, None
        for i in range(0, len(prompts), size):
            part, first = self.evaluate_part(prompts[i:i + size], answers[i:i + size])
            for k, v in part.items():
                rows.setdefault(k, []).extend(v)
            example = example or first
            beat(min(i + size, len(prompts)))
        return {k: float(np.mean(v)) for k, v in rows.items()}, example

    def evaluate_part(self, prompts: list[list[int]], answers: list[str]) -> tuple[dict, dict]:
        """evaluate() on some prompts: each score's value for each response, and the first's example."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=self.cfg.eval_temperature, max_tokens=self.cfg.max_new_tokens,
                                seed=self.cfg.seed if self.cfg.eval_temperature else None)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        responses = [list(o.outputs[0].token_ids) for o in outputs]
        rewards = self.reward(prompts, responses, [o.outputs[0].text for o in outputs], answers)
        if self.task.score == "accuracy":
            scores = {"accuracy": list(rewards)}
        else:
            if self.judge is None:
                same = self.cfg.eval_reward_model_path == self.cfg.reward_model_path
                self.judge = self.reward if same else self.reward_model(self.cfg.eval_reward_model_path)
            eos = self.tokenizer.eos_token_id
            references = [self.tokenizer(a).input_ids for a in answers]
            references = [r if r[-1:] == [eos] else r + [eos] for r in references]
            # the judge reads its score where transformers' pooling does (load_and_eval.py's pipeline)
            ours = self.judge.score([p + r for p, r in zip(prompts, responses)], pooling=True)
            theirs = self.judge.score([p + r for p, r in zip(prompts, references)], pooling=True)
            pairs = list(zip(prompts, responses))
            if self.policy is None:
                raise RuntimeError("this engine was built with evaluates=False: no policy copy for the KL")
            kl, nll = response_kl_nll(self.policy, self.initial_reference(), pairs, self.cfg.micro_batch, self.device)
            length = np.array([max(1, len(r)) for r in responses])
            scores = {"score": list(rewards), "win_rate": list(np.greater(ours, theirs)),
                      "kl_ref_theta_per_token": list(kl / length), "ppl_sft": list(np.exp(nll / length)),
                      "ppl_sft_authors": list(np.exp(nll / (length + [len(p) - 1 for p in prompts])))}
        example = dict(prompt=self.tokenizer.decode(prompts[0], skip_special_tokens=True),
                       completion=outputs[0].outputs[0].text, reward=float(rewards[0]))
        return scores, example

    def evaluate_redteam(self, prompts: list[list[int]]) -> tuple[dict, dict]:
        """--eval-limit attacks (default 1,024) sampled at temperature 1 with the loaded weights, EOS
        blocked before 5 tokens as Lee et al.'s eval.py, each answered by the victim: redteam.scores(). The
        example is the first attack, its mean P(unsafe) as its reward, and the victim's first response."""
        from tasks import redteam
        from vllm import SamplingParams

        counts = redteam.eval_counts(len(prompts), self.cfg.eval_limit)
        params = [SamplingParams(n=n, temperature=1.0, max_tokens=self.cfg.max_new_tokens, min_tokens=redteam.MIN_ATTACK_TOKENS,
                                 seed=int(np.random.SeedSequence([self.cfg.seed, seeds.EVAL_ATTACKS, self.version, i])
                                          .generate_state(1)[0]))
                  for i, n in enumerate(counts) if n]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p, n in zip(prompts, counts) if n], params,
                                    use_tqdm=False)
        attacks = [c.text for o in outputs for c in o.outputs]
        scores, p_unsafe = redteam.scores(self.reward, self.sentence_embedder(), attacks)
        example = dict(prompt=self.tokenizer.decode(prompts[0], skip_special_tokens=True), completion=attacks[0],
                       reward=p_unsafe[0], response=self.reward.responses[0])
        return scores, example


def slow_down(generate: float, alone: float, factor: float) -> float:
    """--generation-slowdown: after a generation that took `generate` s and would have taken `alone` s on
    an engine of its own (Engine.calibrate), sleep until `factor` x `alone` has passed, as a model `factor`
    times as slow to generate would take on a device of its own (tools/bench.py part 9). Sleeping uses no
    core, and charging the cost alone, not the time taken, keeps searchers that share a few CPU cores from
    multiplying that contention by `factor`: on a GPU node they share nothing. Returns the seconds slept."""
    seconds = factor * alone - generate if factor != 1 else 0.0
    if seconds > 0:
        time.sleep(seconds)
    return max(0.0, seconds)


@torch.no_grad()
def response_kl_nll(policy, ref, pairs, micro_batch: int, device, chunk_bytes: int = 2**28):
    """For each (prompt, response) pair: the full-vocabulary KL(ref || policy) summed over the
    distributions that predict the response's tokens, and the response's summed NLL under `ref`,
    both at temperature 1. Returns two (N,) arrays. (The authors' src/kl.py:59-71 takes the KL at the
    positions of the response's tokens, one later: from the distribution after its first token to the
    one after its last; here it is the distributions the response was drawn from.)"""
    kl_out, nll_out = [], []
    for i in range(0, len(pairs), micro_batch):
        ids, attention, response = collate(pairs[i:i + micro_batch], 0, device)  # (n, T) each
        logits = policy(input_ids=ids, attention_mask=attention).logits[:, :-1]    # (n, T-1, V): predicts t+1
        ref_logits = ref(input_ids=ids, attention_mask=attention).logits[:, :-1]   # (n, T-1, V)
        targets, mask = ids[:, 1:], response[:, 1:].float()                        # (n, T-1)
        n, T1, V = logits.shape
        C = max(1, chunk_bytes // (4 * n * V))  # positions per chunk of float32 log-softmax
        kl, nll = torch.zeros(n, device=device), torch.zeros(n, device=device)    # (n,)
        for s in range(0, T1, C):
            logp = torch.log_softmax(logits[:, s:s + C].float(), dim=-1)           # (n, C, V)
            logp_ref = torch.log_softmax(ref_logits[:, s:s + C].float(), dim=-1)   # (n, C, V)
            kl += ((logp_ref.exp() * (logp_ref - logp)).sum(-1) * mask[:, s:s + C]).sum(1)
            nll -= (logp_ref.gather(-1, targets[:, s:s + C, None]).squeeze(-1) * mask[:, s:s + C]).sum(1)
        kl_out += kl.tolist()
        nll_out += nll.tolist()
    return np.array(kl_out), np.array(nll_out)


def kv_bytes_per_token(path: str, dtype: str) -> int:
    """Bytes of KV cache a token takes in a vLLM engine of the model at `path`: keys and values of every layer."""
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(path).get_text_config()
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def cpu_kv_cache_bytes(path: str, dtype: str, max_model_len: int) -> int:
    """KV cache for vLLM's CPU engine: room for its 256 concurrent sequences (vLLM's CPU default,
    engine/arg_utils.py) of the engine's longest length, between 32 MiB and 1 GiB. The CPU engine
    allocates and zeroes all of it at start: the tiny model needs a few MiB, not the GiBs a default
    would give (0.35 s less start-up per engine, 1 GiB less memory per searcher)."""
    tokens = 256 * -(-max_model_len // 256) * 256  # sequences x length in whole blocks
    return int(min(2**30, max(2**25, kv_bytes_per_token(path, dtype) * tokens)))


# --- a searcher GPU's memory: vLLM's share, and its split between the engines of one process ----------
def memory_needs(cfg, evaluates: bool = True) -> tuple[dict[str, tuple[int, int, int]], dict[str, int]]:
    """memory_split's inputs for a searcher of this run (`evaluates`: the one that evaluates, the largest),
    from the models' configs (counted on the meta device: no weights read) and the run's settings, in --dtype.
    Each vLLM engine (the policy's; red-teaming's victim and judge): its weights and the working memory vLLM
    measures, estimated with its defaults on an A100 or a smaller card, 8,192 tokens a step and 256 sequences
    (vllm/engine/arg_utils.py:2942-2951): a step's activations, the sampler's float32 logits and log-probs, and
    0.5 GiB of CUDA graphs and workspaces; the least KV cache, one whole sequence (vLLM starts no engine with
    less: vllm/v1/core/kv_cache_utils.py:1104-1136); the KV cache a round can fill: 256 sequences at once of the
    policy's or the victim's length, the judge's one step of prompts. Beside the engines, by name: pi_ref and
    its log-prob pass (--micro-batch sequences' logits, twice in the TL;DR evaluation's KL, which holds the
    policy copy's and pi_ref's at once, and a 256 MiB float32 chunk, loss.sequence_logprobs), the reward
    model, the evaluation's policy copy, judge and SFT model (TBA′), red-teaming's sequence classifier and
    embedder, and 1 GiB for the CUDA context and the allocator's cache."""
    import transformers
    d = torch.empty(0, dtype=getattr(torch, cfg.dtype)).element_size()

    def size(path, cls=transformers.AutoModelForCausalLM):  # (text config, bytes of the weights)
        config = transformers.AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            return config.get_text_config(), sum(p.numel() for p in cls.from_config(config).parameters()) * d

    def engine(path, longest, length, seqs):  # (besides the KV cache, the least KV cache, what a round can fill)
        c, weights = size(path)
        ffn = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * c.hidden_size
        work = 8192 * (4 * c.hidden_size + 2 * ffn) * d + 3 * 256 * c.vocab_size * 4 + 2**29
        token = kv_bytes_per_token(path, cfg.dtype)
        return weights + work, token * longest, token * min(seqs, 256) * length

    scorer = transformers.AutoModelForSequenceClassification
    seqs = cfg.prompts_per_step * cfg.search_samples_per_prompt
    tldr_eval = TASKS[cfg.task].score == "win_rate" and evaluates
    engines = {"attacker" if cfg.victim_path else "policy": engine(cfg.model_path, cfg.max_model_len,
                                                                 cfg.max_model_len, seqs)}
    c, policy = size(cfg.model_path)
    beside = {"pi_ref": policy, "its logits": cfg.micro_batch * cfg.max_model_len * c.vocab_size * d * (1 + tldr_eval),
              "a float32 chunk": 2**28}
    if cfg.reward_model_path:
        beside["the reward model"] = size(cfg.reward_model_path, scorer)[1]
    if tldr_eval:
        beside["the evaluation's policy copy"] = policy
        if cfg.eval_reward_model_path != cfg.reward_model_path:
            beside["the judge"] = size(cfg.eval_reward_model_path, scorer)[1]
        if cfg.ref_reset_every:
            beside["the SFT model"] = policy
    if cfg.victim_path:
        from tasks import redteam
        answer = cfg.victim_max_new_tokens or redteam.CHAT_SAMPLING["max_new_tokens"]  # the longer default
        engines["victim"] = engine(cfg.victim_path, redteam.context(cfg.victim_path), cfg.max_model_len + answer,
                                   seqs * cfg.victim_responses)
        if cfg.classifier_kind == "judge":
            engines["judge"] = engine(cfg.classifier_path, redteam.context(cfg.classifier_path), 8192, 1)
        else:
            beside["the classifier"] = size(cfg.classifier_path, scorer)[1]
        beside["the embedder"] = size(cfg.embedding_model_path, transformers.AutoModel)[1]
    beside["the CUDA context"] = 2**30
    return engines, beside


def memory_share(card: int, beside: dict[str, int]) -> float:
    """--searcher-memory's default: all of a GPU of `card` bytes that the models beside the engines leave
    (rounded down to 0.01), at most vLLM's own default of 0.9. vLLM takes its share when it starts and refuses
    to start with less free (vllm/v1/worker/utils.py:716-772); the searcher loads the rest after it."""
    return min(0.9, math.floor(100 * (1 - sum(beside.values()) / card)) / 100)


def memory_split(card: int, share: float, engines: dict[str, tuple[int, int, int]],
                 beside: dict[str, int]) -> dict[str, float]:
    """Each engine's gpu_memory_utilization on a GPU of `card` bytes whose `share` (--searcher-memory) holds
    this process's vLLM engines (memory_needs gives `engines` and `beside`). engines[name] = (bytes besides
    the KV cache, the least KV cache, the KV cache a round can fill): each gets its first two, and the share's
    spare goes to the KV caches in proportion to the third. `beside` (the models loaded after the engines)
    must fit in 1 - share. In vLLM 0.32 an engine's fraction is a budget of its own: its KV cache is what its
    weights, activations and CUDA graphs leave of it, and the engines started before it count as another process
    (vllm/v1/worker/utils.py:716-770, vllm/v1/worker/gpu_worker.py:713-744, vllm/utils/mem_utils.py:242-245).
    Raises ValueError, one line naming what does not fit."""
    gib = lambda b: f"{b / 2**30:.1f} GiB"
    them = f"the {' + '.join(engines)} engine" + ("s'" if len(engines) > 1 else "'s")
    fixed, rest = sum(f + least for f, least, _ in engines.values()), sum(beside.values())
    listed = ", ".join(f"{what} {b / 2**30:.1f}" for what, b in beside.items())
    if fixed + rest > card:
        raise ValueError(f"{them} {gib(fixed)} and the models beside {'them' if len(engines) > 1 else 'it'} "
                         f"({listed}: {gib(rest)}) need more than this GPU's {gib(card)}")
    if fixed > share * card:
        raise ValueError(f"{share} of this GPU's {gib(card)} cannot hold {them} {gib(fixed)}; give "
                         f"{'them' if len(engines) > 1 else 'it'} at least {math.ceil(100 * fixed / card) / 100}")
    if rest > (1 - share) * card:
        raise ValueError(f"{share} of this GPU's {gib(card)} leaves less than the {gib(rest)} of the models beside "
                         f"the engines ({listed}); give the engines at most {math.floor(100 * (1 - rest / card)) / 100}")
    spare, wanted = share * card - fixed, sum(w for *_, w in engines.values())
    return {name: (f + least + spare * w / wanted) / card for name, (f, least, w) in engines.items()}


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE")


def quiet_loading():
    """No loading and saving bars from transformers in this process (they would break the trainer's
    progress bar and fill logs); the hub's download bars stay."""
    import huggingface_hub.utils
    import transformers
    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.enable_progress_bars()


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


def run(index: int, cfg: dict, weights: SharedWeights, queue, stop, evals, data, device: str, calibration):
    """Searcher process main: search, push, reload weights when they move, until told to stop.
    Searcher 0 also answers evaluation requests (`evals`) between rounds. `calibration`: (a counter of
    this node's started engines, a lock) for --generation-slowdown's calibration alone."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # signals to the whole group: the trainer decides, then stops us
        signal.signal(sig, signal.SIG_IGN)
    for k in list(os.environ):  # drop torchrun's variables: vLLM makes its own one-process group
        if k in TORCHRUN_VARS or k.startswith("TORCHELASTIC_"):
            del os.environ[k]
    threading.Thread(target=watchdog, daemon=True).start()
    cfg = SimpleNamespace(**cfg)
    try:
        torch.set_num_threads(cfg.threads)  # before vLLM starts: it pins the thread count after
        quiet_loading()
        engine = Engine(cfg, device, cfg.searcher_memory, data.prompts, data.answers, evaluates=evals is not None)
        if cfg.generation_slowdown != 1:
            calibrate_alone(engine, *calibration, cfg)
        rng = np.random.default_rng([cfg.seed, index, seeds.SEARCH_PROMPTS])
        round_ = 0
        receive(weights, stop, parent_alive)
        while not stop.is_set():
            engine.sync(weights, parent_alive, cfg.timeout)
            t0 = time.time()
            ids = rng.choice(len(data.prompts), size=min(cfg.round_prompts, len(data.prompts)), replace=False)
            trajectories, stats = engine.search(ids, cfg.search_samples_per_prompt, (cfg.seed, index + 1, round_))
            put(queue, dict(kind="search", searcher=index, version=engine.version, trajectories=trajectories,
                            seconds=time.time() - t0, **stats), stop)
            round_ += 1
            requested = drain_requests(evals)
            if requested is not None:  # after a round, so that the trainer gets its first data first
                if engine.version != requested:  # the weights asked for if it holds them (the initial
                    engine.sync(weights, parent_alive, cfg.timeout)  # model's), else the newest
                t0 = time.time()
                beat = lambda done: put(queue, dict(kind="beat", searcher=index, done=done), stop)  # alive: Watch
                scores, example = engine.evaluate(data.test_prompts, data.test_answers, beat)
                put(queue, dict(kind="eval", searcher=index, version=engine.version, scores=scores, example=example,
                                seconds=time.time() - t0), stop)
    except Dead:
        sys.exit(3)
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    finally:
        queue.cancel_join_thread()  # never block exit on undelivered data


def calibrate_alone(engine, started, lock, cfg):
    """Engine.calibrate: a warm-up round, then, once every engine of this node has started and warmed up
    (or --timeout has passed), the timed round one engine at a time: each is timed alone, as on a device
    of its own, not sharing the cores with the others' start-up or calibration."""
    engine.calibrate(cfg.round_prompts, cfg.search_samples_per_prompt, timed=False)
    with started.get_lock():
        started.value += 1
    deadline = time.time() + cfg.timeout
    while started.value < cfg.searchers and time.time() < deadline:
        time.sleep(0.05)
        parent_alive()
    acquire(lock, parent_alive, cfg.timeout)
    try:
        engine.calibrate(cfg.round_prompts, cfg.search_samples_per_prompt)
    finally:
        lock.release()


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
