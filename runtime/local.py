"""`--searchers 0`: the trainer's one process searches itself, with the same searcher.Engine, before each step, and
evaluates. With `--lag 0` each batch is that step's round, each trajectory used once: the on-policy synchronous
baseline; without it the buffer streams as with searchers (m = 0.95 of a batch's prompts from the last round, the
rest replayed from the whole buffer). `LocalFleet` has the verbs of runtime/fleet.py's `Fleet`
(its docstring lists them), so the trainer's loop is the same code with searchers and without; runtime.checks
refuses more trainer ranks (vLLM cannot share a multi-process group)."""

import time

import numpy as np
import torch

import searcher
from buffer import unfit
from runtime import seeds, slowdown
from runtime.evaluations import Here
from runtime.weights import Inbox, Outbox, create


class LocalFleet:
    """A vLLM engine inside the trainer's process, which generates with the current weights before each step
    (with --lag L, those of L steps before) and evaluates them."""

    def __init__(self, cfg, data, log, signals, device):
        self.cfg, self.data, self.log, self.signals = cfg, data, log, signals
        self.dead = None  # a round the buffer cannot take (buffer.unfit): the run stops after a checkpoint
        self.received = self.kept = 0  # trajectories made over the run, and those the buffer kept (as Fleet's)
        self.tokens = 0                # their responses' tokens
        self.newest = -1               # the newest weight version that sampled data
        self.published, self.step, self.nodes = {}, 0, None
        self.evals = Here(self)  # each evaluation at once, by this process's engine (runtime/evaluations.py)
        self.sent = {}  # weight version -> seconds since the start when the engine's shared copy held it (rows)
        self.shared = create(torch.multiprocessing.get_context("spawn"))  # read by the engine as a searcher does
        self.out = Outbox(self.shared, cfg.lag, cfg.timeout)
        self.engine = searcher.Engine(cfg, str(device), cfg.trainer_memory, data.prompts, data.answers)
        clock = self.engine.clock  # --generation-slowdown without --calibration: warm up, then time a round
        for timed in (False, True) if clock.emulated and not clock.seconds_per_token else ():
            slowdown.calibrate(self.engine, cfg.prompts_per_step, cfg.search_samples_per_prompt, timed)

    def beside(self):
        """The trainer's model beside the engine (runtime/vllm_env.eager_transformers)."""
        return self.engine.beside()

    def share(self, model, version: int, saved: dict | None = None, newest: int = -1):
        self.out.share(model, version, getattr(torch, self.cfg.dtype), self.cfg.ref_reset_every > 0, saved,
                       self.cfg.trainer_dtype)
        self.newest, self.model, self.step = newest, model, version  # the model: evaluated as it is (evals.request)
        self.published[version] = self.log.clock()
        self.inbox = Inbox(self.shared, 0, None, lambda: None, self.cfg.timeout)  # this process reads them too

    def saved(self, step: int) -> dict:
        return self.out.saved(step)

    def collect(self, buffer, step: int, waiting_for) -> tuple[float, float]:
        """One search round of B prompts with the current weights, or with --lag L those of step `step` - L (more
        while `waiting_for()` names something: the initial buffer). Returns (0, seconds searched)."""
        cfg, search = self.cfg, 0.0
        if self.signals.first:
            return 0.0, 0.0
        if cfg.lag is not None and self.shared.version.value != max(0, step - cfg.lag):
            version = max(0, step - cfg.lag)
            self.out.write(self.out.history[version].items(), version, lambda: None)
            self.sent[version] = self.log.now()
        self.engine.sync(self.inbox)
        for round_ in range(10**9):
            ids = np.random.default_rng([cfg.seed, step, seeds.SYNC_PROMPTS, round_]).choice(
                len(self.data.prompts), cfg.prompts_per_step, replace=False)
            t_search = time.time()
            trajectories, made = self.engine.search(ids, cfg.search_samples_per_prompt, (cfg.seed, round_, step),
                                                    for_step=step if cfg.lag is not None else -1)
            search += time.time() - t_search
            self.dead = unfit(trajectories, cfg.task)
            if self.dead:
                return 0.0, search
            made.update(version=self.engine.version, started=t_search, seconds=time.time() - t_search)  # as a message
            self.received += len(trajectories)
            self.tokens += sum(len(t.response) for t in trajectories)
            self.kept += len(buffer.add(trajectories))
            self.newest = max(self.newest, self.engine.version)
            self.log.searched(made)
            if waiting_for() is None or self.signals.first:
                return 0.0, search

    @property
    def verified(self) -> dict:
        """The last version whose arrival in the engine was checked (searcher.Engine.verify), as Fleet's."""
        return {0: self.engine.verified}

    def round_size(self) -> int:
        return self.cfg.prompts_per_step * self.cfg.search_samples_per_prompt

    def keep(self, named, version: int, pi_ref: bool = False, final: bool = False) -> bool:
        """--lag L (the trainer chooses it once): the weights of step `version` kept, and read by the round of
        step `version` + L (`collect`); the `final` ones published at once."""
        if final:
            self.out.history = {}
            return self.publish(named, version, pi_ref)
        copy = self.out.keep(named, version)
        self.published[version], self.step = self.log.clock(), version
        if pi_ref:
            self.out.write(copy.items(), version, lambda: None, to=("pi_ref",))
        self.out.forget(version - self.cfg.lag)
        return True

    def publish(self, named, version: int, pi_ref: bool = False, final: bool = False) -> bool:
        """The weights of step `version` into the shared copy the engine reads before its next round (TBA′:
        pi_ref too)."""
        self.out.write(named, version, lambda: None, to=("policy", "pi_ref") if pi_ref else ("policy",))
        self.published.setdefault(version, self.log.clock())
        self.sent[version] = self.log.now()
        return True

    def stop_reason(self):
        """Why the run stops (checkpointed): ("dead", a line: a bad round) or ("signal", name), or None."""
        first, dead = self.signals.first, self.dead or self.log.unwritten  # (a row that could not be written)
        return ("dead", dead) if dead else ("signal", self.signals.named(first[0])) if first else None

    def close(self):
        self.engine.close()
