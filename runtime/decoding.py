"""How a searcher's engine decodes a round: vLLM's own loop, or the same loop driven one decoding step at a time.

The engine (searcher.Engine.generate) makes one call, `decoder.generate(requests)`, into whichever decoder the
run's flags chose (`decoder`); each returns (prompt id, its n completions) for each prompt:
- `Plain`: LLM.generate, vLLM's own loop (no mode asks for more).
- `Stepped`: the same loop, a step at a time (LLM.generate is this loop: vllm/entrypoints/common/offline.py:
  589-640), so that the emulated device (runtime/slowdown.py, --generation-slowdown) charges each step.
"""

import time
from dataclasses import dataclass

import numpy as np


@dataclass
class Request:
    """n responses to one prompt, sampled at `temperature`, seeded from `seed` (a tuple: the run's seed and the
    round's numbers) and the prompt."""
    prompt_id: int
    tokens: list[int]
    n: int
    temperature: float
    max_tokens: int
    seed: tuple


def sampling_params(temperature: float, max_tokens: int, seed: tuple | None = None, n: int = 1, logprobs=0, **more):
    """vLLM's SamplingParams of a request: `logprobs=0` gives the sampled token's log-prob (and the cumulative one);
    a seed tuple gives the request a generator of its own, reproducible from the run's seed."""
    from vllm import SamplingParams
    return SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, logprobs=logprobs,
                          seed=None if seed is None else int(np.random.SeedSequence(seed).generate_state(1)[0]), **more)


def decoder(cfg, llm, clock):
    """`Stepped` where the device time is emulated (`clock`), else `Plain`."""
    if not clock.emulated:
        return Plain(llm, clock)
    from runtime.slowdown import Tails
    return Stepped(llm, clock, Tails(llm.llm_engine) if cfg.response_lengths != "real" else None)


class Plain:
    """vLLM's own loop."""

    def __init__(self, llm, clock):
        self.llm, self.clock = llm, clock

    def generate(self, requests: list[Request]) -> list[tuple[int, list]]:
        if not requests:
            return []
        t0 = time.time()
        outputs = self.llm.generate([{"prompt_token_ids": r.tokens} for r in requests],
                                    [sampling_params(r.temperature, r.max_tokens, (*r.seed, r.prompt_id), r.n)
                                     for r in requests], use_tqdm=False)
        self.clock.took(time.time() - t0)
        return [(r.prompt_id, list(o.outputs)) for r, o in zip(requests, outputs)]



class Stepped:
    """vLLM's loop driven here, a decoding step at a time, each step charged to the emulated device time (`clock`).
    `slots` say which sequences hold the engine's slots: vLLM's own (`Slots`), or with --response-lengths
    runtime.slowdown.Tails, each response a request of its own held in its slot for its emulated decoding steps."""

    def __init__(self, llm, clock, slots=None):
        self.engine, self.clock = llm.llm_engine, clock
        self.slots = slots or Slots(self.engine)

    def generate(self, requests: list[Request]) -> list[tuple[int, list]]:
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

    def add(self, request_id: str, r: Request, params, seed: tuple):
        from vllm.sampling_params import RequestOutputKind
        params.output_kind = RequestOutputKind.FINAL_ONLY  # one output a request, at its end: no per-step cost
        self.engine.add_request(request_id, {"prompt_token_ids": r.tokens}, params)
        self.slots.admit(request_id, seed)

    def step(self) -> list:
        """One decoding step, charged to the clock. Returns the requests that left their slots."""
        running = self.slots.running()  # sequences: each makes one token in this step (or holds its slot)
        t0 = time.time()
        finished = self.slots.leave([out for out in self.engine.step() if out.finished]
                                    if self.engine.has_unfinished_requests() else [])
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

