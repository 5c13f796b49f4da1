"""TBA: Trajectory Balance with Asynchrony (Bartoldson et al., NeurIPS 2025), from a laptop to several nodes.

Searcher processes generate responses with vLLM and a local copy of the policy, score them and
push them to the trainer without ever waiting for it (searcher.py). The trainer keeps learning
from a replay buffer of everything searched so far (buffer.py) with the trajectory balance
objective (loss.py), which stays valid for off-policy data, and every `--sync-every` steps its
weights go to the searchers through shared tensors (weights.py). This file holds the config, the
process layout and the trainer loop.

    torchrun --nproc_per_node=1 tba.py                  # the toy task on a laptop: about a minute
    torchrun --nproc_per_node=1 tba.py --searchers 0    # the synchronous baseline, same code
    python tba.py --help                                # every flag
    bash run_gsm8k.sh                                   # the paper's GSM8K run on a 4-GPU node

Layout: torchrun starts the trainer ranks, which train one model with FSDP2 (`fully_shard`).
Rank 0 holds the replay buffer, samples each batch and broadcasts it, and spawns `--searchers`
searcher processes with torch.multiprocessing. On a GPU node trainer rank r uses GPU r and
searcher i GPU (ranks + i); on a CPU machine everything shares the cores, split evenly. Searcher 0
also evaluates, between two rounds, when the trainer asks. With `--searchers 0` (one trainer
process) the trainer runs the vLLM engine itself: it generates before each step and evaluates.
Several nodes (`torchrun --nnodes N`): each node's first trainer process does for its node what
rank 0 does for the weights and searchers, and forwards its searchers' trajectories to rank 0
(nodes.py; `multi` below is None on one node).

Departures from the authors' code (MPI + DeepSpeed + TRL): trajectories stream to the trainer
through a bounded queue instead of arriving at each sync, so "recent" data means data added since
the last sync, or the newest data until some arrives (buffer.py); weights travel through shared
memory / CUDA IPC instead of MPI; the learning-rate schedule is computed here (same shape as
transformers' warmup-stable-decay). `--loss` swaps TB for an on-policy baseline (loss.py), for the
off-policy study of `bench.py` part 7; `--ref-reset-every` is TBA′ (the paper, Sec. 6).
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
import json
import math
import socket
import time
from queue import Empty

import searcher  # first: sets vLLM's environment before anything imports vllm
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import nodes
from buffer import ReplayBuffer
from checkpoint import full_state_dict, save_checkpoint, save_hf
from config import ConfigError, beta_at, check, lr_at, parse
from log import Log
from loss import LOSSES, collate, sequence_logprobs, unique_pairs
from searcher import Engine
from weights import Dead, aliases, allocate, create, gather, publish


# --- the trainer's model and its gradient ------------------------------------------------------------
def load_policy(path: str, device, dtype: str, weights_dtype: str = "float32", recompute: bool = False):
    """`weights_dtype` weights (float32, or bfloat16 as the authors' GSM8K run: AdamW keeps its state
    in the weights' dtype), sharded with FSDP2 over the trainer ranks (per decoder block, then the
    whole), computing in `dtype` (bf16 on GPUs) and reducing gradients in float32. The blocks are
    the modules whose class the model lists in `_no_split_modules` (transformers' convention for
    sharding wrappers): LlamaDecoderLayer, GPTNeoXLayer, GPT2Block, Qwen2DecoderLayer, ..."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, weights_dtype)).to(device)
    model.config.use_cache = False
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32)
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    if recompute:  # --activation-checkpointing, before fully_shard (as FSDP2's own tests compose them)
        recompute_blocks(model, blocks)
    for module in [m for m in model.modules() if type(m).__name__ in blocks]:
        fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def recompute_blocks(model, blocks: set):
    """Activation checkpointing per decoder block: each keeps only its input and recomputes the rest
    in the backward pass. The composable form hooks the module in place, keeping its parameter names
    (torch/distributed/_composable/checkpoint_activation.py:38-46), so weights.gather, checkpoints and
    save_pretrained see the same names; non-reentrant, with the RNG state kept: the same numbers."""
    from torch.distributed._composable import checkpoint
    for module in [m for m in model.modules() if type(m).__name__ in blocks]:
        checkpoint(module)


def backward(model, groups, prompts_per_rank: float, prompts, pad, device, cfg, beta: float) -> dict:
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
            logp_behaviour=field(lambda t: t.logp_behaviour), length=field(lambda t: len(t.response)), clip=cfg.clip)
        # the mean over all B prompts: FSDP averages gradients over the ranks, each holding B / ranks
        (loss * len(part) / prompts_per_rank).backward()
        for k, v in {"loss": loss.item() * len(part), "prompts": len(part),
                     **{k: v.sum().item() for k, v in stats.items()}}.items():
            sums[k] = sums.get(k, 0.0) + v
    return sums


# --- distributed helpers -------------------------------------------------------------------------
def init_distributed(cfg):
    """One process group even for a single process, so one code path serves 1 and N ranks. Called
    again (run() after main() under torchrun), it returns the group's ranks."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])
    if "RANK" not in os.environ:  # plain `python tba.py`: a group of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(s.getsockname()[1]))
    import datetime
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    # rank 0's long waits (engines starting, the initial buffer, fresher data, the final evaluation)
    # answer the other ranks every slice (wait_together); what remains is its time alone between two
    # collectives: a weight-sync lock (up to --timeout) or writing a checkpoint (minutes at 2.8B)
    timeout = datetime.timedelta(seconds=2 * cfg.timeout + 600)
    # but joining waits at most --timeout: a rank that failed before it joined never comes
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=max(cfg.timeout, 1)))
    dist.distributed_c10d._set_pg_timeout(timeout)  # every later collective (torch/distributed/distributed_c10d.py:1616)
    return dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])


def first_refusal(message: str | None) -> str | None:
    """All ranks: the configuration error of the first rank that refused one (None if none did), so
    that all stop together (ranks on other nodes may see other files). Sent as bytes, never pickled."""
    data = torch.zeros(1024, dtype=torch.uint8)
    if message:
        raw = message.encode()[:1024]
        data[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    gathered = [torch.zeros_like(data) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, data)
    for r, g in enumerate(gathered):
        if g.any():
            text = bytes(g.numpy()).rstrip(b"\0").decode(errors="ignore")
            return text if r == dist.get_rank() or r == 0 else f"(rank {r}) {text}"
    return None


def broadcast(obj, rank):
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# --- the run -------------------------------------------------------------------------------------
class Stop(Exception):
    """A signal asked the run to stop (after a checkpoint, once training has begun)."""


def fail(message: str, code: int, rank: int):
    """Exit with one line. Under torchrun, also leave it in the worker's error file, so that
    torchrun's failure report names it (torch/distributed/elastic/multiprocessing/errors/__init__.py,
    _format_failure: it shows the file's message.extraInfo.py_callstack)."""
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with open(error_file, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                                     "timestamp": str(int(time.time()))}}}, f)
    sys.exit(code)


@record  # torchrun's convention: an unexpected exception lands in its report with its traceback
def main(argv=None):
    cfg = parse(sys.argv[1:] if argv is None else argv, __doc__.split("\n\n")[0])
    searcher.quiet_loading()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank_env = int(os.environ.get("RANK", "0"))
    try:
        nodes.check(cfg, world)  # the launch's layout, before the ranks join
    except ConfigError as e:
        fail(f"tba.py: error: {e}", 2, rank_env)
    if world > 1:  # the ranks join, then decide together whether the configuration holds
        init_distributed(cfg)
    try:
        cfg, *data = check(cfg, world)
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
        run(cfg, *data)
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


def run(cfg, tokenizer, train_problems, test_problems, prompts, test_prompts, ckpt):
    t_start = time.time()
    # --- signals: before the first step, one stops the run at once (nothing to save); after, the
    # first stops it after a checkpoint and a second stops it at once
    stop_signal, training = [], [False]  # [(name, time)] of the first signal; [a step was taken]

    def on_signal(signum, frame):
        name = signal.Signals(signum).name
        if not training[0]:
            raise Stop(name, False)
        if stop_signal and time.time() - stop_signal[0][1] > 1:  # torchrun forwards Ctrl-C's SIGINT again
            raise KeyboardInterrupt                                # at once: a second signal counts after 1 s
        stop_signal[:] = stop_signal or [(name, time.time())]
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    rank, world, local_rank = init_distributed(cfg)
    local_world = nodes.layout(world)[1]
    leader = local_rank == 0  # its node's shared weights, searchers and queue (rank 0 on one node)
    multi = nodes.Nodes(world, local_world, cfg.timeout) if world > local_world else None  # several nodes
    device = torch.device(f"cuda:{local_rank}" if cfg.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(cfg.threads)  # before vLLM starts: it pins the thread count after
    answers = [p.answer for p in train_problems]
    test_answers = [p.answer for p in test_problems]
    ctx = torch.multiprocessing.get_context("spawn")
    procs, engine, channels, shared = [], None, None, None
    step = ckpt["step"] if ckpt else 0
    log = Log(cfg, rank, t_start - (ckpt["elapsed"] if ckpt else 0.0), step,
              resumed={"step": step} if ckpt else None)

    try:
        # --- the searchers first (each node's leader): their vLLM engines start while the trainer loads its model
        shared = create(ctx) if leader else None
        if leader and cfg.searchers:
            channels = (ctx.Queue(maxsize=4 * cfg.searchers), ctx.Event(), ctx.Queue())
            queue, stop, evals = channels
            first = rank // local_world * cfg.searchers  # searchers of earlier nodes: seeds differ
            for i in range(cfg.searchers):
                dev = f"cuda:{local_world + i}" if cfg.device == "cuda" else "cpu"
                p = ctx.Process(target=searcher.run, name=f"searcher-{first + i}", daemon=True,
                                args=(first + i, dict(vars(cfg)), shared, queue, stop, evals if i == 0 else None,
                                      prompts, answers, test_prompts, test_answers, dev))
                p.start()
                procs.append(p)
        # --- synchronous baseline: a vLLM engine inside the trainer (one process: see check())
        if cfg.searchers == 0:
            engine = Engine(cfg, str(device), cfg.trainer_memory, prompts, answers)
        # --- the trainer's model: FSDP2 over the trainer ranks (beside an engine: see Engine.transformers_models)
        with engine.transformers_models() if engine else contextlib.nullcontext():
            model = load_policy(os.path.join(cfg.resume, "model") if cfg.resume else cfg.model_path, device, cfg.dtype,
                                cfg.trainer_dtype, cfg.activation_checkpointing)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

        # --- resume: optimizer, buffer, RNG, counters, and the weights the searchers held
        buffer = ReplayBuffer(cfg.buffer_capacity, cfg.recency, cfg.reward_inv_temp)
        if ckpt:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
            set_optimizer_state_dict(model, opt, ckpt["optimizer"], options=StateDictOptions(full_state_dict=True))
            torch.set_rng_state(ckpt["torch_rng"])
            buffer, log.samples, log.first_eval = ckpt["buffer"], ckpt["samples"], ckpt["first_eval"]

        # --- the shared weights (each leader allocates them once), handed to the searchers
        named = gather(model, getattr(torch, cfg.dtype))
        if leader:
            allocate(shared, named, aliases(model), device, getattr(torch, cfg.dtype), with_ref=cfg.ref_reset_every > 0)
            shared.version.value = step
            if ckpt and ckpt["synced"] is not None:  # the searchers held older weights
                publish(shared, ckpt["synced"].items(), ckpt["synced_version"], lambda: None, cfg.timeout)
            if ckpt and ckpt["ref"] is not None:  # TBA′: pi_ref of the latest reset
                publish(shared, ckpt["ref"].items(), ckpt["ref_version"], lambda: None, cfg.timeout, to=("ref",))
            for _ in procs:  # now the searchers may read them (shared memory / CUDA IPC handles, not copies)
                shared.handoff.put((shared.tensors, shared.ref))
            log.published[shared.version.value] = log.clock()
        for _ in named:  # the other ranks take part in every all-gather of the leaders' allocation
            pass
        history = {}  # --lag: step -> the weights of that step (the leaders, CPU), until published
        watch = Watch(procs, cfg.timeout, log, newest(buffer)) if rank == 0 and procs else None  # silent searchers
        silent = []  # [message] once a searcher has sent nothing for --timeout (rank 0)

        def alive():
            for i, p in enumerate(procs):
                if p.exitcode is not None:
                    raise Dead(f"searcher {i} (pid {p.pid}) died with exit code {p.exitcode}")

        def receive(until, what) -> float:
            """Move the searchers' messages into the buffer and the log; wait (polling, checking the
            searchers, signals and the timeout) until `until()` holds, a signal or a silent searcher
            stops the run. Every rank waits with rank 0 (wait_together); `what()` says what for.
            Returns seconds waited."""
            def some(seconds):
                try:
                    return drain(channels[0], buffer, log, alive, done, cfg.timeout, watch, seconds)
                except Silent as e:
                    silent[:] = [str(e)]
                    return 0.0
            done = lambda: rank == 0 and (until() or bool(stop_signal) or bool(silent))
            return wait_together(rank, world, some, done, what, log, min(30.0, cfg.timeout / 4))

        def missing(initial) -> str | None:
            """What the next step waits for (rank 0), or None: the initial buffer, B prompts, or data
            no more than --max-staleness steps old (the newest; replayed draws are old by design)."""
            if log.samples < initial:
                return f"the initial buffer ({log.samples} of {initial} trajectories)"
            if len(buffer.prompts) < cfg.prompts_per_step:
                return f"data for {cfg.prompts_per_step} prompts ({len(buffer.prompts)} so far)"
            if cfg.max_staleness and step - watch.newest > cfg.max_staleness + cfg.lag:
                return (f"fresher data: the newest was sampled by the weights of step {watch.newest}, "
                        f"{step - watch.newest} steps ago (--max-staleness {cfg.max_staleness})")
            return None

        def now() -> float:
            """Several nodes, rank 0: node 0's messages into the buffer and the log, without waiting."""
            return drain(channels[0], buffer, log, alive, lambda: True, cfg.timeout, watch)

        def fresh(initial) -> bool:
            """Several nodes, rank 0: nothing missing, counting the newest data from every node."""
            watch.newest = max([watch.newest] + [v for v in multi.versions if v is not None])
            return missing(initial) is None

        def reason():
            """Why rank 0 stops the run, or None: ("silent", message) or ("signal", name)."""
            return ("silent", silent[0]) if silent else ("signal", stop_signal[0][0]) if stop_signal else None

        def evaluate():
            """Greedy evaluation on the held-out problems with the current weights."""
            if cfg.searchers:  # searcher 0 evaluates the newest published weights between rounds
                if rank == 0:
                    channels[2].put(step)
                return
            t0 = time.time()
            if engine.version != step:
                engine.load(gather(model), step)
            scores, example = engine.evaluate(test_prompts, test_answers)
            log.eval(step, scores, example, time.time() - t0, log.clock())
            log.overhead += time.time() - t0

        def sync_weights(ref=False, lag=cfg.lag):
            """Publish the trainer's weights, or with `lag` those of step - lag; searchers reload them
            before their next round. `ref`: they also become pi_ref (TBA′)."""
            named, version = gather(model, getattr(torch, cfg.dtype)), step
            if lag:  # the staleness study: keep each step's weights (CPU) until it is published
                if leader:
                    history[step] = {n: t.detach().to("cpu", copy=True) for n, t in named}
                for _ in named:  # the other ranks take part in every all-gather
                    pass
                due = [v for v in history if v <= step - lag]
                if not due:  # nothing old enough yet (and always on the other ranks): the searchers keep step 0's
                    return
                version, named = max(due), history[max(due)].items()
            if leader:
                publish(shared, named, version, alive, cfg.timeout, to=("policy", "ref") if ref else ("policy",))
                buffer.mark_sync()
                log.published[version] = log.clock()
            for _ in named:  # the other ranks take part in every all-gather
                pass
            for v in [v for v in history if v <= version]:
                del history[v]

        def checkpoint():
            t0 = time.time()
            save_checkpoint(cfg, rank, model, opt, buffer, shared, step, log, tokenizer)
            log.overhead += time.time() - t0

        evaluate()
        first_step = step
        while step < cfg.steps:
            t_step, wait, search = time.time(), 0.0, 0.0  # search: s this process spent in search rounds
            # ===== collect: searched trajectories into the buffer ==============================
            initial = cfg.initial_buffer if step == first_step and not ckpt else 0  # before the first step
            if rank == 0 and cfg.searchers == 0 and not stop_signal:  # synchronous: generate here
                engine.sync(shared, alive, cfg.timeout)
                for round_ in range(10**9):  # one round a step; more before the first (--initial-buffer)
                    ids = np.random.default_rng([cfg.seed, step, 3, round_]).choice(
                        len(prompts), cfg.prompts_per_step, replace=False)
                    t_search = time.time()
                    trajectories, made = engine.search(ids, cfg.search_samples_per_prompt, (cfg.seed, round_, step))
                    search += time.time() - t_search
                    buffer.add(trajectories)
                    log.samples += len(trajectories)
                    log.generate, log.slept = log.generate + made["generate"], log.slept + made["slept"]
                    if log.samples >= initial or stop_signal:
                        break
            elif cfg.searchers and multi:  # several nodes: the leaders meet (nodes.py); the others go on
                if leader:
                    wait = multi.collect(channels[0], now, alive, lambda: fresh(initial) or bool(stop_signal), buffer, log,
                                         cfg.timeout)
            elif cfg.searchers:  # TBA: whatever arrived; wait only at the start or for fresher data
                wait = receive(lambda: missing(initial) is None, lambda: missing(initial))
            # ===== sample a batch: B prompts x K responses (TBA: recency m, reward softmax) =====
            batch = None  # stays None on rank 0 when a signal asked to stop
            if rank == 0 and not reason():
                batch = buffer.sample(cfg.prompts_per_step, cfg.samples_per_prompt,
                                      np.random.default_rng([cfg.seed, step, 2]))
            batch = broadcast(batch, rank)
            if batch is None:
                why = broadcast(reason(), rank)  # every rank: why rank 0 stops
                if step > first_step:
                    checkpoint()
                halt(why, step > first_step, cfg.out)
            mine = batch[rank * len(batch) // world:(rank + 1) * len(batch) // world]
            # ===== loss (TB unless --loss) and update ============================================
            beta, lr = beta_at(cfg, step), lr_at(cfg, step)
            for g in opt.param_groups:
                g["lr"] = lr
            sums = backward(model, mine, len(batch) / world, prompts, pad, device, cfg, beta)
            stats = torch.tensor(list(sums.values()), dtype=torch.float64)
            dist.all_reduce(stats)
            stats = dict(zip(sums, (stats / stats[list(sums).index("prompts")]).tolist()))  # means over prompts
            if not math.isfinite(stats["loss"]):
                raise FloatingPointError(f"non-finite loss at step {step + 1}; the last good checkpoint, if any, "
                                         f"is {os.path.join(cfg.out, 'checkpoint')}")
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            training[0] = True  # from now on a signal stops the run after a checkpoint
            # ===== sync weights to the searchers every k steps; TBA′: reset pi_ref every rho ===
            t_sync = time.time()
            if cfg.ref_reset_every and step % cfg.ref_reset_every == 0:
                sync_weights(ref=True)  # pi_ref <- the current policy; older data leaves the buffer
                if rank == 0:
                    buffer.set_reference(step)
            elif step % cfg.sync_every == 0:
                sync_weights()
            sync_seconds = time.time() - t_sync
            # ===== log ============================================================================
            if rank == 0:
                stale = [step - 1 - t.version for g in batch for t in g]
                stats.pop("prompts")
                log.row(kind="train", step=step, time=log.now(), **stats,
                        reward=float(np.mean([t.reward for g in batch for t in g])), beta=beta, lr=lr,
                        staleness=float(np.mean(stale)), staleness_max=int(max(stale)), wait=wait,
                        sync=sync_seconds, search=search, seconds=time.time() - t_step, samples=log.samples,
                        generate=log.generate, slept=log.slept,
                        buffer=len(buffer), reference=buffer.reference, overhead=log.overhead,
                        **(multi.row(log.samples) if multi else {}))
            # ===== evaluate ======================================================================
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                evaluate()
            # ===== checkpoint =====================================================================
            if cfg.save_every and step % cfg.save_every == 0:
                checkpoint()

        # --- the end: the final weights to the searchers, the final evaluation, the final model
        if cfg.lag or step % cfg.sync_every:
            sync_weights(lag=0)  # the final evaluation is of the final weights
        evaluate()
        if cfg.searchers:
            receive(lambda: log.evals and log.evals[-1]["version"] == cfg.steps,
                    lambda: f"the final evaluation (of step {cfg.steps}) from searcher 0")
            why = broadcast(reason(), rank)  # all ranks together: a checkpoint is collective
            if why:
                checkpoint()
                halt(why, True, cfg.out)
        sd = full_state_dict(model)
        if rank == 0:
            save_hf(model, sd, tokenizer, os.path.join(cfg.out, "final"))
            log.summary()
    finally:
        log.close()
        if channels is not None:
            shutdown(procs, *channels[:2], shared.handoff)
        if engine is not None:
            engine.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def drain(queue, buffer, log, alive, done, timeout: float, watch=None, budget: float = math.inf) -> float:
    """Move every waiting message into the buffer (trajectories) or the log (evaluations); then, while
    not done(), wait for more, polling, checking the searchers (`watch`: silent ones too) and a
    timeout, for at most `budget` seconds. Returns seconds waited."""
    waited, deadline = 0.0, time.time() + timeout  # the deadline moves on with every message
    end = time.time() + budget
    while True:
        block = not done() and time.time() < end
        t0 = time.time()
        try:
            msg = queue.get(timeout=searcher.WAIT) if block else queue.get_nowait()
        except Empty:
            alive()
            if watch is not None:
                watch.check()
            if not block:
                return waited
            waited += time.time() - t0
            if time.time() > deadline:
                raise TimeoutError(f"no message from the searchers in {timeout:.0f} s (see --timeout)")
            continue
        if block:
            waited += time.time() - t0
        deadline = time.time() + timeout
        if watch is not None:
            watch.heard(msg)
        if msg["kind"] == "eval":
            log.eval(msg["version"], msg["scores"], msg["example"], msg["seconds"], log.published[msg["version"]])
        else:
            buffer.add(msg["trajectories"])
            log.samples += len(msg["trajectories"])
            log.generate, log.slept = log.generate + msg["generate"], log.slept + msg["slept"]


class Silent(Exception):
    """A searcher sent nothing for --timeout seconds; the message names it."""


class Watch:
    """Rank 0 watches its searchers' messages. A searcher stuck in vLLM, on a wedged GPU or a stalled
    file system still lives, and the trainer, which never waits once the buffer has data, would train
    on frozen data without a word. So: a warning once a searcher has sent nothing for well over its
    usual time between two messages (a round, or an evaluation), and Silent once --timeout passes
    with nothing from it (start-up counts: vLLM's load and compile). `newest`: the newest weight
    version that sampled data the trainer received (for --max-staleness)."""
    WARN_FACTOR, WARN_MIN = 5.0, 10.0  # warn after 5 x its longest gap so far, 10 s at least

    def __init__(self, procs, timeout: float, log, newest: int):
        self.procs, self.timeout, self.log, self.newest = procs, timeout, log, newest
        self.last = [time.time()] * len(procs)  # when each was last heard from (or spawned)
        self.gap = [None] * len(procs)          # its longest time between two messages (None: one or none yet)
        self.heard_once = [False] * len(procs)
        self.warned = [False] * len(procs)

    def heard(self, msg):
        i, now = msg.get("searcher", 0), time.time()
        if self.heard_once[i]:
            self.gap[i] = max(self.gap[i] or 0.0, now - self.last[i])
        if self.warned[i]:
            self.log.print(f"tba.py: searcher {i} sends again, after {now - self.last[i]:.0f} s", file=sys.stderr)
        self.last[i], self.heard_once[i], self.warned[i] = now, True, False
        if msg["kind"] == "search":
            self.newest = max(self.newest, msg["version"])

    def check(self):
        now = time.time()
        for i, p in enumerate(self.procs):
            quiet = now - self.last[i]
            if quiet > self.timeout:
                raise Silent(f"searcher {i} (pid {p.pid}) has sent nothing for {quiet:.0f} s (--timeout {self.timeout:g})")
            usual = self.gap[i]
            if usual is not None and not self.warned[i] and quiet > min(max(self.WARN_FACTOR * usual, self.WARN_MIN),
                                                                         self.timeout / 2):
                self.warned[i] = True
                self.log.print(f"tba.py: warning: searcher {i} (pid {p.pid}) has sent nothing for {quiet:.0f} s "
                               f"(usually every {usual:.1f} s at most); the run stops if it stays silent "
                               f"{self.timeout:g} s (--timeout)", file=sys.stderr)


def newest(buffer) -> int:
    """The newest weight version among the buffer's data (a resumed buffer), or -1 if empty."""
    return max((t.version for group in buffer.groups.values() for t, _ in group.values()), default=-1)


def wait_together(rank: int, world: int, wait, done, what, log, slice_s: float) -> float:
    """Rank 0 waits (`wait(seconds)`, returning seconds waited) until `done()`, in slices of `slice_s`
    seconds, saying after each what it still waits for (`what()`); after each slice it tells the
    other ranks, which wait in a broadcast, whether to go on. So no collective waits longer than a
    slice however long rank 0 waits, and every rank leaves the wait together. Returns seconds waited."""
    waited = 0.0
    while True:
        finished = None
        if rank == 0:
            waited += wait(slice_s)
            finished = done()
            if not finished:
                log.print(f"tba.py: waiting for {what()} ({waited:.0f} s so far)", file=sys.stderr)
        if (finished if world == 1 else broadcast(finished, rank)):
            return waited


def halt(why, saved: bool, out: str):
    """Stop every rank for rank 0's reason (broadcast): a silent searcher or a signal."""
    kind, what = why or ("signal", "a signal")
    where = f"checkpoint in {os.path.join(out, 'checkpoint')}" if saved else "before the first step: nothing to save"
    if kind == "silent":
        raise Silent(f"{what}; {where}")
    raise Stop(what, saved)


def shutdown(procs, queue, stop, handoff):
    """Stop the searchers: ask (they finish their round), then kill; nothing is left behind."""
    stop.set()
    deadline = time.time() + 5
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.time()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    queue.cancel_join_thread()
    handoff.cancel_join_thread()


if __name__ == "__main__":
    main()
