"""Where the models come from: a model flag's value (an alias, a local folder or a Hugging Face hub id)
as a local folder, and the tokenizer saved beside it; each refusal one line naming the flag. The `tiny`
model is built by tiny.py (config.py asks it for --model tiny).
"""

import os
import re

from runtime.errors import ConfigError

ALIASES = {"rho-math-1b": "realtreetune/rho-1b-sft-GSM8K"}


def resolve_model(name: str, flag: str = "model") -> str:
    """A local folder holding the model named by --FLAG (fetching it from the hub if needed)."""
    name = ALIASES.get(name, name)
    if os.path.isdir(name):
        path = name
    elif re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", name) and not name.startswith("."):
        from huggingface_hub import snapshot_download
        patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]
        try:
            path = snapshot_download(name, allow_patterns=patterns, local_files_only=True)
        except Exception:
            try:
                path = snapshot_download(name, allow_patterns=patterns)
            except Exception as e:
                raise ConfigError(f"--{flag}: {name!r} is not a local folder and could not be fetched from the "
                                  f"Hugging Face hub ({type(e).__name__})") from None
    else:
        known = "'tiny', an alias" if flag == "model" else "an alias"
        raise ConfigError(f"--{flag}: {name!r} does not exist (not {known}, a folder or a hub id)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"--{flag}: {path} holds no model (no config.json)")
    return path


def load_tokenizer(path: str, flag: str = "model"):
    """The tokenizer saved beside the model, or a one-line refusal naming what is missing."""
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
