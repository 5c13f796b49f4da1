"""Reward functions: plain `reward(completion, answer) -> float`, testable on strings alone.

- `arith_reward`: the toy task (`--task arith`, see `tasks.py`): exact match of the answer.
- `gsm8k_reward`: the paper's GSM8K reward (Sec. 5 of Bartoldson et al., and the authors'
  `gsm8k_utils.py`): 1.0 if the LAST number in the completion, commas removed, equals the
  number after `####` in the data set's answer, compared as floats; else 0.0.
- `RewardModel`: a learned reward (`--reward-model`), the paper's TL;DR reward; `check_reward_model`
  refuses a model that is not one before the run starts.
The searcher calls either kind the same way, once per round: `reward(prompts, responses,
completions, answers) -> list[float]` (a string reward through `batched`).
"""

import re

from runtime.errors import ConfigError
from runtime.hub import load_tokenizer, resolve_model

# The authors' number pattern: decimals, numbers with a leading dot, scientific notation,
# integers; each with an optional sign. `$` and `%` are not part of a number.
NUMBER = re.compile(r"[+-]?\d+\.\d*|[+-]?\.\d+|[+-]?\d+e[-+]?\d+|[+-]?\d+")


def last_number(text: str) -> float | None:
    """The last number in `text` (commas removed) as a float, or None if there is none."""
    numbers = NUMBER.findall(text.replace(",", ""))
    return float(numbers[-1]) if numbers else None


def gsm8k_gold(answer: str) -> float:
    """The gold number of a GSM8K answer field: what follows its `####` marker."""
    if "####" not in answer:
        raise ValueError(f"GSM8K answer has no '####' marker: {answer[-60:]!r}")
    gold = last_number(answer.split("####")[-1])
    if gold is None:
        raise ValueError(f"GSM8K answer has no number after '####': {answer[-60:]!r}")
    return gold


def gsm8k_reward(completion: str, answer: str) -> float:
    """1.0 if the last number of `completion` equals the gold `####` number of `answer`."""
    predicted = last_number(completion)
    return float(predicted is not None and predicted == gsm8k_gold(answer))


def arith_reward(completion: str, answer: str) -> float:
    """1.0 if the completion is exactly `answer` (surrounding whitespace aside), else 0.0."""
    return float(completion.strip() == answer)


# --- the one interface the searcher calls, once per round, for either kind of reward -------------
def batched(reward):
    """A string reward as the searcher calls every reward: on the lists of one round."""
    return lambda prompts, responses, completions, answers: [reward(c, a) for c, a in zip(completions, answers)]


def check_reward_model(name: str, flag: str) -> str:
    """The local folder of a reward model (--FLAG): a sequence classifier with exactly one output, and its
    tokenizer; refused in one line otherwise."""
    from transformers import AutoConfig
    path = resolve_model(name, flag)
    config = AutoConfig.from_pretrained(path)
    kinds = getattr(config, "architectures", None) or []
    if not any(k.endswith("ForSequenceClassification") for k in kinds):
        raise ConfigError(f"--{flag}: {path} is not a sequence classifier (architectures: {', '.join(kinds) or 'none'})")
    if config.num_labels != 1:
        raise ConfigError(f"--{flag}: {path} has {config.num_labels} outputs; a reward model has exactly one")
    load_tokenizer(path, flag)
    return path


class RewardModel:
    """A learned reward: a Hugging Face sequence classifier with one output (`--reward-model`), as
    in the paper's TL;DR runs and the authors' `tba_trainer_tldr.py` (TRL's `get_reward`):
    - the response is cut after its first EOS; with `non_eos_penalty`, a response that never
      produced EOS gets `penalty` (-1) instead of a score;
    - prompt + response are scored in batches, and the score is read at the response's last
      token (the EOS), whatever the padding token is (transformers' own pooling reads the token
      before EOS when pad = EOS, as in many Pythia reward models);
    - the policy's token ids are scored directly when the reward model has the same vocabulary
      (the authors' case: both are Pythia); otherwise the decoded text is tokenized again.
    Build it under `Engine.transformers_models()` in a process that runs vLLM (see searcher.py)."""

    def __init__(self, path: str, device, dtype, policy_tokenizer, non_eos_penalty: bool,
                 batch: int = 64, penalty: float = -1.0):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.torch, self.device, self.batch = torch, torch.device(device), batch
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=getattr(torch, dtype))
        self.model.to(self.device).eval().requires_grad_(False)
        self.tokenizer, self.policy_tokenizer = AutoTokenizer.from_pretrained(path), policy_tokenizer
        self.same_vocab = self.tokenizer.get_vocab() == policy_tokenizer.get_vocab()
        self.eos, self.non_eos_penalty, self.penalty = policy_tokenizer.eos_token_id, non_eos_penalty, penalty
        pad = self.tokenizer.pad_token_id  # in its own tokens, for `score(pooling=True)`
        self.pad = pad if pad is not None else self.tokenizer.eos_token_id

    def __call__(self, prompts, responses, completions=None, answers=None) -> list[float]:
        """Rewards of (prompt ids, response ids) pairs in the policy's tokens."""
        cut = [list(r[:list(r).index(self.eos) + 1]) if self.eos in list(r) else list(r) for r in responses]
        scores = self.score([list(p) + r for p, r in zip(prompts, cut)])
        return [s if self.eos in r or not self.non_eos_penalty else self.penalty for s, r in zip(scores, cut)]

    def score(self, sequences: list[list[int]], pooling: bool = False) -> list[float]:
        """The model's output at the last token of each sequence (policy token ids). `pooling`: where
        transformers' sequence-classification pooling reads it instead, the last token that is not
        padding, with pad = EOS where the tokenizer has no pad token (as the authors' eval_tldr/
        load_and_eval.py sets it): a response ending in EOS is read at the token before
        (transformers/models/gpt_neox/modeling_gpt_neox.py:513-526, transformers/modeling_layers.py:160-173)."""
        if not self.same_vocab:  # another tokenizer: score the text, with its own EOS where there was one
            ends = [s[-1:] == [self.eos] for s in sequences]
            texts = self.policy_tokenizer.batch_decode(sequences, skip_special_tokens=True)
            sequences = [self.tokenizer(t).input_ids + ([self.tokenizer.eos_token_id] if e else [])
                         for t, e in zip(texts, ends)]
        torch, out = self.torch, []
        with torch.no_grad():
            for i in range(0, len(sequences), self.batch):
                part = sequences[i:i + self.batch]
                T = max(len(s) for s in part)
                ids = torch.tensor([s + [0] * (T - len(s)) for s in part], device=self.device)          # (n, T)
                mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in part], device=self.device)
                hidden = self.model.base_model(input_ids=ids, attention_mask=mask,  # no KV cache for one pass
                                               use_cache=False).last_hidden_state                   # (n, T, H)
                last = torch.tensor([last_token(s, self.pad if pooling else None) for s in part], device=self.device)
                out += self.model.score(hidden[torch.arange(len(part)), last]).squeeze(-1).float().tolist()
        return out


def last_token(sequence: list[int], pad: int | None) -> int:
    """The index read as a sequence's score: its last token, or with `pad` the last token that is not
    `pad` (transformers' argmax of index x (token != pad): 0 when every token is padding)."""
    if pad is None:
        return len(sequence) - 1
    return max((i for i, t in enumerate(sequence) if t != pad), default=0)
