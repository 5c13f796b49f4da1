"""`math`: MATH (Hendrycks et al., 2021), the paper's Sec. 6 run with Qwen 2.5 7B, TBA′ against Dr. GRPO
(run_math.sh), as in the authors' code for it (bbartoldson/tba-prime, a fork of prime-rl).

Data: `--data DIR` with `train.jsonl` (searching) and `test.jsonl` (the evaluation: MATH-500 in the paper,
or any other set in either format), one JSON object a line in either of two formats, told apart line by line:
- genesys (justus27/math-hendrycks-genesys-format and PrimeIntellect/MATH-500 on the hub): `prompt`, the
  problem, and `verification_info`, a JSON string or object whose `ground_truth` is the answer, plain or in a
  \\boxed{} (the authors read them so: their infer.py:271-273, genesys/math.py:24-36);
- MATH's own (MATH-500's release, {problem, solution, answer}): `problem`, and `answer`, or else the last
  \\boxed{} of `solution`.
Without --data: the train split of justus27/math-hendrycks-genesys-format (their infer.py:90 reads a local copy
of it) and the one split ("train") of PrimeIntellect/MATH-500 (their eval/registry.py:8, 23). A training
problem that is also a held-out one is dropped, so that the evaluation never scores a problem searched on.

The prompt: the problem and the authors' instruction (their inference/utils.py:180-193) as the user's turn of
the model's chat template, the assistant's turn begun (`chat`). Their f-string makes `\\boxed{12}` into
`\\boxed12` (Python reads {12} as an expression); the braces stay here, as meant (docs/departures.md).
The reward: rewards.math_reward, their grading. The evaluation: the accuracy of one response to each held-out
problem (the default Scorer; run_math.sh samples it at the training temperature, or greedily).
"""

import importlib
import json
import os

from rewards import last_boxed, math_reward
from runtime.errors import ConfigError
from tasks.task import Problem, Task, folder, hub_dataset, read_jsonl, text_fields

INSTRUCTION = " Place your answer at end exactly inside latex box for example \\boxed{12} or \\boxed{51}."
TRAIN_HUB, TEST_HUB = "justus27/math-hendrycks-genesys-format", "PrimeIntellect/MATH-500"


def problem(row: dict, where: str) -> Problem:
    if "verification_info" in row:  # genesys
        text_fields(row, where, "prompt")
        info = row["verification_info"]
        if isinstance(info, str):
            try:
                info = json.loads(info)
            except json.JSONDecodeError:
                raise ConfigError(f"--data: {where}: verification_info is not valid JSON") from None
        answer = info.get("ground_truth") if isinstance(info, dict) else None
        question = row["prompt"]
    elif "problem" in row:  # MATH's own
        text_fields(row, where, "problem")
        answer, question = row.get("answer"), row["problem"]
        if answer is None or answer == "":
            text_fields(row, where, "solution")
            answer = last_boxed(row["solution"])
    else:
        raise ConfigError(f"--data: {where}: neither a genesys row (prompt, verification_info) nor a MATH row "
                          f"(problem, and answer or solution)")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ConfigError(f"--data: {where}: no answer (a string or a number; a solution's last \\boxed{{}})")
    if not question.strip():
        raise ConfigError(f"--data: {where}: empty problem")
    answer = str(answer)
    gold = last_boxed(answer) if "\\boxed" in answer else answer
    if not (gold or "").strip():
        raise ConfigError(f"--data: {where}: empty answer {answer[:60]!r}")
    return Problem(prompt=question + INSTRUCTION, answer=gold)


def load(data: str | None) -> tuple[list[Problem], list[Problem]]:
    if data is None:
        files = "train.jsonl and test.jsonl"
        rows = {name: hub_dataset(name, None, files)["train"] for name in (TRAIN_HUB, TEST_HUB)}
        train, test = ([problem(r, f"{name} train row {i}") for i, r in enumerate(rows[name])] for name in rows)
    else:
        train, test = (read_jsonl(os.path.join(folder(data), f"{split}.jsonl"), problem) for split in ("train", "test"))
    held_out = {p.prompt.strip() for p in test}
    train = [p for p in train if p.prompt.strip() not in held_out]
    if not train:
        raise ConfigError("--data: every training problem is also a held-out one")
    return train, test


def check(cfg) -> dict:
    try:  # the reward's symbolic check imports it in a process of its own: refused here, in one line, if missing
        importlib.import_module("math_verify")
    except ImportError:
        raise ConfigError("--task: the math task grades with math-verify: pip install math-verify==0.9.0") from None
    return {}


TASK = Task(load, math_reward, check=check, chat=True)
