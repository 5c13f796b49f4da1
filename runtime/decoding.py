"""How a searcher's engine decodes a round: vLLM's own loop, or the same loop driven one decoding step at a time.

The engine (searcher.Engine.generate) makes one call, `decoder.generate(requests)`, into whichever decoder the
run's flags chose (`decoder`); each returns (prompt id, its n completions) for each prompt:
- `Plain`: LLM.generate, vLLM's own loop (no mode asks for more).
- `Stepped`: the same loop, a step at a time (LLM.generate is this loop: vllm/entrypoints/common/offline.py:
  589-640), so that the emulated device (runtime/slowdown.py, --generation-slowdown) charges each step.
- `Full` (--keep-full): stepped, each response a request of its own, the engine kept at a round's sequences: a
  finished response's slot takes the next prompt's at once, and a prompt leaves as soon as its n responses are done,
  so no slot waits for a round's slowest response (AReaL's and PipelineRL's engines). New weights then load with
  requests in flight (searcher.Engine.load); requests added after are salted with the weights' version, so that
  their prompts never hit cached blocks that older weights computed (vllm/v1/core/kv_cache_utils.py:647-651).
Each decoder's `prompts()` says how many prompts the searcher brings to its next call.
"""

import time
from dataclasses import dataclass

import numpy as np


@dataclass
class Request:
    """n responses to one prompt, sampled at `temperature`, seeded from `seed` (a tuple: the run's seed and
    the round's numbers) and the prompt."""
    prompt_id: int
    tokens: list[int]
    n: int
    temperature: float
    max_tokens: int
    seed: tuple


def sampling_params(temperature: float, max_tokens: int, seed: tuple | None = None, n: int = 1, logprobs=0, **more):
    """vLLM's SamplingParams of a request: `logprobs=0` gives the sampled token's log-prob (and the cumulative
    one); a seed tuple gives the request a generator of its own, reproducible from the run's seed."""
    from vllm import SamplingParams
    return SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, logprobs=logprobs,
                          seed=None if seed is None else int(np.random.SeedSequence(seed).generate_state(1)[0]), **more)


def decoder(cfg, llm, clock):
    """`Full` with --keep-full, `Stepped` where the device time is emulated (`clock`), else `Plain`."""
    from runtime.slowdown import Tails
    slots = Tails(llm.llm_engine) if cfg.response_lengths != "real" and clock.emulated else None
    if cfg.keep_full:
        return Full(llm, clock, slots, cfg.round_prompts, cfg.search_samples_per_prompt)
    return Stepped(llm, clock, slots, cfg.round_prompts) if clock.emulated else Plain(llm, clock, cfg.round_prompts)


class Plain:
    """vLLM's own loop."""

    def __init__(self, llm, clock, round_prompts: int = 1):
        self.llm, self.clock, self.round_prompts = llm, clock, round_prompts

    def prompts(self) -> int:
        return self.round_prompts

    def busy(self) -> bool:
        return False

    def generate(self, requests: list[Request], drain: bool = False) -> list[tuple[int, list]]:
        if not requests:
            return []
        t0 = time.time()
        sp = [sampling_params(r.temperature, r.max_tokens, (*r.seed, r.prompt_id), r.n) for r in requests]
        outputs = self.llm.generate([{"prompt_token_ids": r.tokens} for r in requests], sp, use_tqdm=False)
        self.clock.took(time.time() - t0)
        return [(r.prompt_id, list(o.outputs)) for r, o in zip(requests, outputs)]


class Stepped:
    """vLLM's loop driven here, a decoding step at a time, each step charged to the emulated device time (`clock`).
    `slots` say which sequences hold the engine's slots: vLLM's own (`Slots`), or with --response-lengths
    runtime.slowdown.Tails, each response a request of its own held in its slot for its emulated decoding steps."""

    def __init__(self, llm, clock, slots=None, round_prompts: int = 1):
        self.engine, self.clock, self.round_prompts = llm.llm_engine, clock, round_prompts
        self.slots = slots or Slots(self.engine)

    def prompts(self) -> int:
        return self.round_prompts

    def generate(self, requests: list[Request], drain: bool = False) -> list[tuple[int, list]]:
        ids = []  # each request's ids (request ids no number: offline.py:640); one a response where slots ask
        for i, r in enumerate(requests):
            seeds = [(*r.seed, r.prompt_id, j) for j in range(r.n)] if self.slots.single else [(*r.seed, r.prompt_id)]
            ids.append([f"round-{i}-{j}" for j in range(len(seeds))])
            for rid, seed in zip(ids[-1], seeds):
                self.add(rid, r, sampling_params(r.temperature, r.max_tokens, seed, r.n // len(seeds)), seed)
        done = {}
        while self.busy():
            done.update((out.request_id, out) for out in self.step())
        return [(r.prompt_id, [c for rid in rids for c in done[rid].outputs]) for r, rids in zip(requests, ids)]

    def add(self, request_id: str, r: Request, params, seed: tuple, salt: str | None = None):
        from vllm.sampling_params import RequestOutputKind
        params.output_kind = RequestOutputKind.FINAL_ONLY  # one output a request, at its end: no per-step cost
        prompt = {"prompt_token_ids": r.tokens, **({"cache_salt": salt} if salt else {})}
        self.engine.add_request(request_id, prompt, params)
        self.slots.admit(request_id, seed)

    def step(self, refill=lambda: None) -> list:
        """One decoding step, then `refill()` (--keep-full: the freed slots taken), charged to the clock.
        Returns the requests that left their slots."""
        running = self.slots.running()  # sequences: each makes one token in this step (or holds its slot)
        t0 = time.time()
        finished = self.slots.leave([out for out in self.engine.step() if out.finished]
                                    if self.engine.has_unfinished_requests() else [])
        refill()
        self.clock.step(time.time() - t0, running)
        return finished

    def busy(self) -> bool:
        return self.slots.busy()


class Slots:
    """The engine's slots as vLLM holds them: a request leaves its slot when it finishes."""
    single = False  # a prompt's n responses are one request

    def __init__(self, engine):
        self.engine = engine

    def admit(self, request_id: str, seed: tuple):
        pass

    def leave(self, finished: list) -> list:
        return finished

    def running(self) -> int:
        return self.engine.get_num_unfinished_requests()

    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()


class Full:
    """--keep-full: the engine kept at `room` prompts x n sequences, each response a request of its own, seeded from
    its prompt's seed and its index; a call returns each prompt whose n responses are done, as soon as they are."""

    def __init__(self, llm, clock, slots, room: int, n: int):
        self.stepped, self.room, self.n = Stepped(llm, clock, slots), room * n, n
        self.open = {}     # prompts in flight: number -> (prompt id, n, its responses done)
        self.pending = []  # responses waiting for a free slot: (request id, Request, SamplingParams, seed)
        self.added = 0     # prompts added so far (their numbers)
        self.version = 0   # the weights' version: the salt of the requests added from now on (`Engine.load`)

    def prompts(self) -> int:
        """Prompts to bring to the next call: enough that a prompt's n responses wait beyond every free slot."""
        short = self.room + self.n - self.stepped.slots.running() - len(self.pending)
        return max(0, -(-short // self.n))

    def generate(self, requests: list[Request], drain: bool = False) -> list[tuple[int, list]]:
        """Queue the requests' responses, then decode until a prompt's responses are all done (`drain`: until
        none is left, before an evaluation). Returns the prompts done, (prompt id, its n completions) each."""
        for r in requests:
            self.added += 1
            self.open[self.added] = (r.prompt_id, r.n, [])
            self.pending += [(f"search-{self.added}-{j}", r, sampling_params(r.temperature, r.max_tokens,
                                                                             (*r.seed, r.prompt_id, j)),
                              (*r.seed, r.prompt_id, j)) for j in range(r.n)]
        self.refill()
        whole = []
        while self.busy() and not (whole and not drain):
            for out in self.stepped.step(self.refill):
                number = int(out.request_id.split("-")[1])
                self.open[number][2].append(out.outputs[0])
                whole += [number] if len(self.open[number][2]) == self.open[number][1] else []
        return [(self.open[k][0], self.open.pop(k)[2]) for k in whole]

    def refill(self):
        """A pending response for each free slot."""
        while self.pending and self.stepped.slots.running() < self.room:
            self.stepped.add(*self.pending.pop(0), salt=f"v{self.version}")

    def busy(self) -> bool:
        return self.stepped.busy()

    def loaded(self, llm, version: int):
        """New weights in the engine (searcher.Engine.load): the tokens labelled with their version from the
        next step on (vLLM's CompletionOutput.weight_versions: vllm/outputs.py:42-48, 90), the requests added
        from now on salted with it; those in flight keep their KV cache (PipelineRL's choice); the prefix
        cache is dropped where none is in flight, and before an evaluation (searcher.Engine.evaluate)."""
        llm.llm_engine.set_weight_version(str(version))
        self.version = version
        if not self.busy() and not llm.reset_prefix_cache():
            raise RuntimeError(f"vLLM could not reset its prefix cache after loading the weights of step {version}")

