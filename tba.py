"""TBA: Trajectory Balance with Asynchrony (Bartoldson et al., NeurIPS 2025), from a laptop to several nodes.

Searcher processes generate responses with vLLM and a local copy of the policy, score them and push them to
the trainer without ever waiting for it (searcher.py). The trainer keeps learning from a replay buffer of
everything searched so far (buffer.py) with the trajectory balance objective (loss.py), which stays valid for
off-policy data, and every `--sync-every` steps its weights go to the searchers through shared tensors. This
file is the trainer: its loop (`train`), the algorithm's state (`Trainer`) and the gradient (`backward`);
every flag is a field of runtime/config.py's `Config`.

    torchrun --nproc_per_node=1 tba.py                  # the toy task on a laptop: about a minute
    torchrun --nproc_per_node=1 tba.py --searchers 0 --lag 0    # the synchronous on-policy baseline, same code
    bash run_gsm8k.sh                                   # the paper's GSM8K run on a 4-GPU node

The machinery it calls is in runtime/ (the README's house says what is where), the tasks in tasks/, one file
each; the processes and what passes between them: the README's picture (on a GPU node trainer rank r uses GPU
r, searcher i GPU ranks + i; on a CPU all share the cores). Several nodes: runtime/nodes.py.

Departures from the paper and the authors' code, and why: docs/departures.md.
"""

import gc
import os
import signal
import sys


def stopped_at_start(signum, frame):
    """Ctrl-C, SIGTERM, SIGHUP or SIGUSR1 while importing and checking: nothing runs yet, so stop quietly, in
    one line a node (torchrun forwards the signal to every rank)."""
    import atexit  # the searchers' fork server may be importing vLLM (vllm_env.early): the exit functions stop it
    atexit._run_exitfuncs()  # and remove its socket's folder, before our line (its import's lines would follow it)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"tba.py: stopped by {signal.Signals(signum).name} during start-up", file=sys.stderr, flush=True)
    os._exit(128 + signum)  # 130 / 143 / 129 / 138; no searcher has been spawned yet


from runtime.errors import STOPS  # noqa: E402  (a leaf module)

if __name__ == "__main__":  # before the heavy imports below, which take seconds
    for sig in STOPS:
        signal.signal(sig, stopped_at_start)
    gc.disable()  # the start-up's imports (seconds) with no cyclic GC passing over the heap they grow: `run`
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
from buffer import ReuseCap, loss_inputs
from loss import LOSSES, collate, loss_options, response_logprobs, scheduled, sequence_logprobs, unique_pairs
from runtime import nodes, seeds, slowdown
from runtime.checkpoint import full_state_dict, restore, save_checkpoint, save_final
from runtime.checks import check, parse
from runtime.config import Config
from runtime.errors import ConfigError, Dead, Silent, Stop, Unsaved
from runtime.fleet import Fleet
from runtime.local import LocalFleet
from runtime.processes import Signals, fork_server
from runtime.hub import load_tokenizer
from runtime.log import Log
from runtime.policy import AdamW, LaggedCopy, load_policy, lr_at
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
        wait, search = t.fleet.collect(t.buffer, t.step, t.waiting_for)
        t_train = time.time()
        # ===== sample a batch: B prompts x K responses (TBA: recency m, reward softmax) =========
        batch = t.sample()
        if batch is None:  # rank 0 stops the run (a signal, a silent searcher): every rank with it
            t.stop(saved=t.step > first_step)
        rescored = t.rescore(batch) if t.lagged else {}  # --behaviour-logprobs trainer: the lagged log-probs
        # ===== loss (TB unless --loss) and update ================================================
        temps, lr = scheduled(cfg, t.step), lr_at(cfg, t.step)  # beta, gamma, T_R (Lee et al.'s log R); the lr
        t.opt.param_groups[0]["lr"] = lr  # (its one group: Trainer's AdamW)
        sums = t.backward(t.model, batch, t.rank, t.world, t.data.prompts, t.pad, t.device, cfg, **temps)
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
        if t.log.emulated:  # --train-slowdown: the step lasts Y x its cost alone, before its weights go
            t.clock.charge(time.time() - t_train)
        # ===== sync weights to the searchers every k steps; TBA′: reset pi_ref every rho ========
        t_sync = time.time()
        if cfg.ref_reset_every and t.step % cfg.ref_reset_every == 0:
            t.reset_reference()
        elif t.step % cfg.sync_every == 0:
            t.sync_weights()
        sync = time.time() - t_sync
        # ===== log ===============================================================================
        t.log.train_row(t.step, batch, stats, t.fleet, t.buffer, t.cap, t.clock, lr=lr, **temps,
                        wait=wait, sync=sync, search=search, seconds=time.time() - t_step, **rescored)
        # ===== evaluate ==========================================================================
        if cfg.eval_every and t.step % cfg.eval_every == 0 and t.step < cfg.steps:
            t.evaluate()
        # ===== checkpoint ========================================================================
        if cfg.save_every and t.step % cfg.save_every == 0:
            save_checkpoint(t)
    t.finish()


class Trainer:
    """The algorithm's state on one trainer rank: the model and its optimizer, the replay buffer and the
    reuse cap, the step; and the fleet of searchers it learns from (runtime/fleet.py)."""

    def __init__(self, cfg, data, ckpt, signals, t_start: float):
        self.cfg, self.data, self.resumed, self.fleet = cfg, data, ckpt is not None, None
        self.rank, self.world, local_rank = init_distributed(cfg.timeout, cfg.device)
        self.step = ckpt["step"] if ckpt else 0
        self.at = self.step + 1  # the step under way, for the watchdog's lines (its sync, log and checkpoint too)
        # a stall, a signal while stuck in a collective, torchrun gone; this node's searchers silent or dead
        self.watchdog = Watchdog(self.rank, self.world, stall_bound(cfg.timeout), lambda: self.at,
                                 lambda: self.fleet.procs if self.fleet else [], cfg.out, signals,
                                 lambda: isinstance(self.fleet, Fleet) and self.fleet.watching())
        self.device = torch.device(f"cuda:{local_rank}" if cfg.device == "cuda" else "cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.set_num_threads(cfg.threads)  # before vLLM starts: it pins the thread count after
        # the step whose weights the searchers were last sent (a checkpoint's: they may hold older ones)
        self.synced = (ckpt["synced_version"] if ckpt and ckpt.get("synced") is not None else self.step)
        self.unsaved_said = self.dropped_said = False  # said once: a checkpoint unwritten, the buffer's drops
        self.initial = 0 if ckpt else cfg.initial_buffer  # trajectories before the first step
        self.backward = gradient(cfg)  # the gradient's path, chosen once
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
            trained = [p for p in self.model.parameters() if p.requires_grad]
            self.opt = AdamW.for_weights(trained, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                         betas=tuple(map(float, cfg.adam_betas.split(","))))
            self.buffer = ckpt["buffer"] if ckpt else tasks.get(cfg.task).buffer(cfg, data.prompts)
            self.draw = self.buffer.sample  # (--lag: this step's rounds)
            if cfg.lag is not None:
                self.draw, self.waiting_for = self.draw_round, self.rounds_missing
            self.cap = ReuseCap.for_run(cfg, nodes.layout(self.world)[0])  # --max-reuse
            if ckpt:
                restore(self, ckpt)
            self.lagged = None  # --behaviour-logprobs trainer: a second copy at the lagged weights
            if cfg.behaviour_logprobs == "trainer":
                self.lagged = LaggedCopy(path, self.device, cfg.dtype, cfg.lag)
                self.lagged.restore((ckpt or {}).get("history", {}))
            self.fleet.share(self.model, self.step, ckpt, newest=self.buffer.newest_version())
            self.publish = self.fleet.keep if cfg.lag is not None else self.fleet.publish  # --lag: kept, served later
        except BaseException:
            self.close()
            raise

    # --- what the next step waits for, its batch ---------------------------------------------------
    def waiting_for(self) -> str | None:
        """What the next step still lacks (rank 0), or None: an evaluation's weights held, the initial buffer, B prompts,
        data no more than --max-staleness old, --max-reuse's credit (--lag: `rounds_missing`, chosen once)."""
        if evaluation := self.fleet.evals.pending():  # an evaluation's weights first (the log's overhead)
            return evaluation
        if self.fleet.received < self.initial:  # (received only grows: after the first step, never)
            return f"the initial buffer ({self.fleet.received} of {self.initial} trajectories)"
        if len(self.buffer.prompts) < self.cfg.prompts_per_step:
            return f"data for {self.cfg.prompts_per_step} prompts ({len(self.buffer.prompts)} so far)"
        if self.cfg.max_staleness and self.step - self.fleet.newest > self.cfg.max_staleness:
            return (f"fresher data: the newest was sampled by the weights of step {self.fleet.newest}, "
                    f"{self.step - self.fleet.newest} steps ago (--max-staleness {self.cfg.max_staleness})")
        self.cap.receive(self.fleet.kept)
        if not self.cap.allows(self.cfg.prompts_per_step * self.cfg.samples_per_prompt):
            return (f"fresh data: {self.cap.drawn} trajectories drawn for training, {self.fleet.kept} kept "
                    f"(--max-reuse {self.cfg.max_reuse:g})")

    def sample(self):
        """B prompts x K responses from the buffer (--lag: from this step's rounds, `draw_round`), drawn by
        rank 0 and sent to every rank; None on every rank when rank 0 stops the run."""
        batch, B, K = None, self.cfg.prompts_per_step, self.cfg.samples_per_prompt
        if self.world > 1:  # a signal to any rank stops every rank
            share_signals(self.fleet.signals, self.world)
        if self.rank == 0 and not self.fleet.stop_reason():
            batch = self.draw(B, K, np.random.default_rng([self.cfg.seed, self.step, seeds.BATCH]))
            self.cap.draw(B * K)
        return broadcast_batch(batch, self.rank) if self.world > 1 else batch

    # --- --lag: each step's batch its own rounds (chosen once, in __init__) --------------------------
    def rounds_missing(self) -> str | None:
        """What the next step still lacks (rank 0): this step's rounds, all of them; or None."""
        got, want = self.buffer.waiting(self.step), self.fleet.round_size()
        return None if got >= want else (f"the rounds of step {self.step}, sampled by the weights of step "
                                         f"{max(0, self.step - self.cfg.lag)} ({got} of {want} trajectories)")

    def draw_round(self, B: int, K: int, rng):
        return self.buffer.sample_round(self.step, B, K, self.cfg.search_samples_per_prompt, rng)

    def rescore(self, batch) -> dict:
        """--behaviour-logprobs trainer: this rank's trajectories' behaviour log-probs recomputed with the weights that
        sampled them (step - L), and the row's field of how far vLLM's were (`train` calls it only then)."""
        self.lagged.record(self.model, self.step)  # the weights of this step, for the batch L steps on
        mine = batch[self.rank * len(batch) // self.world:(self.rank + 1) * len(batch) // self.world]
        return {"behaviour_gap": self.lagged.rescore(mine, self.step, self.data.prompts, self.pad, self.device,
                                                     self.cfg.temperature, self.cfg.micro_batch)}

    def stop(self, saved: bool):
        """Every rank: stop for rank 0's reason, after a checkpoint if `saved` (a step was taken)."""
        why = broadcast(self.fleet.stop_reason(), self.rank)
        raise_stop(why, save_checkpoint(self, stopping=True) if saved else False, self.cfg.out)

    # --- the weights' trips to the searchers ---------------------------------------------------------
    def sync_weights(self, pi_ref: bool = False, final: bool = False):
        """Publish the weights (--lag: served when the rounds L steps ahead need them); data from now on is recent.
        `pi_ref`: they also become pi_ref at once (TBA′); `final`: the last step's, for the final evaluation."""
        if self.publish(gather(self.model, getattr(torch, self.cfg.dtype)), self.step, pi_ref, final):
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
        self.fleet.evals.request(self.step)

    def finish(self):
        """The final weights to the searchers, the final evaluation, the final model (OUT/final)."""
        cfg = self.cfg
        self.fleet.evals.wait(self.buffer)  # every evaluation asked, before the final weights replace theirs
        if cfg.lag is not None or self.synced != self.step:
            self.sync_weights(final=True)  # the final evaluation is of the final weights
        self.evaluate()
        if cfg.searchers:
            self.fleet.evals.wait(self.buffer, cfg.steps)
            share_signals(self.fleet.signals, self.world)
            why = broadcast(self.fleet.stop_reason(), self.rank)  # all ranks together: a checkpoint is collective
            if why:
                raise_stop(why, save_checkpoint(self, stopping=True), cfg.out)
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
                self.fleet.evals.kept()
            except Exception as e:  # the stop's own reason comes first
                self.log.print(f"tba.py: the kept evaluations failed ({type(e).__name__}: {e})", file=sys.stderr)
        self.log.close()
        if self.fleet is not None:
            self.fleet.close()
        self.watchdog.close()
        if dist.is_initialized():
            dist.destroy_process_group()


# --- the gradient ------------------------------------------------------------------------------------
def backward(model, batch, rank: int, world: int, prompts, pad, device, cfg, **options) -> dict:
    """The gradient of the loss (`--loss`, on (b, K) tensors: buffer.loss_inputs) for this rank's share of the
    batch, and its sums: "loss" x prompts, "prompts", and each statistic's. Units of --micro-batch / K whole
    prompts, each one pass with gradient, each distinct sequence once, its loss scaled by its share of the B
    prompts (FSDP averages the ranks): the units' gradients add up to the mean's."""
    K, loss_fn, sums = cfg.samples_per_prompt, LOSSES[cfg.loss], {}
    per_token, options = getattr(loss_fn, "per_token", False), loss_options(cfg, **options)  # the check's
    mine, per_unit = batch[rank * len(batch) // world:(rank + 1) * len(batch) // world], cfg.micro_batch // K
    for unit in [mine[i:i + per_unit] for i in range(0, len(mine), per_unit)]:
        pairs, index = unique_pairs([t for g in unit for t in g], prompts)
        inputs = loss_inputs(unit, device, per_token, prompts)
        R = inputs["token_mask"].shape[-1] if per_token else 0
        x = sequence_logps(model, pairs, pad, device, cfg.temperature, R)[torch.tensor(index, device=device)]
        x = x.view(len(unit), K, *x.shape[1:])                                     # (b, K) or (b, K, R)
        loss, stats = loss_fn(logp=x.sum(-1) if per_token else x, **({"token_logp": x} if per_token else {}),
                              **inputs, **options)
        (loss * len(unit) / (len(batch) / world)).backward()  # its share of B
        add_sums(sums, loss.detach(), {k: v.detach() for k, v in stats.items()}, len(unit))
    return sums


def gradient(cfg):
    """The step's gradient, chosen once: `backward_in_passes` where a unit cannot be one pass, else
    `backward`."""
    return backward_in_passes if cfg.loss_pools or cfg.micro_batch < cfg.samples_per_prompt else backward


def backward_in_passes(model, batch, rank: int, world: int, prompts, pad, device, cfg, **options) -> dict:
    """`backward` where a unit cannot be one pass: a pooled loss (runtime.checks.loss_pools) has one unit, the
    whole batch, whose log-probs the ranks all-gather; a --micro-batch under K splits a prompt. Passes without
    gradient give the unit's statistics (log Z), then each pass puts its log-probs, with gradient, among the
    others' detached ones (duplicates too: every rank runs as many FSDP2 passes)."""
    K, loss_fn, pools = cfg.samples_per_prompt, LOSSES[cfg.loss], cfg.loss_pools
    per_token = getattr(loss_fn, "per_token", False)
    options = loss_options(cfg, **options)  # every call's keyword arguments, as the start-up check's
    share = slice(rank * len(batch) // world, (rank + 1) * len(batch) // world)
    per_unit = max(1, cfg.micro_batch // K)  # prompts
    units = [batch] if pools else [batch[share][i:i + per_unit] for i in range(0, share.stop - share.start, per_unit)]
    sums = {}
    for unit in units:
        mine = unit[share] if pools else unit  # this rank's groups of the unit
        first = share.start * K if pools else 0  # their first row among the unit's b x K
        pairs = [(prompts[t.prompt_id], t.response) for g in mine for t in g]  # in order: row i is pair i
        inputs = loss_inputs(unit, device, per_token, prompts)
        logps = lambda rows: sequence_logps(model, [pairs[j] for j in rows], pad, device, cfg.temperature,
                                            inputs["token_mask"].shape[-1] if per_token else 0)
        scaled = lambda loss: loss * world if pools else loss * len(unit) / (len(batch) / world)  # its share of B

        def loss_of(x):  # the unit's loss from its sequences' log-probs: (n,) or per token (n, R)
            x = x.view(len(unit), K, *x.shape[1:])                                     # (b, K) or (b, K, R)
            return loss_fn(logp=x.sum(-1) if per_token else x, **({"token_logp": x} if per_token else {}), **inputs,
                           **options)

        passes = [range(s, min(s + cfg.micro_batch, len(pairs))) for s in range(0, len(pairs), cfg.micro_batch)]
        with torch.no_grad():  # the statistics without gradient, then the gradient, by passes
            full = torch.cat([logps(rows) for rows in passes])                           # (n,) or (n, R)
            if pools and world > 1:  # every rank's, in rank order: the whole batch's
                everyone = [torch.zeros_like(full) for _ in range(world)]
                dist.all_gather(everyone, full)
                full = torch.cat([e.to(device) for e in everyone])
            loss, stats = loss_of(full)
        for rows in passes:
            live = full.clone()
            live[first + rows.start:first + rows.stop] = logps(rows)
            scaled(loss_of(live)[0]).backward()
        rows = share if pools else slice(None)  # a pooled unit's statistics: this rank's prompts'
        add_sums(sums, loss.detach(), {k: v.detach() for k, v in stats.items()}, len(mine), rows)
    return sums


def sequence_logps(model, pairs, pad, device, temperature: float, R: int = 0):
    """The log-probs of (prompt, response) pairs: summed, (n,), or with R > 0 per response token, (n, R) zero-padded."""
    batch = collate(pairs, pad, device)
    if not R:
        return sequence_logprobs(model, *batch, temperature)
    x = response_logprobs(model, *batch, temperature, [len(p) for p, _ in pairs], [len(r) for _, r in pairs])
    return torch.nn.functional.pad(x, (0, R - x.shape[1]))


def add_sums(sums: dict, loss, stats: dict, prompts: int, rows=slice(None)):
    """Add a unit's loss x its prompts, its prompts, and each statistic's sum over them (`rows` of a (b,) one; a
    scalar counts once a prompt) to `sums`."""
    for k, v in {"loss": loss.item() * prompts, "prompts": prompts,
                 **{k: (v[rows].sum() if v.dim() else v * prompts).item() for k, v in stats.items()}}.items():
        sums[k] = sums.get(k, 0.0) + v


# ===== the run ====================================================================================
def run(cfg, data, ckpt):
    t_start = time.time()
    # from here a signal stops the run (at once before the first step, else after a checkpoint), and torchrun's end too
    signals = Signals(LAUNCHER)
    trainer = Trainer(cfg, data, ckpt, signals, t_start)
    gc.enable()  # (off since tba.py's start on the command line)
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
        status = 128 + signal.Signals[name.split()[0]]  # (SIGTERM's name may say why it came)
        fail(f"tba.py: stopped by {name}; {saved_where(saved, cfg.out)}", status, rank_env)
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
