"""Reward functions: plain `reward(completion, answer) -> float`, testable on strings alone.

- `arith_reward`: the toy task (`--task arith`, see `tasks.py`): exact match of the answer.
- `gsm8k_reward`: the paper's GSM8K reward (Sec. 5 of Bartoldson et al., and the authors'
  `gsm8k_utils.py`): 1.0 if the LAST number in the completion, commas removed, equals the
  number after `####` in the data set's answer, compared as floats; else 0.0.
"""

import re

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


REWARDS = {"arith": arith_reward, "gsm8k": gsm8k_reward}
