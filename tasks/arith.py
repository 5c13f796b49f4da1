"""`arith`, the toy task (no download): two-digit addition answered most significant digit first, e.g. prompt
"47+85=" and answer "132"; the reward (`rewards.arith_reward`) is an exact match. Of the 8,100 problems, 400
are held out for evaluation and never searched on. The `tiny` model is warm-started on it (runtime/tiny.py).
"""

import random

from rewards import arith_reward
from runtime.errors import ConfigError
from tasks.task import Problem, Task

TEST = 400  # held-out problems (of the 8,100); the other 7,700 are for training


def splits() -> tuple[list[Problem], list[Problem]]:
    problems = [Problem(prompt=f"{a}+{b}=", answer=str(a + b)) for a in range(10, 100) for b in range(10, 100)]
    random.Random(1234).shuffle(problems)
    return problems[TEST:], problems[:TEST]


def load(data: str | None) -> tuple[list[Problem], list[Problem]]:
    if data is not None:
        raise ConfigError("--data: the arith task is generated in code and takes no data folder")
    return splits()


TASK = Task(load, arith_reward)
