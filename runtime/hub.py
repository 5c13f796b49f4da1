"""Where the models come from: a model flag's value (an alias, a local folder or a Hugging Face hub id)
as a local folder, and the tokenizer saved beside it; each refusal one line naming the flag. The `tiny`
model is built by tiny.py (runtime/checks.py asks it for --model tiny).
"""

import functools
import hashlib
import json
import os
import struct

from runtime.errors import ConfigError

ALIASES = {"rho-math-1b": "realtreetune/rho-1b-sft-GSM8K"}
# what transformers and vLLM load a model's weights from
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def resolve_model(name: str, flag: str = "model") -> str:
    """The local folder of the model --FLAG names (a folder, or a hub id: `gpt2` too), from the Hugging Face
    cache first, else fetched; refused in one line unless it holds a config and weights."""
    name, why = ALIASES.get(name, name), ""
    if os.path.isdir(name):
        path = name
    elif os.path.exists(name):
        raise ConfigError(f"--{flag}: {name} is a file, not a model folder (a folder with config.json and weights)")
    else:
        from huggingface_hub.utils import HFValidationError, validate_repo_id
        try:
            validate_repo_id(name)  # the hub's own rule for a model id
        except HFValidationError:
            known = "'tiny', an alias" if flag == "model" else "an alias"
            raise ConfigError(f"--{flag}: {name!r} does not exist (not {known}, a folder or a hub id)") from None
        path, why = from_hub(name, flag), "; only safetensors weights are fetched from the hub"
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"--{flag}: {path} holds no model (no config.json)")
    check_weights(path, flag, why)
    return path


def from_hub(name: str, flag: str) -> str:
    """The hub model's folder in the local cache (HF_HUB_CACHE / HF_HOME), fetched first if it is not there."""
    from huggingface_hub import snapshot_download
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]
    try:
        return snapshot_download(name, allow_patterns=patterns, local_files_only=True)
    except Exception:
        try:
            return snapshot_download(name, allow_patterns=patterns)
        except Exception as e:
            raise ConfigError(f"--{flag}: {name!r} is not a local folder and could not be fetched from the "
                              f"Hugging Face hub ({type(e).__name__})") from None


def digest(path: str) -> str:
    """A file's SHA-256, read in chunks: about a second a GB (a checkpoint's weights, read back)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_weights(path: str, flag: str = "model", why: str = ""):
    """Refuse a model folder without weights, or whose safetensors files are truncated or damaged, in one line
    before anything starts (transformers and vLLM would fail in every process, with tracebacks); `why`: a
    guess at the cause, said after the files looked for."""
    if not any(os.path.isfile(os.path.join(path, w)) for w in WEIGHTS):
        raise ConfigError(f"--{flag}: {path} holds no weights (none of {', '.join(WEIGHTS)}{why})")
    try:  # sharded: every shard its index names
        files = [f for f in weight_files(path) if f.endswith(".safetensors")]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ConfigError(f"--{flag}: {path}'s weight index does not parse (a weight_map of tensor names to "
                          f"files){why}") from None
    for name in files:
        damage = safetensors_damage(name)
        if damage:
            raise ConfigError(f"--{flag}: {name} {damage}: it would not load{why}")


def safetensors_damage(path: str) -> str | None:
    """What makes a .safetensors file unloadable, read from its header alone, or None: 8 bytes (the header's
    length, little-endian), a JSON header of each tensor's byte range in the data after it, and the data,
    which the ranges must tile exactly (as safetensors checks). Plain json and struct: nothing runs."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if n is None or n > size - 8:
                return f"is truncated ({size} bytes: its header does not fit)"
            header = json.loads(f.read(n))
    except FileNotFoundError:
        return "is missing"
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        return f"has a damaged header ({getattr(e, 'strerror', None) or type(e).__name__})"
    if not isinstance(header, dict):
        return "has a damaged header (not a JSON object)"
    ranges = []
    for name, tensor in header.items():
        offsets = tensor.get("data_offsets") if isinstance(tensor, dict) and name != "__metadata__" else [0, 0]
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            return f"has a damaged header (tensor {name!r} has no byte range)"
        ranges.append(offsets)
    data, end = size - 8 - n, 0
    for begin, stop in sorted(ranges):
        if begin != end and stop > begin:
            return "has a damaged header (its tensors' byte ranges overlap or leave gaps)"
        end = max(end, stop)
    if end > data:
        return f"is truncated (its tensors end at byte {end} of the data, which holds {data})"
    if end < data:
        return f"is damaged ({data - end} bytes after its tensors' data)"
    return None


def weight_files(path: str) -> list[str]:
    """The files transformers loads a model folder's weights from (safetensors first): one, or an index's shards."""
    for single, index in zip(WEIGHTS[::2], WEIGHTS[1::2]):
        if os.path.isfile(os.path.join(path, single)):
            return [os.path.join(path, single)]
        if os.path.isfile(os.path.join(path, index)):
            with open(os.path.join(path, index)) as f:
                return [os.path.join(path, shard) for shard in sorted(set(json.load(f)["weight_map"].values()))]
    return []


@functools.lru_cache(maxsize=8)
def load_tokenizer(path: str, flag: str = "model"):
    """The tokenizer saved beside the model, or a one-line refusal naming what is missing; loaded once a
    process (the checks and the trainer ask for it: a tokenizer of a real model takes a second or more)."""
    from transformers import AutoTokenizer
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.isfile(os.path.join(path, f)) for f in files):
        raise ConfigError(f"--{flag}: {path} has no tokenizer (none of {', '.join(files)}); save the model's "
                          f"tokenizer beside it (tokenizer.save_pretrained)")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ConfigError(f"--{flag}: the tokenizer in {path} does not load ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:160]})") from None
