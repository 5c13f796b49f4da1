"""`gsm8k`, the paper's headline task: the original release's `train.jsonl` (searching) and `test.jsonl`
(evaluation) from `--data DIR` (fields `question`, `answer`), or `openai/gsm8k` (config `main`) from the
Hugging Face hub when no `--data` is given. The prompt is exactly the authors'; the reward is the
paper's (`rewards.gsm8k_reward`: the last number of the completion equals the `####` number).
"""

from rewards import gsm8k_gold, gsm8k_reward
from runtime.errors import ConfigError
from tasks.task import Problem, Task, load_splits, text_fields

PROMPT = "[MATH TASK] Problem:\n{question}\n\nSolution:\n"


def problem(row: dict, where: str) -> Problem:
    text_fields(row, where, "question", "answer")
    try:
        gsm8k_gold(row["answer"])
    except ValueError as e:
        raise ConfigError(f"--data: {where}: {e}") from None
    return Problem(prompt=PROMPT.format(question=row["question"]), answer=row["answer"])


TASK = Task(load_splits("openai/gsm8k", "main", ("train", "test"), problem), gsm8k_reward)
