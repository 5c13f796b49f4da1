"""TBA: Trajectory Balance with Asynchrony (Bartoldson et al., NeurIPS 2025), from a laptop to several nodes.

Searcher processes generate responses with vLLM and a local copy of the policy, score them and
push them to the trainer without ever waiting for it (searcher.py). The trainer keeps learning
from a replay buffer of everything searched so far (buffer.py) with the trajectory balance
objective (loss.py), which stays valid for off-policy data, and every `--sync-every` steps its
weights go to the searchers through shared tensors. This file is the trainer: its loop (`train`),
the algorithm's state (`Trainer`), the gradient (`backward`) and the schedules; every flag is a field
of runtime/config.py's `Config`.

    torchrun --nproc_per_node=1 tba.py                  # the toy task on a laptop: about a minute
    torchrun --nproc_per_node=1 tba.py --searchers 0 --lag 0    # the synchronous on-policy baseline, same code
    python tba.py --help                                # every flag
    bash run_gsm8k.sh                                   # the paper's GSM8K run on a 4-GPU node

The machinery it calls is in runtime/: the searchers' fleet and every wait on them (fleet.py), the
weights' shared copy (weights.py), the flags' checks (checks.py), FSDP2 (policy.py), checkpoints and the
log. The tasks are in tasks/, one file each. Layout: torchrun starts the trainer ranks, which train one
model with FSDP2; rank 0 holds the replay buffer, samples each batch and broadcasts it, and its fleet
spawns `--searchers` searcher processes (on a GPU node trainer rank r uses GPU r and searcher i GPU
ranks + i; on a CPU machine everything shares the cores). With `--searchers 0` the trainer's one process
runs the vLLM engine itself: it generates before each step and evaluates. Several nodes: runtime/nodes.py.

Departures from the paper and the authors' code, and why: docs/departures.md.
"""

import os
import signal
import sys


def stopped_at_start(signum, frame):
    """Ctrl-C or SIGTERM while importing and checking: nothing runs yet, so stop quietly, in one line a node (torchrun
    forwards the signal to every rank)."""
    import atexit  # the searchers' fork server may be importing vLLM (vllm_env.early): the exit functions stop it
    atexit._run_exitfuncs()  # and remove its socket's folder, before our line (its import's lines would follow it)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"tba.py: stopped by {signal.Signals(signum).name} during start-up", file=sys.stderr, flush=True)
    os._exit(128 + signum)  # 130 / 143; no searcher has been spawned yet


if __name__ == "__main__":  # before the heavy imports below, which take seconds
    signal.signal(signal.SIGINT, stopped_at_start)
    signal.signal(signal.SIGTERM, stopped_at_start)
# torchrun, this rank's launcher, read before it can be gone: a rank stops once it is (runtime.ranks.Watchdog)
LAUNCHER = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None

import math  # noqa: E402  (after the handlers: a signal during these imports stops quietly)
import time

from runtime import vllm_env

vllm_env.set_up()  # before torch and vLLM are imported: they read it at import
if __name__ == "__main__" and vllm_env.early(sys.argv[1:]):
    vllm_env.start_fork_server()  # the searchers' import of vLLM (5-7 s) beside this process's imports and checks

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import tasks
from buffer import PER_TOKEN, SCALARS, ReuseCap
from loss import LOSSES, collate, loss_options, response_logprobs, sequence_logprobs, unique_pairs
from runtime import nodes, seeds, slowdown
from runtime.checkpoint import fixed_on_resume, full_state_dict, linked, save_checkpoint, save_final
from runtime.checks import check, parse
from runtime.config import Config
from runtime.errors import ConfigError, Dead, Silent, Stop, Unsaved
from runtime.fleet import Fleet
from runtime.local import LocalFleet
from runtime.processes import Signals, fork_server
from runtime.hub import load_tokenizer
from runtime.log import Log
from runtime.policy import AdamW, LaggedCopy, load_policy
from runtime.ranks import (Watchdog, broadcast, broadcast_batch, fail, first_refusal, init_distributed, machine_device,
                           raise_stop, saved_where, share_signals, stall_bound)
from runtime.weights import gather


# ===== the trainer loop: the trainer's side of the paper's Algorithm 1 ===========================
def train(t: "Trainer"):
    """Until --steps: collect, sample B prompts x K responses, a step of the loss, the weights to the searchers every
    k steps, log, evaluate, checkpoint. Every trainer rank runs it; rank 0 samples, each rank takes its share of B."""
    cfg = t.cfg
    if t.step < cfg.steps:  # (a resumed run with every step done has only its end to do: finish)
        t.evaluate()  # the initial model's score
    first_step = t.step
    while t.step < cfg.steps:
        t_step, t.at = time.time(), t.step + 1
        # ===== collect: searched trajectories into the buffer ====================================
        initial = cfg.initial_buffer if t.step == first_step and not t.resumed else 0  # before the first step
        wait, search = t.fleet.collect(t.buffer, t.step, lambda: t.waiting_for(initial))
        t_train = time.time()
        # ===== sample a batch: B prompts x K responses (TBA: recency m, reward softmax) =========
        batch = t.sample()
        if batch is None:  # rank 0 stops the run (a signal, a silent searcher): every rank with it
            t.stop(saved=t.step > first_step)
        mine = batch[t.rank * len(batch) // t.world:(t.rank + 1) * len(batch) // t.world]
        rescored = t.rescore(mine)  # --behaviour-logprobs trainer: the lagged weights' log-probs (policy.LaggedCopy)
        # ===== loss (TB unless --loss) and update ================================================
        beta, lr = beta_at(cfg, t.step), lr_at(cfg, t.step)
        tempering = dict(gamma=gamma_at(cfg, t.step), reward_temp=reward_temp_at(cfg, t.step))  # Lee et al.'s log R
        for g in t.opt.param_groups:
            g["lr"] = lr
        if cfg.loss_pools:  # a loss that pools across prompts gets the whole batch (runtime.checks.loss_pools)
            sums = pooled_backward(t.model, batch, t.rank, t.world, t.data.prompts, t.pad, t.device, cfg, beta, **tempering)
        else:
            sums = backward(t.model, mine, len(batch) / t.world, t.data.prompts, t.pad, t.device, cfg, beta, **tempering)
        stats = torch.tensor(list(sums.values()), dtype=torch.float64)
        dist.all_reduce(stats)
        stats = dict(zip(sums, (stats / stats[list(sums).index("prompts")]).tolist()))  # means over prompts
        if not math.isfinite(stats["loss"]):
            raise FloatingPointError(f"non-finite loss at step {t.step + 1}; the last good checkpoint, if any, "
                                     f"is {os.path.join(cfg.out, 'checkpoint')}")
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(t.model.parameters(), cfg.grad_clip)
        t.opt.step()
        t.opt.zero_grad(set_to_none=True)
        t.step += 1
        t.fleet.signals.training = True  # from now on a signal stops the run after a checkpoint
        t.clock.charge(time.time() - t_train)  # --train-slowdown: the step lasts Y x its cost alone, before its weights go
        # ===== sync weights to the searchers every k steps; TBA′: reset pi_ref every rho ========
        t_sync = time.time()
        if cfg.ref_reset_every and t.step % cfg.ref_reset_every == 0:
            t.reset_reference()
        elif t.step % cfg.sync_every == 0:
            t.sync_weights()
        sync = time.time() - t_sync
        # ===== log ===============================================================================
        t.log.train_row(t.step, batch, stats, t.fleet, t.buffer, t.cap, t.clock, beta=beta, lr=lr, **tempering,
                        wait=wait, sync=sync, search=search, seconds=time.time() - t_step, **rescored)
        # ===== evaluate ==========================================================================
        if cfg.eval_every and t.step % cfg.eval_every == 0 and t.step < cfg.steps:
            t.evaluate()
        # ===== checkpoint ========================================================================
        if cfg.save_every and t.step % cfg.save_every == 0:
            t.checkpoint()
    t.finish()


class Trainer:
    """The algorithm's state on one trainer rank: the model and its optimizer, the replay buffer and the
    reuse cap, the step; and the fleet of searchers it learns from (runtime/fleet.py)."""

    def __init__(self, cfg, data, ckpt, signals, t_start: float):
        self.cfg, self.data, self.resumed, self.fleet = cfg, data, ckpt is not None, None
        self.rank, self.world, local_rank = init_distributed(cfg.timeout, cfg.device)
        self.step = ckpt["step"] if ckpt else 0
        self.at = self.step + 1  # the step under way, for the watchdog's lines (its sync, log and checkpoint too)
        # a stall, a signal while stuck in a collective, torchrun gone
        self.watchdog = Watchdog(self.rank, self.world, stall_bound(cfg.timeout), lambda: self.at,
                                 lambda: self.fleet.procs if self.fleet else [], cfg.out, signals)
        self.device = torch.device(f"cuda:{local_rank}" if cfg.device == "cuda" else "cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.set_num_threads(cfg.threads)  # before vLLM starts: it pins the thread count after
        # the step whose weights the searchers were last sent (a checkpoint's: they may hold older ones), and since
        # when the trainer waits for searcher 0 to hold an evaluation's weights
        self.synced = (ckpt["synced_version"] if ckpt and ckpt.get("synced") is not None else self.step)
        self.held_since = None
        self.unsaved_said = False  # a checkpoint that could not be written mid-run was said (once)
        costs = slowdown.read_calibration(cfg.calibration) if cfg.calibration else {}  # --train-slowdown's clock
        self.clock = slowdown.TrainClock(cfg.train_slowdown, costs.get("train_step"), cfg.timeout,
                                         costs.get("devices", 1), costs.get("all_reduce", 0.0))
        self.log = Log(cfg, self.rank, t_start - (ckpt["elapsed"] if ckpt else 0.0), self.step,
                       resumed={"step": self.step} if ckpt else None)
        try:
            # the searchers first: their vLLM engines start while the trainer loads its model
            self.fleet = (Fleet(cfg, data, self.rank, self.world, self.log, signals, self.step, str(self.device))
                          if cfg.searchers
                          else LocalFleet(cfg, data, self.log, signals, self.device))
            self.tokenizer = load_tokenizer(cfg.model_path)  # for padding and the final model's folder
            pad = self.tokenizer.pad_token_id
            self.pad = pad if pad is not None else self.tokenizer.eos_token_id
            # the trainer's model: FSDP2 over the trainer ranks (with --lora-rank: the frozen --model and an
            # adapter, fresh or the checkpoint's: runtime/lora.py)
            path = os.path.join(cfg.resume, "model") if cfg.resume and not cfg.lora_rank else cfg.model_path
            adapter = (cfg.lora_rank, cfg.lora_alpha, cfg.seed, cfg.resume and os.path.join(cfg.resume, "adapter"))
            with self.fleet.beside():
                self.model = load_policy(path, self.device, cfg.dtype, cfg.trainer_dtype, cfg.activation_checkpointing,
                                         adapter if cfg.lora_rank else None)
            self.opt = AdamW([p for p in self.model.parameters() if p.requires_grad], lr=cfg.lr,
                             weight_decay=cfg.weight_decay, betas=tuple(map(float, cfg.adam_betas.split(","))))
            self.buffer = ckpt["buffer"] if ckpt else tasks.get(cfg.task).buffer(cfg, data.prompts)
            # --max-reuse: credit banked up to k steps' draws, or one round of every searcher (of every node),
            # which can land at once
            rounds = (cfg.max_reuse * cfg.searchers * nodes.layout(self.world)[0] * cfg.round_prompts
                      * cfg.search_samples_per_prompt if cfg.searchers else 0)
            self.cap = ReuseCap(cfg.max_reuse, max(cfg.sync_every * cfg.prompts_per_step * cfg.samples_per_prompt,
                                                   rounds))
            if ckpt:
                self.restore(ckpt)
            self.lagged = None  # --behaviour-logprobs trainer: a second copy at the lagged weights
            if cfg.behaviour_logprobs == "trainer":
                self.lagged = LaggedCopy(path, self.device, cfg.dtype, cfg.lag)
                self.lagged.restore((ckpt or {}).get("history", {}))
            self.fleet.share(self.model, self.step, ckpt, newest=self.buffer.newest_version())
        except BaseException:
            self.close()
            raise

    def restore(self, ckpt: dict):
        """--resume: the optimizer, the RNG, the counters; the buffer's sampling knobs act from the next step on
        (runtime.checkpoint.check_resumed_flags), what it keeps cannot change (fixed_on_resume)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        set_optimizer_state_dict(self.model, self.opt, ckpt["optimizer"], options=StateDictOptions(full_state_dict=True))
        torch.set_rng_state(ckpt["torch_rng"])
        self.fleet.received, self.fleet.kept, self.log.first_eval = ckpt["samples"], ckpt["kept"], ckpt["first_eval"]
        self.fleet.tokens = ckpt.get("tokens", 0)  # (a checkpoint saved before it counted them: from 0)
        for name, flag in self.buffer.FLAGS.items():  # the buffer's knobs that may change (fixed_on_resume: the others)
            if flag not in fixed_on_resume():
                setattr(self.buffer, name, getattr(self.cfg, flag))
        self.cap.credit, self.cap.counted, self.cap.drawn = ckpt["reuse"]
        if self.fleet.nodes:  # each other node's count (node 0's is the rest; a node no longer there: node 0's)
            counts = ckpt.get("node_samples", [])[1:self.fleet.nodes.count]
            self.fleet.nodes.samples[1:1 + len(counts)] = counts

    # --- what the next step waits for, its batch ---------------------------------------------------
    def waiting_for(self, initial: int) -> str | None:
        """What the next step still lacks (rank 0), or None: an evaluation's weights held, the initial buffer, B prompts,
        data no more than --max-staleness old, --max-reuse's credit; with --lag, this step's rounds."""
        cfg, fleet = self.cfg, self.fleet
        if fleet.evaluation_pending():  # an evaluation's weights first (not learning: the log's overhead)
            self.held_since = self.held_since or time.time()
            return fleet.evaluation_pending()
        if self.held_since:
            self.log.overhead += time.time() - self.held_since
            self.held_since = None
        if cfg.lag is not None:  # --lag: this step's rounds, all of them
            got, want = self.buffer.waiting(self.step), fleet.round_size()
            return None if got >= want else (f"the rounds of step {self.step}, sampled by the weights of step "
                                             f"{max(0, self.step - cfg.lag)} ({got} of {want} trajectories)")
        if fleet.received < initial:
            return f"the initial buffer ({fleet.received} of {initial} trajectories)"
        if len(self.buffer.prompts) < cfg.prompts_per_step:
            return f"data for {cfg.prompts_per_step} prompts ({len(self.buffer.prompts)} so far)"
        if cfg.max_staleness and self.step - fleet.newest > cfg.max_staleness:
            return (f"fresher data: the newest was sampled by the weights of step {fleet.newest}, "
                    f"{self.step - fleet.newest} steps ago (--max-staleness {cfg.max_staleness})")
        self.cap.receive(fleet.kept)
        if not self.cap.allows(cfg.prompts_per_step * cfg.samples_per_prompt):
            return (f"fresh data: {self.cap.drawn} trajectories drawn for training, {fleet.kept} kept "
                    f"(--max-reuse {cfg.max_reuse:g})")
        return None

    def sample(self):
        """B prompts x K responses from the buffer (--lag: from this step's rounds), drawn by rank 0 and sent to
        every rank; None on every rank when rank 0 stops the run."""
        batch, cfg = None, self.cfg
        share_signals(self.fleet.signals, self.world)  # a signal to any rank stops every rank
        if self.rank == 0 and not self.fleet.stop_reason():
            rng = np.random.default_rng([cfg.seed, self.step, seeds.BATCH])
            batch = (self.buffer.sample_round(self.step, cfg.prompts_per_step, cfg.samples_per_prompt,
                                              cfg.search_samples_per_prompt, rng)
                     if cfg.lag is not None else self.buffer.sample(cfg.prompts_per_step, cfg.samples_per_prompt, rng))
            self.cap.draw(cfg.prompts_per_step * cfg.samples_per_prompt)
        return broadcast_batch(batch, self.rank)

    def rescore(self, groups) -> dict:
        """--behaviour-logprobs trainer: this rank's trajectories' behaviour log-probs recomputed with the weights that
        sampled them (step - L), and the row's field of how far vLLM's were; else nothing."""
        if not self.lagged:
            return {}
        cfg = self.cfg
        self.lagged.record(self.model, self.step)  # the weights of this step, for the batch L steps on
        gap = self.lagged.rescore(groups, self.step, self.data.prompts, self.pad, self.device, cfg.temperature,
                                  cfg.micro_batch)
        return {"behaviour_gap": gap}

    def stop(self, saved: bool):
        """Every rank: stop for rank 0's reason, after a checkpoint if `saved` (a step was taken)."""
        why = broadcast(self.fleet.stop_reason(), self.rank)
        raise_stop(why, self.checkpoint(stopping=True) if saved else False, self.cfg.out)

    # --- the weights' trips to the searchers ---------------------------------------------------------
    def sync_weights(self, pi_ref: bool = False, final: bool = False):
        """Publish the weights (--lag: served when the rounds L steps ahead need them); data from now on is recent.
        `pi_ref`: they also become pi_ref at once (TBA′); `final`: the last step's, for the final evaluation."""
        if self.fleet.publish(gather(self.model, getattr(torch, self.cfg.dtype)), self.step, pi_ref, final):
            self.buffer.mark_sync()
        self.synced = self.step

    def reset_reference(self):
        """TBA′: pi_ref <- the current policy, in the searchers too; older data leaves the buffer."""
        self.sync_weights(pi_ref=True)
        if self.rank == 0:
            self.buffer.set_reference(self.step)

    # --- evaluate, checkpoint, the end ---------------------------------------------------------------
    def evaluate(self):
        """The task's evaluation of the current weights on the held-out problems (by searcher 0, or here). Streaming
        searchers that hold older weights (--sync-every above 1, a resumed run's) are sent these first: every
        evaluation is of the step it names, in every mode."""
        if self.cfg.searchers and self.cfg.lag is None and self.cfg.evaluator == "searcher" and self.synced != self.step:
            self.sync_weights()
        self.fleet.request_eval(self.step)

    def counters(self) -> dict:
        """The run's counts that a checkpoint carries (plain data)."""
        cap = self.cap
        return dict(elapsed=self.log.now(), samples=self.fleet.received, tokens=self.fleet.tokens, kept=self.fleet.kept,
                    first_eval=self.log.first_eval, reuse=[cap.credit, cap.counted, cap.drawn],
                    node_samples=self.fleet.nodes.samples if self.fleet.nodes else [])  # several nodes: each one's

    def checkpoint(self, stopping: bool = False) -> bool | str:
        """OUT/checkpoint-STEP (every rank: its gathers are collective), unless the link already names this
        step (a signal right after a --save-every save, or finish() after the last one): saving a step again
        deletes the linked checkpoint before it renames the new one in, and a kill between the two would
        leave the link on nothing. True once written; a write that fails (a full disk) leaves the one before
        linked and returns the line saying so (rank 0), which a stop ends with and mid-run is a warning, once:
        training goes on."""
        if broadcast(self.rank == 0 and linked(self.cfg.out, self.step), self.rank):
            return True
        t0 = time.time()
        failed = save_checkpoint(self.cfg, self.rank, self.model, self.opt, self.buffer,
                                 self.fleet.saved(self.step) if self.rank == 0 else None, self.counters(), self.step,
                                 self.tokenizer)
        self.log.overhead += time.time() - t0
        if failed and not stopping and not self.unsaved_said:
            self.log.print(f"tba.py: warning: {failed}; training goes on (a later checkpoint that fails is not said "
                           f"again)", file=sys.stderr)
            self.unsaved_said = True
        return failed or True

    def finish(self):
        """The final weights to the searchers, the final evaluation, the final model (OUT/final)."""
        cfg = self.cfg
        self.fleet.wait_for_eval(self.buffer)  # every evaluation asked, before the final weights replace theirs
        if cfg.lag is not None or self.synced != self.step:
            self.sync_weights(final=True)  # the final evaluation is of the final weights
        self.evaluate()
        if cfg.searchers:
            self.fleet.wait_for_eval(self.buffer, cfg.steps)
            share_signals(self.fleet.signals, self.world)
            why = broadcast(self.fleet.stop_reason(), self.rank)  # all ranks together: a checkpoint is collective
            if why:
                raise_stop(why, self.checkpoint(stopping=True), cfg.out)
        sd = full_state_dict(self.model)
        failed = None
        if self.rank == 0:  # on a full disk: kept in memory and tried again until --timeout (runtime.checkpoint)
            failed = save_final(self.model, sd, self.tokenizer, cfg.out, self.step, cfg.timeout, self.fleet.signals,
                                self.log)
            if not failed:
                self.log.summary()
        # every rank leaves together, with rank 0's outcome: a rank that tears its group down while rank 0 still
        # writes the model can die at exit (SIGABRT in gloo's teardown)
        failed = broadcast(failed, self.rank)  # (CPU tensors: gloo, also beside NCCL)
        if failed:
            raise Unsaved(failed)

    def close(self):
        """Whatever happened: --evaluator after's kept evaluations made (unless a second signal stops at once), the log
        closed, the searchers and the engine stopped, the group left."""
        if self.fleet is not None and not isinstance(sys.exc_info()[1], KeyboardInterrupt):
            try:
                self.fleet.evaluate_kept()
            except Exception as e:  # the stop's own reason comes first
                self.log.print(f"tba.py: the kept evaluations failed ({type(e).__name__}: {e})", file=sys.stderr)
        self.log.close()
        if self.fleet is not None:
            self.fleet.close()
        self.watchdog.close()
        if dist.is_initialized():
            dist.destroy_process_group()


# --- the gradient ------------------------------------------------------------------------------------
def backward(model, groups, prompts_per_rank: float, prompts, pad, device, cfg, beta: float, **tempering) -> dict:
    """The gradient of the loss (`--loss`, on (b, K) tensors: `loss_inputs`) over this rank's groups, in passes of
    whole prompts (each distinct sequence once); with --micro-batch below K, passes without gradient give the group's
    statistics (log Z), then each pass puts its log-probs, with gradient, among the others' detached ones, every
    sequence in its pass (duplicates too: every rank runs as many FSDP2 passes). Sums: "loss" x prompts, "prompts",
    and each statistic's."""
    K, loss_fn = cfg.samples_per_prompt, LOSSES[cfg.loss]
    per_token = getattr(loss_fn, "per_token", False)
    options = loss_options(cfg, beta, **tempering)  # every call's keyword arguments, as the start-up check's
    sums = {}
    for i in range(0, len(groups), max(1, cfg.micro_batch // K)):
        part = groups[i:i + max(1, cfg.micro_batch // K)]
        whole = cfg.micro_batch >= K * len(part)  # whole prompts in one pass: each distinct sequence once
        pairs, index = (unique_pairs([t for g in part for t in g], prompts) if whole else
                        ([(prompts[t.prompt_id], t.response) for g in part for t in g], list(range(K * len(part)))))
        index = torch.tensor(index, device=device)
        inputs = loss_inputs(part, device, per_token, prompts)
        logps = lambda rows: sequence_logps(model, [pairs[j] for j in rows], pad, device, cfg.temperature,
                                            inputs["token_mask"].shape[-1] if per_token else 0)

        def loss_of(x):  # the part's loss from its sequences' log-probs: (n,) or per token (n, R)
            x = x[index].view(len(part), K, *x.shape[1:])                                     # (b, K) or (b, K, R)
            return loss_fn(logp=x.sum(-1) if per_token else x, **({"token_logp": x} if per_token else {}), **inputs,
                           **options)

        if whole:
            loss, stats = loss_of(logps(range(len(pairs))))
            (loss * len(part) / prompts_per_rank).backward()  # the mean over all B prompts: FSDP averages ranks
        else:  # fewer than K sequences a pass: the statistics without gradient, then the gradient, by parts
            parts = [range(s, min(s + cfg.micro_batch, len(pairs))) for s in range(0, len(pairs), cfg.micro_batch)]
            with torch.no_grad():
                full = torch.cat([logps(rows) for rows in parts])
                loss, stats = loss_of(full)
            for rows in parts:
                live = full.clone()
                live[rows.start:rows.stop] = logps(rows)
                (loss_of(live)[0] * len(part) / prompts_per_rank).backward()
        add_sums(sums, loss, stats, len(part))
    return sums


def sequence_logps(model, pairs, pad, device, temperature: float, R: int = 0):
    """The log-probs of (prompt, response) pairs: summed, (n,), or with R > 0 per response token, (n, R) zero-padded."""
    batch = collate(pairs, pad, device)
    if not R:
        return sequence_logprobs(model, *batch, temperature)
    x = response_logprobs(model, *batch, temperature, [len(p) for p, _ in pairs], [len(r) for _, r in pairs])
    return torch.nn.functional.pad(x, (0, R - x.shape[1]))


def add_sums(sums: dict, loss, stats: dict, prompts: int, rows=slice(None)):
    """Add a part's loss x its prompts, its prompts, and each statistic's sum over them (`rows` of a (B,) one; a
    scalar counts once a prompt) to `sums`."""
    for k, v in {"loss": loss.item() * prompts, "prompts": prompts,
                 **{k: (v[rows].sum() if v.dim() else v * prompts).item() for k, v in stats.items()}}.items():
        sums[k] = sums.get(k, 0.0) + v


def pooled_backward(model, batch, rank: int, world: int, prompts, pad, device, cfg, beta: float, **tempering) -> dict:
    """`backward` for a loss that pools across prompts (it says so, or the start-up probe finds it: runtime.checks.
    loss_pools): it gets the whole batch of B prompts, on any --micro-batch and any number of trainer ranks. Each rank
    computes its share's log-probs without gradient, in passes of --micro-batch sequences; the ranks exchange them (an
    all-gather: every rank then holds the batch's); then each pass puts its sequences' log-probs, with gradient, among
    the batch's detached ones, and backpropagates the whole batch's loss: the loss is called 1 + passes times. The
    passes' gradients add up to the loss's over the whole batch (x ranks, as FSDP averages them). Returns `backward`'s
    sums for this rank's share."""
    K, loss_fn = cfg.samples_per_prompt, LOSSES[cfg.loss]
    per_token = getattr(loss_fn, "per_token", False)
    options = loss_options(cfg, beta, **tempering)  # every call's keyword arguments, as the start-up check's
    inputs = loss_inputs(batch, device, per_token, prompts)
    R = inputs["token_mask"].shape[-1] if per_token else 0
    share = slice(rank * len(batch) // world, (rank + 1) * len(batch) // world)
    pairs = [(prompts[t.prompt_id], t.response) for g in batch[share] for t in g]
    first = share.start * K                                             # this rank's first row of the batch's B x K
    parts = [range(s, min(s + cfg.micro_batch, len(pairs))) for s in range(0, len(pairs), cfg.micro_batch)]
    with torch.no_grad():
        mine = torch.cat([sequence_logps(model, [pairs[j] for j in rows], pad, device, cfg.temperature, R)
                          for rows in parts])                           # (n,) or (n, R)
        everyone = [mine]                                                # one rank: no process group needed
        if world > 1:
            everyone = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(everyone, mine)
        full = torch.cat([e.to(device) for e in everyone])              # (B K,) or (B K, R)

    def loss_of(x):
        x = x.view(len(batch), K, *x.shape[1:])                         # (B, K) or (B, K, R)
        return loss_fn(logp=x.sum(-1) if per_token else x, **({"token_logp": x} if per_token else {}), **inputs,
                       **options)
    loss, stats = loss_of(full)
    for rows in parts:
        live = full.clone()
        live[first + rows.start:first + rows.stop] = sequence_logps(model, [pairs[j] for j in rows], pad, device,
                                                                    cfg.temperature, R)
        (loss_of(live)[0] * world).backward()
    sums = {}
    add_sums(sums, loss.detach(), {k: v.detach() for k, v in stats.items()}, share.stop - share.start, share)
    return sums


def loss_inputs(part, device, per_token: bool, prompts) -> dict:
    """The loss's inputs from the trajectories of b groups: each number field (b, K), `length` and `prompt_length`,
    and for a per-token loss each per-token field and `token_mask`, (b, K, T) padded to the longest response."""
    field = lambda f: torch.tensor([[float(f(t)) for t in g] for g in part], device=device)  # (b, K)
    inputs = {name: field(lambda t, name=name: getattr(t, name)) for name in SCALARS}
    inputs["length"] = field(lambda t: len(t.response))
    inputs["prompt_length"] = field(lambda t: len(prompts[t.prompt_id]))
    if per_token:
        R = max(len(t.response) for g in part for t in g)
        padded = lambda f: torch.tensor(np.array([[np.pad(np.asarray(f(t), np.float32), (0, R - len(t.response)))
                                                    for t in g] for g in part]), device=device)  # (b, K, R)
        inputs["token_mask"] = padded(lambda t: np.ones(len(t.response)))
        for name in PER_TOKEN[1:]:  # not the response's token ids
            if all(getattr(t, name) is not None for g in part for t in g):
                inputs[name] = padded(lambda t, name=name: getattr(t, name))
    return inputs


# --- schedules (the authors': beta annealed linearly, lr warmup-stable-decay; Lee et al.'s T_R and gamma) ---
def beta_at(cfg, step: int) -> float:
    if cfg.beta_stop_step and step + 1 >= cfg.beta_stop_step:  # `step` updates done: this is update step + 1
        return cfg.beta_final  # the authors' TL;DR jump (src/tba_trainer_tldr.py:576-580)
    frac = min(1.0, step / cfg.beta_anneal_steps) if cfg.beta_anneal_steps else 1.0
    return cfg.beta + (cfg.beta_final - cfg.beta) * frac


def reward_temp_at(cfg, step: int) -> float:
    """T_R: --reward-temp at step 0, then linearly to 1 (Lee et al.'s get_total_reward_temp,
    trainers/gfn_trainer.py:253-258; their steps count from 1, ours from 0 like beta_at's); constant without
    an anneal length, so that --reward-temp alone does what it says."""
    if not cfg.reward_temp_anneal_steps:
        return cfg.reward_temp
    frac = min(1.0, step / cfg.reward_temp_anneal_steps)
    return cfg.reward_temp + (1.0 - cfg.reward_temp) * frac


def gamma_at(cfg, step: int) -> float:
    """gamma: 1 at step 0, then linearly to --gamma-final (their get_lm_reward_temp, gfn_trainer.py:260-264)."""
    frac = min(1.0, step / cfg.gamma_anneal_steps) if cfg.gamma_anneal_steps else 1.0
    return 1.0 + (cfg.gamma_final - 1.0) * frac


def lr_at(cfg, step: int) -> float:
    stable = cfg.stable_steps if cfg.stable_steps is not None else max(0, cfg.steps - cfg.warmup_steps - cfg.decay_steps)
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if step < cfg.warmup_steps + stable:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps - stable) / max(1, cfg.decay_steps))
    return cfg.lr * LR_DECAYS[cfg.lr_decay](progress)


LR_DECAYS = {"cosine": lambda progress: 0.5 * (1 + math.cos(math.pi * progress)),
             "linear": lambda progress: 1.0 - progress}  # transformers' get_linear_schedule_with_warmup


# ===== the run ====================================================================================
def run(cfg, data, ckpt):
    t_start = time.time()
    # from here a signal stops the run (at once before the first step, else after a checkpoint), and torchrun's end too
    signals = Signals(LAUNCHER)
    trainer = Trainer(cfg, data, ckpt, signals, t_start)
    try:
        train(trainer)
    finally:
        trainer.close()


@record  # torchrun's convention: an unexpected exception lands in its report with its traceback
def main(argv=None):
    cfg = parse(Config, sys.argv[1:] if argv is None else argv, __doc__.split("\n\n")[0])
    vllm_env.quiet_loading()
    vllm_env.quiet_resource_tracker()  # before the first lock starts it
    if argv is None and cfg.searchers and os.environ.get("LOCAL_RANK", "0") == "0" and machine_device() == "cpu":
        fork_server()  # its import of vLLM for the searchers (5 s) runs beside this rank's checks and model load
        # (from the command line only: a caller of main() in its own process, a test, starts it with its searchers)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank_env = int(os.environ.get("RANK", "0"))
    try:
        nodes.check(cfg, world)  # the launch's layout and network, before the ranks join
    except ConfigError as e:  # said on each node: what one node sees, another may not
        fail(f"tba.py: error: {e}", 2, int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:  # the ranks join (on the device check() will give cfg), then decide together whether it holds
        init_distributed(cfg.timeout, machine_device())
    try:
        cfg, data, ckpt = check(cfg, world)
        refusal = None
    except ConfigError as e:
        refusal = str(e)
    if world > 1:
        refusal = first_refusal(refusal)
    if refusal:
        if world > 1 and dist.is_initialized():  # the ranks' group, made above: not a caller's (a vLLM engine's)
            dist.destroy_process_group()
        fail(f"tba.py: error: {refusal}", 2, rank_env)
    try:
        run(cfg, data, ckpt)
    except (Dead, Silent, FloatingPointError, TimeoutError, Unsaved) as e:  # a searcher died or went silent, a
        fail(f"tba.py: error: {e}", 1, rank_env)  # non-finite loss, a wait timed out, final/ could not be written
    except Stop as e:
        name, saved = e.args
        fail(f"tba.py: stopped by {name}; {saved_where(saved, cfg.out)}", 130 if name == "SIGINT" else 143, rank_env)
    except KeyboardInterrupt:
        fail("tba.py: stopped at once by a second signal, without a checkpoint", 130, rank_env)
    except Exception as e:  # a collective failed because another trainer rank or node went away: each node says it
        if not nodes.lost(e, rank_env, world):
            raise
        fail(f"tba.py: error: {nodes.lost(e, rank_env, world)}", 1, int(os.environ.get("LOCAL_RANK", "0")))


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
    atexit._run_exitfuncs()  # what a normal exit runs first (multiprocessing unlinks its semaphores; the fork server)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
