"""How a searcher's engine decodes a round: vLLM's own loop, or the same loop driven one decoding step at a time.

The engine (searcher.Engine.generate) makes one call, `decoder.generate(requests)`, into whichever decoder the
run's flags chose (`decoder`); each returns (prompt id, its n completions) for the prompts it finished:
- `Plain`: LLM.generate, vLLM's own loop (no mode asks for more).
- `Stepped`: the same loop, a step at a time (LLM.generate is this loop: vllm/entrypoints/common/offline.py:
  589-640), so that between two decoding steps the engine can load new weights (--inflight: `between`), and the
  emulated device (runtime/slowdown.py) charges each step.
- `Full` (--keep-full): stepped, each response a request of its own, and the engine kept at --round-prompts x n
  sequences: a finished response's slot takes the next request at once, so no round waits for its slowest
  response. A call returns the prompts whose n responses are all done, its own or earlier calls'; a call with
  no requests (before an evaluation) runs the engine empty (`drain` for the others is a no-op).
Requests added while the policy may change are salted with the weights' version (`salt`): their prompt's
cached blocks are never those that older weights computed (vllm/v1/core/kv_cache_utils.py:647-651), which the
prefix cache cannot drop while requests are in flight.
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


def decoder(cfg, llm, clock, between, salt):
    """The decoder the flags ask for: `Full` with --keep-full, `Stepped` where weights load in flight (`between`)
    or the device time is emulated (`clock`), else `Plain`."""
    from runtime.slowdown import Tails
    slots = Tails(llm.llm_engine) if cfg.response_lengths != "real" else None  # --response-lengths: emulated
    if cfg.keep_full:
        return Full(llm, clock, between, salt, slots, room=cfg.round_prompts * cfg.search_samples_per_prompt)
    if between is not None or clock.emulated:
        return Stepped(llm, clock, between, salt, slots)
    return Plain(llm, clock)


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

    def busy(self) -> bool:
        return False


class Stepped:
    """vLLM's loop driven here, a decoding step at a time: `between()` after each step that leaves requests, and
    each step charged to the emulated device time (`clock`). `slots` say which sequences hold the engine's slots:
    vLLM's own (`Slots`), or with --response-lengths runtime.slowdown.Tails, each response a request of its own
    held in its slot for its emulated decoding steps."""

    def __init__(self, llm, clock, between, salt, slots=None):
        self.engine, self.clock, self.between, self.salt = llm.llm_engine, clock, between, salt
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
        self.engine.add_request(request_id, {"prompt_token_ids": r.tokens, "cache_salt": self.salt()}, params)
        self.slots.admit(request_id, seed)

    def step(self, refill=lambda: None) -> list:
        """One decoding step, `refill()` after it (--keep-full), charged to the clock, then `between()` (--inflight)
        if requests are left. Returns the requests that left their slots."""
        running = self.slots.running()  # sequences: each makes one token in this step (or holds its slot)
        t0 = time.time()
        finished = self.slots.leave([out for out in self.engine.step() if out.finished]
                                    if self.engine.has_unfinished_requests() else [])
        refill()
        self.clock.step(time.time() - t0, running)
        if self.between is not None and self.busy():
            self.between()
        return finished

    def busy(self) -> bool:
        """Requests in flight (new weights then load in flight: searcher.Engine.load)."""
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
    """--keep-full: the engine kept at `room` sequences (a round's prompts x n), each response a request of its own
    (a prompt's n responses as one request hold their slots until the slowest), seeded from the prompt's seed and
    its index."""

    def __init__(self, llm, clock, between, salt, slots, room: int):
        self.stepped, self.room = Stepped(llm, clock, between, salt, slots), room
        self.open = {}     # prompts in flight: number -> (prompt id, n, its responses done)
        self.pending = []  # requests waiting for a free slot: (request id, Request, SamplingParams, seed)
        self.added = 0     # prompts added so far (their numbers)

    def generate(self, requests: list[Request]) -> list[tuple[int, list]]:
        """A call into an idle engine fills it with its prompts and returns nothing; a later call's requests enter
        one for each that finishes, and it returns once as many responses have finished as it brought. With no
        requests it runs until none is left."""
        for r in requests:
            self.added += 1
            self.open[self.added] = (r.prompt_id, r.n, [])
            self.pending += [(f"search-{self.added}-{j}", r,
                              sampling_params(r.temperature, r.max_tokens, (*r.seed, r.prompt_id, j)),
                              (*r.seed, r.prompt_id, j)) for j in range(r.n)]
        brought, finished = sum(r.n for r in requests), 0
        starting = not self.busy()
        self.refill()
        if starting and requests:
            return []
        while self.busy() and (not requests or finished < brought):
            outs = self.stepped.step(self.refill)
            for out in outs:
                self.open[int(out.request_id.split("-")[1])][2].append(out.outputs[0])
            finished += len(outs)
        whole = [k for k, (_, n, done) in self.open.items() if len(done) == n]
        return [(self.open[k][0], self.open.pop(k)[2]) for k in whole]

    def refill(self):
        """A pending request for each free slot."""
        while self.pending and self.stepped.slots.running() < self.room:
            self.stepped.add(*self.pending.pop(0))

    def busy(self) -> bool:
        return self.stepped.busy()
