"""`countdown`, a second toy task (no download), after TinyZero's: three numbers and a target, the response an
arithmetic expression that uses each number once and equals the target, e.g. prompt "7,2,11>25=" and response
"2*7+11". Many responses are right, so the held-out metric (`countdown_correct`: 1 if right, else 0) is not a
match to the answer field, which holds one solution; the training reward gives 0.1 for a well-formed
expression of the given numbers that misses the target (TinyZero's format reward), so that a warm-started
model that rarely hits gets a signal. Numbers 1-12: a response needs up to 9 tokens with its end, so the task
sets --max-new-tokens 12 (the default 8 would cut some). `demos()`: the solutions.
"""

import itertools
import random
import re

from runtime.errors import ConfigError
from tasks.task import Problem, Task

TEST = 400  # held-out problems, never searched on
EXPRESSION = re.compile(r"^\d+[-+*]\d+[-+*]\d+$")  # three numbers, two operations: what a response must be


def problems() -> list[tuple[str, str]]:
    """Every (prompt, one solution) with three distinct numbers of 1-12 and a target of 1-99 (one solution a
    prompt, the first found), in a fixed random order; the numbers in the prompt in a random order too."""
    rng, seen, out = random.Random(4321), set(), []
    for numbers in itertools.permutations(range(1, 13), 3):
        for ops in itertools.product("+-*", repeat=2):
            expression = f"{numbers[0]}{ops[0]}{numbers[1]}{ops[1]}{numbers[2]}"
            target = eval(expression)  # digits and + - * only, made here
            key = (tuple(sorted(numbers)), target)
            if 1 <= target <= 99 and key not in seen:
                seen.add(key)
                shown = list(numbers)
                rng.shuffle(shown)
                out.append((f"{','.join(map(str, shown))}>{target}=", expression))
    rng.shuffle(out)
    return out


def splits() -> tuple[list[Problem], list[Problem]]:
    """(train, held out): the answer field is the prompt's numbers and target, "7,2,11>25", which the reward
    checks a response against (any right expression scores, not only the demo's)."""
    made = [Problem(prompt, prompt[:-1]) for prompt, _ in problems()]
    return made[TEST:], made[:TEST]


def load(data: str | None):
    if data is not None:
        raise ConfigError("--data: the countdown task is generated in code and takes no data folder")
    return splits()


def demos() -> list[Problem]:
    """The training problems with a solution each (Problem.answer: the response to imitate), for a warm start."""
    return [Problem(prompt, solution) for prompt, solution in problems()[TEST:]]


def value(completion: str, answer: str) -> float | None:
    """The value of a well-formed response that uses exactly the answer's numbers (None for any other)."""
    text = completion.strip()
    numbers, _ = answer.split(">")
    if not EXPRESSION.match(text) or sorted(re.findall(r"\d+", text)) != sorted(numbers.split(",")):
        return None
    return eval(text)  # matched EXPRESSION: digits and + - * only


def countdown_correct(completion: str, answer: str) -> float:
    """The held-out metric: 1.0 if the response uses each number once and equals the target, else 0.0."""
    got = value(completion, answer)
    return float(got is not None and got == int(answer.split(">")[1]))


def countdown_reward(completion: str, answer: str) -> float:
    """The training reward: 1.0 if right, 0.1 for a well-formed expression of the numbers that misses
    (TinyZero's format reward), else 0.0."""
    got = value(completion, answer)
    return 0.0 if got is None else 1.0 if got == int(answer.split(">")[1]) else 0.1


TASK = Task(load, countdown_reward, metric=countdown_correct, defaults={"max_new_tokens": 12}, demos=demos)
