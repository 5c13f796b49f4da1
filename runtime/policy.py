"""The trainer's model: loaded and sharded with FSDP2 over the trainer ranks (`load_policy`), its optimizer
(`AdamW`, whose moments stay in float32) and activation checkpointing (`recompute_blocks`).
"""

import math

import torch

from runtime import lora


def load_policy(path: str, device, dtype: str, weights_dtype: str = "float32", recompute: bool = False,
                adapter: tuple | None = None):
    """`weights_dtype` weights (float32, or bfloat16 as the authors' GSM8K run; AdamW's moments stay in
    float32 either way: `AdamW`), sharded with FSDP2 over the trainer ranks (per decoder block, then the
    whole), computing in `dtype` (bf16 on GPUs) and reducing gradients in float32. The blocks are the modules
    whose class the model lists in `_no_split_modules` (transformers' convention for sharding wrappers):
    LlamaDecoderLayer, GPTNeoXLayer, GPT2Block, Qwen2DecoderLayer, ... `adapter` = (rank, alpha, seed, saved
    adapter folder or None): LoRA on the frozen model (runtime/lora.py)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM
    device = torch.device(device)
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
    # FSDP2 on the model's own device: without a mesh it takes the accelerator torch was built for
    # (torch/distributed/fsdp/_fully_shard/_fsdp_init.py:198-211), and on a GPU node moves a CPU model to
    # cuda (_fsdp_init.py:369-404). from_group reuses the default group as it is (no new group, whose timeout
    # would be torch's default: torch/distributed/device_mesh.py:1053-1115).
    mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
    if device.type == "cuda" and device.index not in (None, torch.cuda.current_device()):
        # a cuda mesh shards onto the current device (torch/distributed/fsdp/_fully_shard/_fsdp_init.py:219-223)
        raise ValueError(f"load_policy on {device}: make it the current device first (torch.cuda.set_device)")
    for module in [m for m in model.modules() if type(m).__name__ in blocks]:
        fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


class AdamW(torch.optim.AdamW):
    """torch's AdamW with its moments in float32 whatever the weights' dtype. torch keeps them in the
    weights' dtype (zeros_like(p): torch/optim/adam.py:178-184), and in bf16 v x 0.999 rounds back to v,
    so v stops decaying (docs/departures.md, "bf16 weights"). A bf16 weight is updated by torch's own
    functional AdamW on a float32 copy, one parameter at a time (a copy of them all would cost 8 bytes a
    parameter at once), and rounded back; float32 weights take torch's own AdamW (`for_weights`)."""

    @classmethod
    def for_weights(cls, params: list, **options) -> torch.optim.AdamW:
        """torch's own AdamW if every weight is float32 (chosen once: a step runs none of ours), else this."""
        plain = all(p.dtype == torch.float32 for p in params)
        return (torch.optim.AdamW if plain else cls)(params, **options)

    @torch.no_grad()
    def step(self, closure=None):
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
        put the saved float32 ones back."""
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


class LaggedCopy:
    """--behaviour-logprobs trainer (with --lag L): the behaviour log-probs of a batch recomputed by the
    trainer, as the authors' MATH trainer does (their model_for_logprob_only, recompute_logprobs:
    train.py:139-141, 238-244, 290-301), so that the importance ratio compares the trainer's own log-probs,
    not vLLM's. A second copy of the policy, sharded as it is, in the compute dtype (its forward casts to it
    anyway: bf16 gives the same numbers at half the memory); each rank keeps the shards of the last L + 1
    steps' weights on the host (`record`, into slots allocated once: weights.flat_slot), and before step s
    loads those of step s - L, which sampled the batch, to rescore its trajectories (`rescore`)."""

    def __init__(self, path: str, device, dtype: str, lag: int):
        from runtime.weights import flat_slot
        self.model = load_policy(path, device, dtype, dtype).eval().requires_grad_(False)
        # FSDP2 keeps the root's parameters (embeddings, final norm, head) gathered after a forward without gradient
        # (torch/distributed/fsdp/_fully_shard/_fully_shard.py:453-466): the next `record` would copy full tensors
        # where it expects shards
        self.model.set_reshard_after_forward(True)
        shards = {i: (local(p).shape, local(p).dtype) for i, p in enumerate(self.model.parameters())}
        pin = torch.device(device).type == "cuda"
        self.lag, self.slots, self.ring = lag, [flat_slot(shards, pin) for _ in range(lag + 1)], {}

    def record(self, model, step: int):
        """The shards of `model`'s weights at step `step` (before its update), into slot step % (L + 1), which
        held the weights of step - L - 1: no batch needs them any more."""
        slot = self.slots[step % len(self.slots)]
        model.reshard()  # its shards, even after a forward without gradient (see __init__)
        for i, p in enumerate(model.parameters()):
            slot[i].copy_(local(p).detach(), non_blocking=True)
        if next(model.parameters()).is_cuda:
            torch.cuda.synchronize()  # the copies to the host done before the slot is read
        self.ring = {v: s for v, s in self.ring.items() if s is not slot}
        self.ring[step] = slot

    def restore(self, history: dict):
        """A resumed run: the weights of the L steps before the checkpoint's (its history: full weights in the
        sync dtype, on every rank), each sharded through the copy into the ring."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        for v, full in sorted(history.items()):
            set_model_state_dict(self.model, dict(full), options=StateDictOptions(full_state_dict=True, strict=False))
            self.record(self.model, int(v))

    @torch.no_grad()
    def rescore(self, groups, step: int, prompts, pad, device, temperature: float, micro_batch: int) -> float:
        """Each trajectory's behaviour log-probs (per token and summed) under the weights of step `step` - L,
        in passes of at most `micro_batch`; returns the mean absolute change of the summed ones."""
        from loss import collate, response_logprobs
        for p, saved in zip(self.model.parameters(), self.ring[max(0, step - self.lag)].values()):
            local(p).copy_(saved)
        trajectories, gap = [t for g in groups for t in g], []
        for i in range(0, len(trajectories), micro_batch):
            part = trajectories[i:i + micro_batch]
            pairs = [(prompts[t.prompt_id], t.response) for t in part]
            per = response_logprobs(self.model, *collate(pairs, pad, device), temperature, [len(p) for p, _ in pairs],
                                    [len(r) for _, r in pairs]).float().cpu().numpy()
            for t, row in zip(part, per):
                t.behaviour_logps = row[:len(t.response)].copy()
                gap.append(abs(float(t.behaviour_logps.sum()) - t.logp_behaviour))
                t.logp_behaviour = float(t.behaviour_logps.sum())
        return float(sum(gap) / max(1, len(gap)))


def local(p):
    """A parameter's tensor on this rank: its FSDP2 shard, or itself."""
    return p.to_local() if hasattr(p, "to_local") else p.data


# --- the learning rate's schedule (the authors' warmup-stable-decay) ----------------------------------
def lr_at(cfg, step: int) -> float:
    stable = cfg.stable_steps if cfg.stable_steps is not None else max(0, cfg.steps - cfg.warmup_steps - cfg.decay_steps)
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, max(0, step - cfg.warmup_steps - stable) / max(1, cfg.decay_steps))  # 0 while stable
    # linear as transformers' get_linear_schedule_with_warmup
    return cfg.lr * (1.0 - progress if cfg.lr_decay == "linear" else 0.5 * (1 + math.cos(math.pi * progress)))

