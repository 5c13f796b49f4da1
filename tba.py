"""TBA: Trajectory Balance with Asynchrony (Bartoldson et al., NeurIPS 2025), from a laptop to several nodes.

Searcher processes generate responses with vLLM and a local copy of the policy, score them and
push them to the trainer without ever waiting for it (searcher.py). The trainer keeps learning
from a replay buffer of everything searched so far (buffer.py) with the trajectory balance
objective (loss.py), which stays valid for off-policy data, and every `--sync-every` steps its
weights go to the searchers through shared tensors (weights.py). This file is the trainer: its
loop (`train`, below), the state and helpers the loop calls (`Trainer`), and its model.

    torchrun --nproc_per_node=1 tba.py                  # the toy task on a laptop: about a minute
    torchrun --nproc_per_node=1 tba.py --searchers 0    # the synchronous baseline, same code
    python tba.py --help                                # every flag
    bash run_gsm8k.sh                                   # the paper's GSM8K run on a 4-GPU node

Where things live: the flags and their checks in config.py; the queue of trajectories from the
searchers and every wait on them in processes.py (`start_searchers`, `drain`); the weights'
shared copy, its lock and versions in weights.py; the loss in loss.py; the buffer in buffer.py;
checkpoints in checkpoint.py; the tasks and rewards in tasks.py and rewards.py; several nodes
in nodes.py; LoRA (--lora-rank) in lora.py.

Layout: torchrun starts the trainer ranks, which train one model with FSDP2 (`fully_shard`).
Rank 0 holds the replay buffer, samples each batch and broadcasts it, and spawns `--searchers`
searcher processes with torch.multiprocessing. On a GPU node trainer rank r uses GPU r and
searcher i GPU (ranks + i); on a CPU machine everything shares the cores, split evenly. Searcher 0
also evaluates, between two rounds, when the trainer asks. With `--searchers 0` (one trainer
process) the trainer runs the vLLM engine itself: it generates before each step and evaluates.
Several nodes (`torchrun --nnodes N`): each node's first trainer process (its leader) does for its
node what rank 0 does for the weights and searchers, and forwards its searchers' trajectories to
rank 0 (nodes.py; `multi` is None on one node).

Departures from the paper and the authors' code, and why: docs/departures.md.
"""

import os
import signal
import sys

def stopped_at_start(signum, frame):
    """Ctrl-C or SIGTERM while importing and checking: nothing runs yet, so stop quietly."""
    print(f"tba.py: stopped by {signal.Signals(signum).name} during start-up", file=sys.stderr, flush=True)
    os._exit(128 + signum)  # 130 / 143; no process has been spawned yet


if __name__ == "__main__":  # before the heavy imports below, which take seconds
    signal.signal(signal.SIGINT, stopped_at_start)
    signal.signal(signal.SIGTERM, stopped_at_start)

import contextlib  # noqa: E402  (after the handlers: a signal during these imports stops quietly)
import math
import time

from runtime import vllm_env

vllm_env.set_up()  # before torch and vLLM are imported: they read it at import

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from runtime import lora
from runtime import nodes
import searcher
from runtime import seeds
from buffer import ReplayBuffer, ReuseCap
from runtime.checkpoint import full_state_dict, linked, save_checkpoint, save_hf
from runtime.config import beta_at, check, gamma_at, lr_at, parse, reward_temp_at
from runtime.errors import ConfigError, Dead, Silent, Stop
from runtime.hub import load_tokenizer
from runtime.log import Log
from loss import LOSSES, collate, sequence_logprobs, unique_pairs
from runtime.processes import (Signals, Watch, broadcast, broadcast_batch, drain, fail, first_refusal, init_distributed,
                       newest, raise_stop, start_searchers, stop_searchers, wait_together)
from searcher import Engine
from runtime.weights import aliases, allocate, cpu_copy, create, every_name, gather, publish, take_part


# ===== the trainer loop: the trainer's side of the paper's Algorithm 1 ===========================
def train(trainer: "Trainer"):
    """Until --steps: collect what the searchers sent, sample B prompts x K responses, take one step
    of the loss, send the weights to the searchers every k steps, log, evaluate, checkpoint. Every
    trainer rank runs it; rank 0 holds the buffer and samples, and each rank takes its share of B."""
    cfg = trainer.cfg
    trainer.evaluate()  # the initial model's score
    first_step = trainer.step
    while trainer.step < cfg.steps:
        t_step = time.time()
        # ===== collect: searched trajectories into the buffer ====================================
        initial = cfg.initial_buffer if trainer.step == first_step and not trainer.ckpt else 0  # before the first step
        wait, search = trainer.collect(initial)
        # ===== sample a batch: B prompts x K responses (TBA: recency m, reward softmax) =========
        batch = trainer.sample()
        if batch is None:  # rank 0 stops the run (a signal, a silent searcher): every rank with it
            trainer.stop(saved=trainer.step > first_step)
        mine = batch[trainer.rank * len(batch) // trainer.world:(trainer.rank + 1) * len(batch) // trainer.world]
        # ===== loss (TB unless --loss) and update ================================================
        beta, lr = beta_at(cfg, trainer.step), lr_at(cfg, trainer.step)
        temps = dict(gamma=gamma_at(cfg, trainer.step),  # Lee et al.'s; 1 = off
                     reward_temp=reward_temp_at(cfg, trainer.step))
        for g in trainer.opt.param_groups:
            g["lr"] = lr
        sums = backward(trainer.model, mine, len(batch) / trainer.world, trainer.data.prompts, trainer.pad,
                        trainer.device, cfg, beta, **temps)
        stats = torch.tensor(list(sums.values()), dtype=torch.float64)
        dist.all_reduce(stats)
        stats = dict(zip(sums, (stats / stats[list(sums).index("prompts")]).tolist()))  # means over prompts
        if not math.isfinite(stats["loss"]):
            raise FloatingPointError(f"non-finite loss at step {trainer.step + 1}; the last good checkpoint, if any, "
                                     f"is {os.path.join(cfg.out, 'checkpoint')}")
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), cfg.grad_clip)
        trainer.opt.step()
        trainer.opt.zero_grad(set_to_none=True)
        trainer.step += 1
        trainer.signals.training = True  # from now on a signal stops the run after a checkpoint
        # ===== sync weights to the searchers every k steps; TBA′: reset pi_ref every rho ========
        t_sync = time.time()
        if cfg.ref_reset_every and trainer.step % cfg.ref_reset_every == 0:
            trainer.reset_reference()
        elif trainer.step % cfg.sync_every == 0:
            trainer.sync_weights()
        sync = time.time() - t_sync
        # ===== log ===============================================================================
        if trainer.rank == 0:
            stale = [trainer.step - 1 - traj.version for g in batch for traj in g]
            stats.pop("prompts")
            log = trainer.log
            log.row(kind="train", step=trainer.step, time=log.now(), **stats,
                    reward=float(np.mean([traj.reward for g in batch for traj in g])), beta=beta, lr=lr,
                    **({k: v for k, v in temps.items() if v != 1.0}),
                    staleness=float(np.mean(stale)), staleness_max=int(max(stale)), wait=wait, sync=sync,
                    search=search, seconds=time.time() - t_step, samples=log.samples,
                    reuse=trainer.cap.drawn / max(1, log.samples), generate=log.generate, slept=log.slept,
                    charged=log.charged, buffer=len(trainer.buffer), reference=trainer.buffer.reference,
                    overhead=log.overhead, **log.per_round(), **(trainer.multi.row(log.samples) if trainer.multi else {}))
        # ===== evaluate ==========================================================================
        if cfg.eval_every and trainer.step % cfg.eval_every == 0 and trainer.step < cfg.steps:
            trainer.evaluate()
        # ===== checkpoint ========================================================================
        if cfg.save_every and trainer.step % cfg.save_every == 0:
            trainer.checkpoint()
    trainer.finish()


class Trainer:
    """The run's state on one trainer rank, and the helpers `train` calls for what is not the
    algorithm itself: the searchers and the waits on them, the weights' trips, evaluation, signals,
    checkpoints, the staleness study (--lag) and TBA′'s reset."""

    def __init__(self, cfg, data, ckpt, signals, t_start: float):
        self.cfg, self.data, self.ckpt, self.signals = cfg, data, ckpt, signals
        self.tokenizer = load_tokenizer(cfg.model_path)  # for padding and the final model's folder
        self.rank, self.world, local_rank = init_distributed(cfg)
        self.local_world = nodes.layout(self.world)[1]
        self.leader = local_rank == 0  # its node's shared weights, searchers and queue (rank 0 on one node)
        self.multi = nodes.Nodes(self.world, self.local_world, cfg.timeout) if self.world > self.local_world else None
        self.device = torch.device(f"cuda:{local_rank}" if cfg.device == "cuda" else "cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.set_num_threads(cfg.threads)  # before vLLM starts: it pins the thread count after
        self.step = ckpt["step"] if ckpt else 0
        self.log = Log(cfg, self.rank, t_start - (ckpt["elapsed"] if ckpt else 0.0), self.step,
                       resumed={"step": self.step} if ckpt else None)
        self.procs, self.channels, self.engine, self.shared, self.watch = [], None, None, None, None
        self.history = {}  # --lag: step -> the weights of that step (the leaders, CPU), until published
        self.silent = []   # [message] once a searcher has sent nothing for --timeout (rank 0; each leader its own)
        self.said = []     # several nodes, leaders of nodes >= 1: their watch's lines, for rank 0 to print
        self.where = f"node {self.rank // self.local_world}: " if self.multi else ""  # in this node's lines

    def start(self):
        """The searchers first (each node's leader): their vLLM engines start while the trainer loads
        its model. Then the model, the resumed state, and the shared weights handed to the searchers."""
        cfg, ckpt = self.cfg, self.ckpt
        ctx = torch.multiprocessing.get_context("spawn")
        self.shared = create(ctx) if self.leader else None
        if self.leader and cfg.searchers:
            self.procs, self.channels = start_searchers(ctx, cfg, self.rank, self.local_world, self.shared, self.data)
        if cfg.searchers == 0:  # synchronous baseline: a vLLM engine inside the trainer (one process: see check())
            self.engine = Engine(cfg, str(self.device), cfg.trainer_memory, self.data.prompts, self.data.answers)
            if cfg.generation_slowdown != 1:
                for timed in (False, True):
                    self.engine.calibrate(cfg.prompts_per_step, cfg.search_samples_per_prompt, timed)
        # the trainer's model: FSDP2 over the trainer ranks (beside an engine: see Engine.transformers_models)
        # (with --lora-rank: the frozen --model and an adapter, fresh or the checkpoint's: lora.py)
        path = os.path.join(cfg.resume, "model") if cfg.resume and not cfg.lora_rank else cfg.model_path
        adapter = (cfg.lora_rank, cfg.lora_alpha, cfg.seed, cfg.resume and os.path.join(cfg.resume, "adapter"))
        with self.engine.transformers_models() if self.engine else contextlib.nullcontext():
            self.model = load_policy(path, self.device, cfg.dtype, cfg.trainer_dtype, cfg.activation_checkpointing,
                                     adapter if cfg.lora_rank else None)
        self.opt = AdamW([p for p in self.model.parameters() if p.requires_grad], lr=cfg.lr,
                         weight_decay=cfg.weight_decay)
        pad = self.tokenizer.pad_token_id
        self.pad = pad if pad is not None else self.tokenizer.eos_token_id
        # resume: optimizer, buffer, RNG, counters, and the weights the searchers held
        first = {}  # copies of one prompt share one best set (red-teaming searches one instruction as B copies)
        group_of = ([first.setdefault(np.asarray(p, np.int64).tobytes(), i) for i, p in enumerate(self.data.prompts)]
                    if cfg.buffer_keep == "best" else None)
        self.buffer = ReplayBuffer(cfg.buffer_capacity, cfg.recency, cfg.reward_inv_temp, cfg.buffer_keep, cfg.beta,
                                   cfg.dedup_similarity, cfg.dedup_edit, group_of)
        # --max-reuse: credit banked up to k steps' draws, or one round of every searcher (of every node),
        # which can land at once
        rounds = (cfg.max_reuse * cfg.searchers * nodes.layout(self.world)[0] * cfg.round_prompts
                  * cfg.search_samples_per_prompt if cfg.searchers else 0)
        self.cap = ReuseCap(cfg.max_reuse, max(cfg.sync_every * cfg.prompts_per_step * cfg.samples_per_prompt, rounds))
        if ckpt:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
            set_optimizer_state_dict(self.model, self.opt, ckpt["optimizer"], options=StateDictOptions(full_state_dict=True))
            torch.set_rng_state(ckpt["torch_rng"])
            self.buffer, self.log.samples, self.log.first_eval = ckpt["buffer"], ckpt["samples"], ckpt["first_eval"]
            # m and the reward temperature act from the next step on (checkpoint.check_resumed_flags); what the
            # buffer keeps cannot change (FIXED_ON_RESUME)
            self.buffer.recency, self.buffer.reward_inv_temp = cfg.recency, cfg.reward_inv_temp
            # a checkpoint without the reuse counts resumes as if every step drew fresh data
            drawn = self.step * cfg.prompts_per_step * cfg.samples_per_prompt
            self.cap.credit, self.cap.counted, self.cap.drawn = ckpt.get("reuse", [0.0, ckpt["samples"], drawn])
        # the shared weights: every rank gathers, each leader allocates them once and hands them on
        dtype = getattr(torch, cfg.dtype)
        allocate(self.shared, gather(self.model, dtype), aliases(self.model), self.device, dtype,
                 with_ref=cfg.ref_reset_every > 0)
        if self.leader:
            self.shared.version.value = self.step
            if ckpt and ckpt["synced"] is not None:  # the searchers held older weights
                publish(self.shared, ckpt["synced"].items(), ckpt["synced_version"], lambda: None, cfg.timeout)
            if ckpt and ckpt["ref"] is not None:  # TBA′: pi_ref of the latest reset
                publish(self.shared, ckpt["ref"].items(), ckpt["ref_version"], lambda: None, cfg.timeout, to=("ref",))
            for _ in self.procs:  # now the searchers may read them (shared memory / CUDA IPC handles, not copies)
                self.shared.handoff.put((self.shared.tensors, self.shared.ref))
            self.log.published[self.shared.version.value] = self.log.clock()
        if self.leader and self.procs:  # silent searchers: each node's leader watches its own
            say = (lambda line: self.log.print(line, file=sys.stderr)) if self.rank == 0 else self.said.append
            self.watch = Watch(self.procs, cfg.timeout, say, newest(self.buffer),
                               first=self.rank // self.local_world * cfg.searchers, where=self.where)

    # --- collect ----------------------------------------------------------------------------------
    def collect(self, initial: int) -> tuple[float, float]:
        """Searched trajectories into the buffer (at least `initial` before the first step). Returns
        (seconds waited, seconds this process searched)."""
        cfg, wait, search = self.cfg, 0.0, 0.0
        if self.rank == 0 and cfg.searchers == 0 and not self.signals.first:  # synchronous: generate here
            search = self.search_here(initial)
        elif cfg.searchers and self.multi:  # several nodes: the leaders meet (nodes.py); the others go on
            if self.leader:
                wait = self.multi.collect(self.drain_now, self.listen, self.alive, self.silent, self.said,
                                          lambda: self.fresh(initial) or bool(self.signals.first), self.buffer,
                                          self.log, cfg.timeout)
        elif cfg.searchers:  # TBA: whatever arrived; wait only at the start or for fresher data
            wait = self.wait_for(lambda: self.missing(initial) is None, lambda: self.missing(initial))
        return wait, search

    def search_here(self, initial: int) -> float:
        """--searchers 0: one search round with the current weights (more before the first step, for
        --initial-buffer). Returns seconds searched."""
        cfg, search = self.cfg, 0.0
        self.engine.sync(self.shared, self.alive, cfg.timeout)
        for round_ in range(10**9):
            ids = np.random.default_rng([cfg.seed, self.step, seeds.SYNC_PROMPTS, round_]).choice(
                len(self.data.prompts), cfg.prompts_per_step, replace=False)
            t_search = time.time()
            trajectories, made = self.engine.search(ids, cfg.search_samples_per_prompt, (cfg.seed, round_, self.step))
            search += time.time() - t_search
            self.buffer.add(trajectories)
            self.log.samples += len(trajectories)
            self.log.searched(made)
            if self.log.samples >= initial or self.signals.first:
                return search

    def alive(self):
        for i, p in enumerate(self.procs):
            if p.exitcode is not None:
                raise Dead(f"searcher {i} (pid {p.pid}) died with exit code {p.exitcode}")

    def wait_for(self, until, what) -> float:
        """Move the searchers' messages into the buffer and the log; wait (polling, checking the
        searchers, signals and the timeout) until `until()` holds, a signal or a silent searcher
        stops the run. Every rank waits with rank 0 (wait_together); `what()` says what for.
        Returns seconds waited."""
        def some(seconds):
            try:
                return drain(self.channels.queue, self.buffer, self.log, self.alive, done, self.cfg.timeout, self.watch,
                             seconds)
            except Silent as e:
                self.silent[:] = [str(e)]
                return 0.0
        done = lambda: self.rank == 0 and (until() or bool(self.signals.first) or bool(self.silent))
        return wait_together(self.rank, self.world, some, done, what, self.log, min(30.0, self.cfg.timeout / 4))

    def missing(self, initial: int) -> str | None:
        """What the next step waits for (rank 0), or None: the initial buffer, B prompts, or data
        no more than --max-staleness steps old (the newest; replayed draws are old by design)."""
        cfg, log = self.cfg, self.log
        if log.samples < initial:
            return f"the initial buffer ({log.samples} of {initial} trajectories)"
        if len(self.buffer.prompts) < cfg.prompts_per_step:
            return f"data for {cfg.prompts_per_step} prompts ({len(self.buffer.prompts)} so far)"
        if cfg.max_staleness and self.step - self.watch.newest > cfg.max_staleness + cfg.lag:
            return (f"fresher data: the newest was sampled by the weights of step {self.watch.newest}, "
                    f"{self.step - self.watch.newest} steps ago (--max-staleness {cfg.max_staleness})")
        self.cap.receive(log.samples)
        if not self.cap.allows(cfg.prompts_per_step * cfg.samples_per_prompt):
            return (f"fresh data: {self.cap.drawn} trajectories drawn for training, {log.samples} received "
                    f"(--max-reuse {cfg.max_reuse:g})")
        return None

    def drain_now(self) -> float:
        """Several nodes, rank 0: node 0's messages into the buffer and the log, without waiting; a silent
        searcher is recorded, as on one node (the loop stops after a checkpoint)."""
        try:
            return drain(self.channels.queue, self.buffer, self.log, self.alive, lambda: True, self.cfg.timeout,
                         self.watch)
        except Silent as e:
            self.silent[:] = self.silent or [str(e)]
            return 0.0

    def listen(self) -> list:
        """Several nodes, a leader of node >= 1: the trajectories its searchers queued, without waiting,
        heard by its watch; a silent searcher is recorded, for rank 0 (nodes.Nodes.collect)."""
        trajectories = nodes.take(self.channels.queue, self.watch.heard)
        try:
            self.watch.check()
        except Silent as e:
            self.silent[:] = self.silent or [str(e)]
        return trajectories

    def fresh(self, initial: int) -> bool:
        """Several nodes, rank 0: nothing missing, counting the newest data from every node."""
        self.watch.newest = max([self.watch.newest] + [v for v in self.multi.versions if v is not None])
        return self.missing(initial) is None

    # --- sample, and stopping -------------------------------------------------------------------------
    def sample(self):
        """B prompts x K responses from the buffer, drawn by rank 0 and sent to every rank; None on
        every rank when rank 0 stops the run."""
        batch = None
        if self.rank == 0 and not self.reason():
            batch = self.buffer.sample(self.cfg.prompts_per_step, self.cfg.samples_per_prompt,
                                       np.random.default_rng([self.cfg.seed, self.step, seeds.BATCH]))
            self.cap.draw(self.cfg.prompts_per_step * self.cfg.samples_per_prompt)
        return broadcast_batch(batch, self.rank)

    def reason(self):
        """Why rank 0 stops the run, or None: ("silent", message) or ("signal", name)."""
        first = self.signals.first
        return ("silent", self.silent[0]) if self.silent else ("signal", first[0]) if first else None

    def stop(self, saved: bool):
        """Every rank: stop for rank 0's reason, after a checkpoint if `saved` (a step was taken)."""
        why = broadcast(self.reason(), self.rank)
        if saved:
            self.checkpoint()
        raise_stop(why, saved, self.cfg.out)

    # --- the weights' trips to the searchers ---------------------------------------------------------
    def sync_weights(self, ref=False, lag=None):
        """Publish the trainer's weights, or with --lag those of step - lag; searchers reload them
        before their next round. `ref`: they also become pi_ref (TBA′). Every rank calls it."""
        lag = self.cfg.lag if lag is None else lag
        named, version = gather(self.model, getattr(torch, self.cfg.dtype)), self.step
        if lag:  # the staleness study: keep each step's weights (CPU) until it is published
            copy = cpu_copy(self.shared, named)
            if copy is not None:
                self.history[self.step] = copy
            due = [v for v in self.history if v <= self.step - lag]
            if not due:  # nothing old enough yet (and always on the other ranks): the searchers keep step 0's
                return
            version, named = max(due), self.history[max(due)].items()
        try:
            publish(self.shared, named, version, self.alive, self.cfg.timeout, to=("policy", "ref") if ref else ("policy",))
        except TimeoutError:  # the lock stayed taken: a searcher of this node stopped while it read the weights
            take_part(named)  # every other rank waits in these all-gathers; then all stop at the next batch
            self.silent[:] = self.silent or [  # rank 0's, or sent to it at the next meeting (nodes.py)
                f"{self.where}the weight-sync lock was not free for {self.cfg.timeout:g} s: a searcher stopped while "
                f"it read the weights (--timeout {self.cfg.timeout:g})"]
            return
        except Dead:  # a searcher died holding the lock
            if not self.multi:
                raise
            # several nodes: leaving now would show the others a closed connection only; the next
            # meeting's alive() names the searcher to rank 0 (nodes.py)
            take_part(named)
            return
        if self.leader:
            self.buffer.mark_sync()
            self.log.published[version] = self.log.clock()
        for v in [v for v in self.history if v <= version]:
            del self.history[v]

    def reset_reference(self):
        """TBA′: pi_ref <- the current policy, in the searchers too; older data leaves the buffer."""
        self.sync_weights(ref=True)
        if self.rank == 0:
            self.buffer.set_reference(self.step)

    # --- evaluate, checkpoint, the end ---------------------------------------------------------------
    def evaluate(self):
        """Greedy evaluation on the held-out problems with the current weights."""
        if self.cfg.searchers:  # searcher 0 evaluates the newest published weights between rounds
            if self.rank == 0:
                self.channels.evals.put(self.step)
                self.watch.evaluating = True  # its parts may each take longer than a round: no warning
            return
        t0 = time.time()
        if self.engine.version != self.step:  # the weights as a sync sends them: its dtype, tied names too
            self.engine.load(every_name(self.model, getattr(torch, self.cfg.dtype)), self.step)
        scores, example = self.engine.evaluate(self.data.test_prompts, self.data.test_answers)
        self.log.eval(self.step, scores, example, time.time() - t0, self.log.clock())
        self.log.overhead += time.time() - t0

    def checkpoint(self):
        """OUT/checkpoint-STEP (every rank: its gathers are collective), unless the link already names this
        step (a signal right after a --save-every save, or finish() after the last one): saving a step again
        deletes the linked checkpoint before it renames the new one in, and a kill between the two would
        leave the link on nothing."""
        if broadcast(self.rank == 0 and linked(self.cfg.out, self.step), self.rank):
            return
        t0 = time.time()
        save_checkpoint(self.cfg, self.rank, self.model, self.opt, self.buffer, self.cap, self.shared, self.step,
                        self.log, self.tokenizer)
        self.log.overhead += time.time() - t0

    def finish(self):
        """The final weights to the searchers, the final evaluation, the final model (OUT/final)."""
        cfg = self.cfg
        if cfg.lag or self.step % cfg.sync_every:
            self.sync_weights(lag=0)  # the final evaluation is of the final weights
        self.evaluate()
        if cfg.searchers:
            self.wait_for(lambda: self.log.evals and self.log.evals[-1]["version"] == cfg.steps,
                          lambda: f"the final evaluation (of step {cfg.steps}) from searcher 0")
            why = broadcast(self.reason(), self.rank)  # all ranks together: a checkpoint is collective
            if why:
                self.checkpoint()
                raise_stop(why, True, cfg.out)
        sd = full_state_dict(self.model)
        if self.rank == 0:
            save_hf(self.model, sd, self.tokenizer, os.path.join(cfg.out, "final"))
            self.log.summary()
        # every rank leaves together: a rank that tears its group down while rank 0 still writes the
        # model can die at exit (SIGABRT in gloo's teardown)
        dist.all_reduce(torch.zeros(1))  # a CPU tensor: gloo, also beside NCCL

    def close(self):
        """Whatever happened: the log closed, the searchers and the engine stopped, the group left."""
        self.log.close()
        if self.channels is not None:
            stop_searchers(self.procs, self.channels.queue, self.channels.stop, self.shared.handoff)
        if self.engine is not None:
            self.engine.close()
        if dist.is_initialized():
            dist.destroy_process_group()


# --- the trainer's model and its gradient ------------------------------------------------------------
def load_policy(path: str, device, dtype: str, weights_dtype: str = "float32", recompute: bool = False,
                adapter: tuple | None = None):
    """`weights_dtype` weights (float32, or bfloat16 as the authors' GSM8K run; AdamW's moments stay in
    float32 either way: `AdamW`), sharded with FSDP2 over the trainer ranks (per decoder block, then the
    whole), computing in `dtype` (bf16 on GPUs) and reducing gradients in float32. The blocks are
    the modules whose class the model lists in `_no_split_modules` (transformers' convention for
    sharding wrappers): LlamaDecoderLayer, GPTNeoXLayer, GPT2Block, Qwen2DecoderLayer, ...
    `adapter` = (rank, alpha, seed, saved adapter folder or None): LoRA on the frozen model (lora.py)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, weights_dtype)).to(device)
    model.config.use_cache = False
    if adapter:
        rank, alpha, seed, saved = adapter
        model = lora.wrap(model, rank, alpha, seed)
        if saved:
            lora.load_adapter(model, saved)
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32)
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    if recompute:  # --activation-checkpointing, before fully_shard (as FSDP2's own tests compose them)
        recompute_blocks(model, blocks)
    for module in [m for m in model.modules() if type(m).__name__ in blocks]:
        fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


class AdamW(torch.optim.AdamW):
    """torch's AdamW with its moments in float32 whatever the weights' dtype. torch keeps them in the
    weights' dtype (zeros_like(p): torch/optim/adam.py:178-184), and in bf16 v x 0.999 rounds back to v,
    so v stops decaying (docs/departures.md, "bf16 weights"). A bf16 weight is updated by torch's own
    functional AdamW on a float32 copy, one parameter at a time (a copy of them all would cost 8 bytes a
    parameter at once), and rounded back; float32 weights take torch's path unchanged."""

    @torch.no_grad()
    def step(self, closure=None):
        if all(p.dtype == torch.float32 for g in self.param_groups for p in g["params"]):
            return super().step(closure)
        from torch.optim.adam import adam
        for group in self.param_groups:
            for p in [p for p in group["params"] if p.grad is not None]:
                state = self.state[p]
                if not state:  # as torch's lazy init (torch/optim/adam.py:161-184), in float32 (DTensors stay DTensors)
                    state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p, dtype=torch.float32),
                                 exp_avg_sq=torch.zeros_like(p, dtype=torch.float32))
                weight = p.float()
                adam([weight], [p.grad.float()], [state["exp_avg"]], [state["exp_avg_sq"]], [], [state["step"]],
                     foreach=False, decoupled_weight_decay=True, amsgrad=False, beta1=group["betas"][0],
                     beta2=group["betas"][1], lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                     maximize=False)
                p.copy_(weight)

    def load_state_dict(self, state_dict):
        """torch casts the loaded moments to the weights' dtype (torch/optim/optimizer.py:800-801, 964-1001):
        put the saved float32 ones back (and older checkpoints' bf16 ones in float32)."""
        super().load_state_dict(state_dict)
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        for i, p in zip(saved, [p for g in self.param_groups for p in g["params"]]):
            for key, value in state_dict["state"].get(i, {}).items():
                if key.startswith("exp_avg"):
                    self.state[p][key] = value.to(p.device, torch.float32)


def recompute_blocks(model, blocks: set):
    """Activation checkpointing per decoder block: each keeps only its input and recomputes the rest
    in the backward pass. The composable form hooks the module in place, keeping its parameter names
    (torch/distributed/_composable/checkpoint_activation.py:38-46), so weights.gather, checkpoints and
    save_pretrained see the same names; non-reentrant, with the RNG state kept: the same numbers."""
    from torch.distributed._composable import checkpoint
    for module in [m for m in model.modules() if type(m).__name__ in blocks]:
        checkpoint(module)


def backward(model, groups, prompts_per_rank: float, prompts, pad, device, cfg, beta: float, **temps) -> dict:
    """Accumulate the gradient of the loss (`--loss`) over this rank's groups (K trajectories of one
    prompt each), in passes of whole prompts. Returns sums over the groups: "loss" x prompts,
    "prompts", and each of the loss's (B,) statistics."""
    per_pass = max(1, cfg.micro_batch // cfg.samples_per_prompt)
    sums = {}
    for i in range(0, len(groups), per_pass):
        part = groups[i:i + per_pass]
        pairs, index = unique_pairs([t for g in part for t in g], prompts)  # each distinct sequence once
        logp = sequence_logprobs(model, *collate(pairs, pad, device), cfg.temperature)         # (distinct,)
        logp = logp[torch.tensor(index, device=device)].view(len(part), cfg.samples_per_prompt)  # (b, K)
        field = lambda f: torch.tensor([[float(f(t)) for t in g] for g in part], device=device)  # (b, K)
        loss, stats = LOSSES[cfg.loss](
            logp=logp, logp_ref=field(lambda t: t.logp_ref), reward=field(lambda t: t.reward), beta=beta,
            logp_behaviour=field(lambda t: t.logp_behaviour), length=field(lambda t: len(t.response)), clip=cfg.clip,
            **temps)
        # the mean over all B prompts: FSDP averages gradients over the ranks, each holding B / ranks
        (loss * len(part) / prompts_per_rank).backward()
        for k, v in {"loss": loss.item() * len(part), "prompts": len(part),
                     **{k: v.sum().item() for k, v in stats.items()}}.items():
            sums[k] = sums.get(k, 0.0) + v
    return sums


# ===== the run ====================================================================================
def run(cfg, data, ckpt):
    t_start = time.time()
    signals = Signals()  # from here a signal stops the run: at once before the first step, else after a checkpoint
    trainer = Trainer(cfg, data, ckpt, signals, t_start)
    try:
        trainer.start()
        train(trainer)
    finally:
        trainer.close()


@record  # torchrun's convention: an unexpected exception lands in its report with its traceback
def main(argv=None):
    cfg = parse(sys.argv[1:] if argv is None else argv, __doc__.split("\n\n")[0])
    searcher.quiet_loading()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank_env = int(os.environ.get("RANK", "0"))
    try:
        nodes.check(cfg, world)  # the launch's layout and network, before the ranks join
    except ConfigError as e:  # said on each node: what one node sees, another may not
        fail(f"tba.py: error: {e}", 2, int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:  # the ranks join, then decide together whether the configuration holds
        init_distributed(cfg)
    try:
        cfg, data, ckpt = check(cfg, world)
        refusal = None
    except ConfigError as e:
        refusal = str(e)
    if world > 1:
        refusal = first_refusal(refusal)
    if refusal:
        if dist.is_initialized():
            dist.destroy_process_group()
        fail(f"tba.py: error: {refusal}", 2, rank_env)
    try:
        run(cfg, data, ckpt)
    except (Dead, Silent, FloatingPointError, TimeoutError) as e:  # a searcher died or went silent, a non-finite loss, a wait timed out
        fail(f"tba.py: error: {e}", 1, rank_env)
    except Stop as e:
        name, saved = e.args
        where = f"checkpoint in {os.path.join(cfg.out, 'checkpoint')}" if saved else "before the first step: nothing to save"
        fail(f"tba.py: stopped by {name}; {where}", 130 if name == "SIGINT" else 143, rank_env)
    except KeyboardInterrupt:
        fail("tba.py: stopped at once by a second signal, without a checkpoint", 130, rank_env)
    except Exception as e:  # several nodes: a collective failed because another node went away
        if not nodes.lost(e):
            raise
        fail(f"tba.py: error: {nodes.lost(e)}", 1, int(os.environ.get("LOCAL_RANK", "0")))  # each node says it


if __name__ == "__main__":
    try:
        main()
        status = 0
    except SystemExit as e:  # fail(): its line is said; its status
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # anything else (a CUDA out-of-memory error, a bug): its traceback once, status 1
        import traceback
        traceback.print_exc()
        status = 1
    # Leave without the interpreter's teardown, after the exit handlers: everything is written, closed
    # and stopped by now, and that teardown can abort a finished rank (SIGABRT, "terminate called
    # without an active exception": a C++ thread destroyed while joinable, after its process group).
    import atexit
    atexit._run_exitfuncs()  # what a normal exit runs first (multiprocessing unlinks its semaphores)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
