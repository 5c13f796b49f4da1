"""LoRA (Hu et al. 2021) for the trainer, with peft: `--lora-rank R` trains a low-rank update
B A (r x in, out x r) beside each target weight W, which stays frozen; the policy is
W + (alpha / r) B A. Lee et al.'s red-teaming attacker trains this way (r 32, alpha 16, peft's
default target modules: GPT-2's c_attn, Llama's q_proj and v_proj; trainers/gfn_trainer.py:149-158).

What the rest of the code sees:
- The searchers get MERGED weights under the plain model's Hugging Face names (`merged_names`,
  used by weights.gather): vLLM loads a plain model and never learns that LoRA exists.
- Checkpoints hold the merged model (model/, a plain model anyone can load) and the adapter
  (adapter/, peft's format); --resume rebuilds the policy from the frozen base (--model, which
  cannot change mid-run) and the adapter, so the weights are the saved ones bit for bit.
- AdamW gets the adapter's parameters only; FSDP2 shards frozen and trainable ones alike.
"""

import os
import warnings

import torch

ADAPTER = "default"  # peft's name for the one adapter
PREFIX = "base_model.model."  # peft's prefix on every state-dict name of the wrapped model


def wrap(model, rank: int, alpha: int, seed: int):
    """The model with a fresh LoRA adapter on peft's default target modules for its architecture. B starts at
    zero (the policy starts as the model); A's random start is drawn from `seed`, the same on every rank."""
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft sets fan_in_fan_out itself for GPT-2's Conv1D (weight (in, out)) and says so once a layer
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False")
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def check_rank(path: str, rank: int):
    """Refuse in one line a --lora-rank that peft cannot place on the model at `path`, or that is above the
    width of a target: the update B A of an (in x out) layer has rank at most min(in, out), so a larger r only
    adds parameters. The widths come from the config, on the meta device (no weights read, no memory)."""
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS  # what wrap's peft uses
    from transformers import AutoConfig, AutoModelForCausalLM
    from runtime.errors import ConfigError
    config = AutoConfig.from_pretrained(path)
    targets = DEFAULTS.get(config.model_type)
    if not targets:
        raise ConfigError(f"--lora-rank: peft has no default target modules for model type {config.model_type!r} "
                          f"({path})")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    widths = {min(m.weight.shape) for name, m in model.named_modules()
              if name.split(".")[-1] in targets and getattr(m, "weight", None) is not None and m.weight.dim() == 2}
    if widths and rank > min(widths):
        raise ConfigError(f"--lora-rank: {rank} is above the width of peft's targets ({', '.join(sorted(targets))}) of "
                          f"{path}: an update of an (in x out) layer has rank at most min(in, out), {min(widths)} here")


def active(model) -> bool:
    return hasattr(model, "peft_config")


def plain_name(name: str) -> str:
    """The Hugging Face name of a wrapped model's state-dict entry (a LoRA layer's base weight: its own)."""
    name = name[len(PREFIX):] if name.startswith(PREFIX) else name
    return name.replace(".base_layer.", ".")


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def layers(model) -> dict:
    """{state-dict name of a LoRA layer's base weight: the layer} (empty for a plain model)."""
    if not active(model):
        return {}
    from peft.tuners.lora import LoraLayer
    return {f"{name}.base_layer.weight": m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def delta(layer, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """(alpha / r) B A in float32, laid out as the base weight (transposed for GPT-2's Conv1D, whose
    weight is (in, out): peft's fan_in_fan_out)."""
    d = (B.float() @ A.float()) * layer.scaling[ADAPTER]  # (out, in)
    return d.T if layer.fan_in_fan_out else d


def merged_names(model, full, dtype=None):
    """(Hugging Face name, full tensor) of the merged model for each distinct tensor of the state
    dict, `full(t)` making each full (weights.gather's all-gather): LoRA's A and B are folded into
    their base weight (W + delta, in float32, then cast to `dtype`) and not sent themselves. Every
    trainer rank must iterate to the end: the all-gathers happen in state-dict order on all of them."""
    lora, sd, seen = layers(model), model.state_dict(keep_vars=True), set()
    for name, t in sd.items():
        if id(t) in seen or is_adapter(name):
            continue
        seen.add(id(t))
        t = t.detach()
        if name in lora:
            prefix = name[:-len("base_layer.weight")]
            A, B = (full(sd[f"{prefix}lora_{x}.{ADAPTER}.weight"].detach()) for x in "AB")
            w = full(t)
            w = (w.float() + delta(lora[name], A, B)).to(dtype or w.dtype)
        else:
            w = full(t.to(dtype) if dtype is not None and t.is_floating_point() else t)
        yield plain_name(name), w


def merge_state_dict(model, sd: dict) -> dict:
    """A full state dict of the wrapped model (checkpoint.full_state_dict) as the merged plain model's."""
    lora, out = layers(model), {}
    for name, t in sd.items():
        if is_adapter(name):
            continue
        if name in lora:
            prefix = name[:-len("base_layer.weight")]
            t = (t.float() + delta(lora[name], sd[f"{prefix}lora_A.{ADAPTER}.weight"],
                                   sd[f"{prefix}lora_B.{ADAPTER}.weight"])).to(t.dtype)
        out[plain_name(name)] = t
    return out


def load_adapter(model, path: str):
    """Load a saved adapter into a freshly wrapped model (before sharding); refuses a mismatch."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    result = set_peft_model_state_dict(model, load_file(os.path.join(path, "adapter_model.safetensors")))
    missing = [k for k in result.missing_keys if is_adapter(k)]
    if missing or result.unexpected_keys:
        raise ValueError(f"the adapter in {path} does not fit the model (missing {missing[:2]}, unexpected "
                         f"{list(result.unexpected_keys)[:2]})")
