"""Tasks: the problems to search on and to evaluate, as (prompt, answer) pairs.

- `arith` (the toy task, no download): two-digit addition answered most significant digit first,
  e.g. prompt "47+85=" and answer "132"; the reward (`rewards.arith_reward`) is an exact match.
  Of the 8,100 problems, 400 are held out for evaluation and never searched on.
- `gsm8k` (the paper's headline task): the original release's `train.jsonl` (searching) and
  `test.jsonl` (evaluation) from `--data DIR`, or `openai/gsm8k` (config `main`) from the
  Hugging Face hub when no `--data` is given. Prompt exactly as the authors':
  "[MATH TASK] Problem:\\n{question}\\n\\nSolution:\\n".

Bad data raises `ConfigError` with a one-line message; `tba.py` prints it and exits with 2.
"""

import json
import os
import random
from dataclasses import dataclass

from rewards import REWARDS, gsm8k_gold


class ConfigError(ValueError):
    """Bad input (a flag, a path, a data file): reported in one line, exit status 2."""


@dataclass
class Problem:
    prompt: str  # what the model is given
    answer: str  # what the reward compares against (GSM8K: the data set's whole answer field)


# --- arith: the toy task -------------------------------------------------------------------
ARITH_TEST = 400  # held-out problems (of the 8,100); the other 7,700 are for training


def arith_splits() -> tuple[list[Problem], list[Problem]]:
    problems = [Problem(prompt=f"{a}+{b}=", answer=str(a + b))
                for a in range(10, 100) for b in range(10, 100)]
    random.Random(1234).shuffle(problems)
    return problems[ARITH_TEST:], problems[:ARITH_TEST]


# --- gsm8k ----------------------------------------------------------------------------------
GSM8K_PROMPT = "[MATH TASK] Problem:\n{question}\n\nSolution:\n"


def gsm8k_problem(row: dict, where: str) -> Problem:
    for field in ("question", "answer"):
        if not isinstance(row.get(field), str):
            raise ConfigError(f"--data: {where}: missing or non-text field {field!r}")
    try:
        gsm8k_gold(row["answer"])
    except ValueError as e:
        raise ConfigError(f"--data: {where}: {e}") from None
    return Problem(prompt=GSM8K_PROMPT.format(question=row["question"]), answer=row["answer"])


def read_jsonl(path: str) -> list[Problem]:
    if not os.path.isfile(path):
        raise ConfigError(f"--data: {path} does not exist")
    problems = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise ConfigError(f"--data: {path} line {line_no}: not valid JSON") from None
            if not isinstance(row, dict):
                raise ConfigError(f"--data: {path} line {line_no}: not a JSON object")
            problems.append(gsm8k_problem(row, f"{path} line {line_no}"))
    if not problems:
        raise ConfigError(f"--data: {path} holds no problems")
    return problems


def gsm8k_from_hub() -> tuple[list[Problem], list[Problem]]:
    try:
        from datasets import load_dataset  # optional: only this path needs it
    except ImportError:
        raise ConfigError("--data: no folder given and the 'datasets' package is not installed; "
                          "pass --data DIR holding GSM8K's train.jsonl and test.jsonl") from None
    try:
        ds = load_dataset("openai/gsm8k", "main")
    except Exception as e:  # no network, no hub: one line, naming the flag to use instead
        raise ConfigError(f"--data: could not load openai/gsm8k from the Hugging Face hub "
                          f"({type(e).__name__}); pass --data DIR holding train.jsonl and test.jsonl") from None
    return ([gsm8k_problem(r, f"openai/gsm8k train row {i}") for i, r in enumerate(ds["train"])],
            [gsm8k_problem(r, f"openai/gsm8k test row {i}") for i, r in enumerate(ds["test"])])


def load_task(task: str, data: str | None) -> tuple[list[Problem], list[Problem]]:
    """(train, test) problems of `task`. Raises ConfigError on bad input."""
    if task not in REWARDS:
        raise ConfigError(f"--task: unknown task {task!r} (choose from {', '.join(REWARDS)})")
    if task == "arith":
        if data is not None:
            raise ConfigError("--data: the arith task is generated in code and takes no data folder")
        return arith_splits()
    if data is None:
        return gsm8k_from_hub()
    if not os.path.isdir(data):
        raise ConfigError(f"--data: {data} is not a folder")
    return read_jsonl(os.path.join(data, "train.jsonl")), read_jsonl(os.path.join(data, "test.jsonl"))
