"""A searcher: a vLLM engine with a local copy of the policy, sampling, rewards, reference log-probs.

TBA's searchers (Sec. 3.1) keep generating and never wait for training. Each round a searcher
takes `round_prompts` training prompts at random, samples `search_samples_per_prompt` responses
to each with vLLM, scores them with the task's reward, computes their summed log-probs under pi_ref
(a frozen copy of the initial model, logits / temperature), and puts the trajectories on the bounded
queue to the trainer. Before each round it checks the weight version: if the trainer published new
weights it reloads them into vLLM and resets the prefix cache (vLLM never clears it after new weights
arrive; stale cached prefixes would keep the old policy's values). How the engine decodes (vLLM's loop, or
step by step for the emulated device time, --generation-slowdown) is its decoder's (runtime/decoding.py).

This file is the searcher's loop (`run`, below) and its `Engine`: generate, score, pi_ref, reload,
evaluate. The task's reward and evaluation come from its scorer (tasks/task.py); the weights arrive
through runtime/weights.py (shared tensors, a version counter and a lock: its docstring gives the
protocol); vLLM's options and workarounds are in runtime/vllm_env.py. `Engine` is the same code in a
searcher process and, with `--searchers 0`, inside the trainer. Searcher 0
(of node 0) also evaluates (greedy, on the held-out problems) after a round when the trainer has asked
for it, with a beat to the trainer after each part, so that a long evaluation is not taken for silence.
"""

import gc
import itertools
import os
import signal
import sys
import threading
import time
import traceback
import zlib

from runtime import vllm_env

vllm_env.set_up()  # before torch and vLLM are imported, here and in the fork server, which imports this file

import numpy as np
import torch

import tasks
from buffer import Trajectory
from loss import LOSSES, collate, reads, response_logprobs, sequence_logprobs, unique_pairs
from runtime import decoding, seeds, slowdown
from runtime.errors import STOPS, Dead, WrongWeights
from runtime.evaluations import Requests
from runtime.processes import SAID, last_word, parent_alive, send
from runtime.weights import WAIT, Inbox, SharedWeights, arrival_plan, check_arrival


# ===== the searcher's loop: its side of the paper's Algorithm 1 ==================================
def run(index: int, cfg, shared: SharedWeights, channels, data, device: str, first_round: int = 0):
    """A searcher process: its start (signals, the engine, the weights' inbox, searcher 0's evaluation requests), its
    loop (`loop`), and its end: an exit status a fault (3: the trainer is gone; 4: no weights for --timeout; 5, SAID:
    weights that did not arrive intact, said to the trainer first)."""
    become_searcher()
    try:
        torch.set_num_threads(cfg.threads)  # before vLLM starts: it pins the thread count after
        vllm_env.quiet_loading()
        # vLLM's engine start collects the whole heap five times (vllm/model_executor/model_loader/base_loader.py:92,
        # 112, vllm/utils/gc_utils.py:127-129 from vllm/v1/engine/core.py:253): frozen, the imports' objects are skipped
        gc.freeze()  # (0.7 s of a CPU engine's start); its shutdown unfreezes them (vllm/v1/engine/core.py:836)
        engine = Engine(cfg, device, cfg.searcher_memory, data.prompts, data.answers,
                        evaluates=channels.evals is not None)
        gc.enable()  # (off since the fork server's preload, runtime.vllm_env, and the engine's imports)
        slowdown.calibrate_alone(engine, channels.calibration, cfg, parent_alive)  # --generation-slowdown
        weights = Inbox(shared, index % cfg.searchers, channels.stop, parent_alive, cfg.timeout)
        requests = Requests(channels, parent_alive, cfg.timeout)
        engine.follow(weights, requests, first_round)  # an evaluation's weights kept until it is made
        loop(index, cfg, channels, data, engine, weights, requests, first_round)
    except Dead:
        sys.exit(3)
    except TimeoutError as e:  # the trainer lives but sent no weights for --timeout: one line, not a traceback
        print(f"searcher {index}: {e}", file=sys.stderr, flush=True)
        sys.exit(4)
    except WrongWeights as e:  # the trainer's line names it (runtime.fleet.Fleet.take, alive)
        last_word(channels, dict(kind="fault", searcher=index, line=f"searcher {index}: {e}"))
        sys.exit(SAID)
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    finally:
        channels.queue.cancel_join_thread()  # never block exit on undelivered data


def loop(index: int, cfg, channels, data, engine: "Engine", weights: Inbox, requests: Requests, first_round: int):
    """Reload the weights when they move, search, send, until told to stop; searcher 0 also evaluates the steps asked
    for (`Requests`). With --lag L, round r is step r's and waits for the weights of step r - L exactly."""
    say = lambda message: send(channels.queue, dict(searcher=index, **message), channels.stop)
    for round_ in itertools.count(first_round):
        if channels.stop.is_set():
            break
        # ===== the weights: the newest published, or (--lag) exactly those of step round - L =======
        for_step = -1  # streaming: a round for any step, by the newest weights
        if cfg.lag is not None:
            for_step, version = lagged(cfg, round_, lambda: requests.wanted(engine.version))
            weights.wait_for(version, lambda: say(dict(kind="beat")))
        # ===== evaluate, if asked (after a first round: the trainer's first data first) ============
        if round_ > first_round and requests.due(engine.version):
            requests.evaluate(engine, data, say)
        engine.sync(weights)
        if cfg.lag is not None:
            weights.announce(lagged(cfg, round_ + 1, lambda: None)[1])  # held, it needs the next round's now
            if for_step is None:  # every round made: only evaluations are left to do
                time.sleep(WAIT / 4)
                continue
        # ===== search: sample, score, pi_ref's log-probs; send to the trainer =======================
        t0 = time.time()
        rng = np.random.default_rng([cfg.seed, index, round_, seeds.SEARCH_PROMPTS])  # a resumed run's too
        ids = rng.choice(len(data.prompts), size=min(engine.decoder.prompts(), len(data.prompts)), replace=False)
        trajectories, stats = engine.search(ids, cfg.search_samples_per_prompt, (cfg.seed, index + 1, round_),
                                            for_step=for_step)
        say(dict(kind="search", version=engine.version, verified=engine.verified, trajectories=trajectories,
                 started=t0, seconds=time.time() - t0, **stats))


def lagged(cfg, round_: int, wanted) -> tuple[int | None, int | None]:
    """--lag: (the trainer step whose batch round `round_` makes, the weights' version it needs): (round,
    round - L); past --steps no batch needs a round: (None, the next evaluation's weights, `wanted()`)."""
    return (round_, max(0, round_ - cfg.lag)) if round_ < cfg.steps else (None, wanted())


def evaluation_seed(seed: int, prompt: list[int]) -> tuple:
    """A held-out problem's sampling seed (--eval-temperature above 0): from the run's and its prompt, so that each
    problem's noise is its own and the same at every evaluation, in whatever part it falls."""
    return seed, seeds.EVALUATION, zlib.crc32(np.asarray(prompt, np.int64).tobytes())


def max_tokens(cfg, prompt: list[int]) -> int:
    """A response's length limit: --max-new-tokens, or what --context leaves after its prompt if that is less."""
    return min(cfg.max_new_tokens, cfg.context - len(prompt)) if cfg.context else cfg.max_new_tokens


class Engine:
    """vLLM (the searcher's copy of the policy), pi_ref and the task's scorer, for searching, scoring and
    evaluation."""

    def __init__(self, cfg, device: str, memory: float, prompts: list[list[int]], answers: list[str],
                 evaluates: bool = True):
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
        self.tokenizer = self.llm.get_tokenizer()  # vLLM's, loaded with its engine: not a second load
        self.version = 0          # trainer step of the weights loaded (0 = the initial model)
        self.verified = -1        # the last version whose arrival was checked (`verify`)
        self.plan = (None,)       # the published names, and how their arrival is checked (`verify`)
        self.pi_ref_version = 0   # trainer step whose weights pi_ref holds (TBA′; 0 = the initial model)
        self.pi_ref_model = None  # loaded on the first search (`pi_ref`)
        self.weights = None       # the shared weights (`follow`)
        self.resumed = (0, 0)     # (the step a run begins at, the pi_ref version published then): `follow`
        self.requests = Requests()  # searcher 0's evaluations asked for (`follow`); none elsewhere
        self.reads = reads(LOSSES[cfg.loss])  # the fields the loss reads: pi_ref's log-probs, or none
        costs = slowdown.read_calibration(cfg.calibration) if cfg.calibration else {}  # --generation-slowdown's clock
        self.clock = slowdown.Clock(cfg.generation_slowdown, costs.get("seconds_per_token"), cfg.decode_cost,
                                    cfg.prompts_per_step * cfg.search_samples_per_prompt, cfg.timeout, cfg.decode_shape,
                                    costs.get("devices", 1))
        self.decoder = decoding.decoder(cfg, self.llm, self.clock)
        if cfg.keep_full:
            self.llm.llm_engine.set_weight_version("0")  # each token labelled with the weights that sampled it
        self.scorer = task.scorer(self, task, evaluates)

    # --- searching -------------------------------------------------------------------------
    def generate(self, prompt_ids, n: int, seed: tuple, plain: bool = False) -> list[tuple[int, list]]:
        """vLLM's n samples of each prompt, seeded: (prompt id, its n completions) for each prompt done (decoding.py).
        `plain`: a round of these prompts alone, stepped, whatever the run's decoder (the emulation's calibration)."""
        decoder = decoding.Stepped(self.llm, self.clock) if plain else self.decoder  # no prompt ids: drain (Full)
        return decoder.generate(self.to_requests(prompt_ids, n, seed), drain=prompt_ids is None)

    def to_requests(self, prompt_ids, n: int, seed: tuple) -> list[decoding.Request]:
        explore = self.explore if self.cfg.explore_temp_min else lambda seed, p: self.cfg.temperature
        return [decoding.Request(int(p), self.prompts[p], n, explore(seed, p), max_tokens(self.cfg, self.prompts[p]),
                                 seed) for p in (() if prompt_ids is None else prompt_ids)]

    def search(self, prompt_ids, n: int, seed: tuple, for_step: int = -1) -> tuple[list[Trajectory], dict]:
        """Each prompt's n responses, scored, with pi_ref's and the behaviour's log-probs and their weights' versions."""
        done = [(p, c) for p, completions in self.generate(prompt_ids, n, seed) for c in completions]
        if for_step >= 0 and self.cfg.ref_reset_every:  # TBA′ with --lag: scored under the pi_ref of its step
            self.reference_of(for_step)
        texts = [c.text for _, c in done]
        rewards = self.scorer.reward([self.prompts[p] for p, _ in done], [c.token_ids for _, c in done], texts,
                                     [self.answers[p] for p, _ in done])
        trajectories = [Trajectory(prompt_id=p, response=np.asarray(c.token_ids, dtype=np.int32), reward=float(r),
                                   logp_behaviour=float(c.cumulative_logprob), version=self.version,
                                   logp_ref=0.0, pi_ref_version=self.pi_ref_version, for_step=for_step,
                                   truncated=int(c.finish_reason == "length"), behaviour_logps=np.array(
                                       [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)], np.float32))
                        for (p, c), r in zip(done, rewards)]
        if self.cfg.keep_full:  # weights loaded in flight: the first and the last that sampled each response
            for t, (_, c) in zip(trajectories, done):
                versions = [int(span.version) for span in (c.weight_versions or ())] or [self.version]
                t.version, t.version_last = versions[0], versions[-1]
        pairs, index = unique_pairs(trajectories, self.prompts)
        if "ref_logps" in self.reads:  # the loss reads pi_ref's log-prob of each token
            ref_logps = self.token_logprobs(self.pi_ref(), pairs, self.cfg.temperature)
            logp_ref = [float(r.sum()) for r in ref_logps]
            for t, i in zip(trajectories, index):
                t.ref_logps = ref_logps[i]
        else:  # no pi_ref pass where the loss reads none (NaN: a resumed run with one that does is refused)
            logp_ref = (self.logprobs(self.pi_ref(), pairs, self.cfg.temperature) if "logp_ref" in self.reads
                        else [float("nan")] * len(pairs))
        for t, i in zip(trajectories, index):
            t.logp_ref = logp_ref[i]
        self.scorer.annotate(trajectories, texts)
        return trajectories, {"tokens": sum(len(c.token_ids) for _, c in done), **self.clock.account(),
                              "parts": self.scorer.seconds}

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
        """Summed log-probs of (prompt, response) pairs under a transformers model, --score-batch at a time."""
        n, device = self.cfg.score_batch, self.device
        return [x for i in range(0, len(pairs), n)
                for x in sequence_logprobs(model, *collate(pairs[i:i + n], 0, device), temperature).tolist()]

    @torch.no_grad()
    def token_logprobs(self, model, pairs: list[tuple[list[int], np.ndarray]], temperature: float) -> list[np.ndarray]:
        """Each response token's log-prob under a transformers model, --score-batch at a time: one (T,) array a pair."""
        out = []
        for i in range(0, len(pairs), self.cfg.score_batch):
            part = pairs[i:i + self.cfg.score_batch]
            per = response_logprobs(model, *collate(part, 0, self.device), temperature, [len(p) for p, _ in part],
                                    [len(r) for _, r in part]).float().cpu().numpy()
            out += [row[:len(r)].astype(np.float32) for row, (_, r) in zip(per, part)]
        return out

    def transformers_copy(self, path: str):
        """A frozen transformers model on this device, in the run's dtype."""
        from transformers import AutoModelForCausalLM
        with self.beside():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, self.cfg.dtype))
        return model.to(self.device).eval().requires_grad_(False)

    # --- weights ---------------------------------------------------------------------------
    def load(self, named_tensors: list, version: int):
        """Reload weights into vLLM ((Hugging Face name, tensor) pairs, a list: the scorer may read them
        too) and drop the prefix cache (between rounds: none in flight)."""
        self.scorer.loaded(named_tensors)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
        self.version = version
        if self.cfg.keep_full:  # requests in flight go on under the new weights: runtime/decoding.Full.loaded
            return self.decoder.loaded(self.llm, version)
        # vLLM never drops cached prefixes after new weights: they would keep the old policy's KV values.
        # reset_prefix_cache() returns False when blocks are still in use (vllm/v1/core/block_pool.py:837-845):
        # between two rounds none are, so False is a bug to stop on
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(f"vLLM could not reset its prefix cache after loading the weights of step {version}")

    def sync(self, weights: Inbox) -> bool:
        """Load the published weights if they moved (unless an evaluation keeps those held: `Requests.hold`),
        and pi_ref if it was reset (TBA′), under the read hold; True if anything moved."""
        version, pi_ref_version = weights.versions()
        policy = not self.requests.hold(self.version, version) and version != self.version  # (held pinned)
        if not policy and pi_ref_version == self.pi_ref_version:
            return False
        with weights.read(self.device) as held, self.clock.apart("reload"):  # (time no device pays for)
            if policy and held.version != self.version:
                self.load(held.tensors, held.version)
                self.verify(*held.prints)
                self.requests.hold(self.version)  # under the read: the trainer publishes no newer ones meanwhile
            if held.pi_ref_version != self.pi_ref_version:
                self.pi_ref().load_state_dict(held.pi_ref, strict=False)
                self.pi_ref_version = held.pi_ref_version
        return True

    def verify(self, names: list[str], prints):
        """The weights just loaded, read back from the engine, against the trainer's fingerprints (which
        parameter holds each name: found at the first arrival): WrongWeights names what did not arrive intact,
        or went into no parameter (docs/faults.md); every name is checked."""
        if names != self.plan[0]:
            self.plan = (names, *arrival_plan(self.version, names, vllm_env.engine_params(self.llm, names)))
        check_arrival(self.version, prints, *self.plan[1:], vllm_env.held_fingerprints(self.llm))
        self.verified = self.version

    def reference_of(self, step: int):
        """TBA′ with --lag: pi_ref of the latest reset at or before `step` (the trainer's batch of `step` is trained
        under it; a round of it may have begun before the reset), waited for and loaded: the round is scored under
        the pi_ref of its step, as the authors' trainer scores every batch (their train.py:305-311)."""
        version = step // self.cfg.ref_reset_every * self.cfg.ref_reset_every
        if version <= self.resumed[0]:  # a resumed run's resets come at multiples of its own --ref-reset-every after
            version = self.resumed[1]   # its step; before, the checkpoint's pi_ref (made under the old one, if other)
        if self.weights is None or self.pi_ref_version == version:
            return
        self.weights.wait_for(version, pi_ref=True)
        with self.weights.read(self.device) as held:
            self.pi_ref().load_state_dict(held.pi_ref, strict=False)
            self.pi_ref_version = held.pi_ref_version

    def follow(self, weights: Inbox, requests: Requests, step: int = 0):
        """From now on the engine keeps the weights of an evaluation asked for until it is made (`requests`). `step`:
        where the run (resumed) begins; the pi_ref published then is that of the resets before it (`reference_of`)."""
        self.weights, self.requests = weights, requests
        self.resumed = (step, weights.versions()[1])
        requests.hold(self.version)

    # --- evaluation ------------------------------------------------------------------------
    def evaluate(self, prompts: list[list[int]], answers: list[str], beat=lambda done: None) -> tuple[dict, dict]:
        """The task's scores of the loaded weights on held-out prompts, and an example (its scorer's
        `evaluate`: by default one response to each prompt, in parts, each followed by `beat`). --keep-full: weights
        loaded in flight left cached prefixes of older ones, dropped now that the engine is drained."""
        if self.cfg.keep_full and not self.llm.reset_prefix_cache():
            raise RuntimeError(f"vLLM could not reset its prefix cache before evaluating the weights of step "
                               f"{self.version}: requests still in flight")
        return self.scorer.evaluate(prompts, answers, beat)

    def respond(self, prompts: list[list[int]]) -> tuple[list[list[int]], list[str]]:
        """One response to each prompt, greedy or at --eval-temperature: token ids and text."""
        sampled = self.cfg.eval_temperature > 0
        params = [decoding.sampling_params(self.cfg.eval_temperature, max_tokens(self.cfg, p), logprobs=None,
                                           seed=evaluation_seed(self.cfg.seed, p) if sampled else None) for p in prompts]
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


# --- the searcher's side of the fleet (runtime/fleet.py): its process, the queue, evaluation requests ------
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE")


def become_searcher():
    """Signals to the whole group are the trainer's to decide (it then stops us); torchrun's variables go
    (vLLM makes its own one-process group); a watchdog exits at once if the trainer dies, even while this
    process is busy inside vLLM."""
    for sig in STOPS:
        signal.signal(sig, signal.SIG_IGN)
    for k in list(os.environ):
        if k in TORCHRUN_VARS or k.startswith("TORCHELASTIC_"):
            del os.environ[k]
    threading.Thread(target=watchdog, name="tba-watchdog", daemon=True).start()


def watchdog():
    while True:
        time.sleep(WAIT)
        try:
            parent_alive()
        except Dead:
            os._exit(3)
