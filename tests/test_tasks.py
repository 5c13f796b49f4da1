"""README, "Add your own task": a task is one new file with its `TASK`, and its line in `tasks.TASKS`; no other
file is edited. A task with a string reward is checked, loaded, searched, rewarded and evaluated through its
entry; so is one scored by a model of its own, with an evaluation of its own (a Scorer subclass)."""

import os
import subprocess
import sys

import numpy as np
import pytest

import tasks
from conftest import ROOT, env, metrics
from runtime import checks
from runtime.config import Config
from runtime.errors import ConfigError

# "digit": the last digit of a + b, 16 problems of which 4 are held out; the reward is a constant, so that
# the rows show whose reward scored the responses.
DIGIT = '''"""The last digit of a + b (a test's task)."""
from runtime.errors import ConfigError
from tasks.task import Problem, Task


def load(data):
    if data is not None:
        raise ConfigError("--data: the digit task takes no data folder")
    problems = [Problem(f"{a}+{b}=", str((a + b) % 10)) for a in range(10, 14) for b in range(20, 24)]
    return problems[4:], problems[:4]


TASK = Task(load, reward=lambda completion, answer: 0.25)
'''

# "scored": the same problems, scored by a model of the task's own (a one-output classifier, through
# rewards.RewardModel), and evaluated by its own rows: the model's mean score and the responses' length.
SCORED = '''"""The digit problems scored by a reward model of the task's own (a test's task)."""
import numpy as np

from rewards import RewardModel
from tasks.task import Scorer, Task

MODEL = {model!r}


class ModelScorer(Scorer):
    def __init__(self, engine, task, evaluates):
        super().__init__(engine, task, evaluates)
        with engine.beside():  # a transformers model in a process that runs vLLM
            self.model = RewardModel(MODEL, engine.device, engine.cfg.dtype, engine.tokenizer, non_eos_penalty=False)

    def reward(self, prompts, responses, completions, answers):
        return self.model(prompts, responses)

    def evaluate_part(self, prompts, answers):
        responses, texts = self.engine.respond(prompts)
        rewards = self.reward(prompts, responses, texts, answers)
        return {{"score": list(rewards), "length": [len(r) for r in responses]}}, self.example(prompts, texts, rewards)


def load(data):
    from digit import load as digits
    return digits(data)


TASK = Task(load, scorer=ModelScorer, score="score")
'''


@pytest.fixture
def folder(tmp_path, tiny_rm, monkeypatch):
    """The two task files in a folder on the path, and their lines in tasks.TASKS (removed after the test)."""
    where = tmp_path / "mytasks"
    where.mkdir()
    (where / "digit.py").write_text(DIGIT)
    (where / "scored.py").write_text(SCORED.format(model=tiny_rm))
    monkeypatch.syspath_prepend(str(where))
    monkeypatch.setitem(tasks.TASKS, "digit", "digit")
    monkeypatch.setitem(tasks.TASKS, "scored", "scored")
    return where


def test_the_checks_ask_the_entry(folder, tiny_model, tmp_path):
    check = lambda *args: checks.check(checks.parse(Config, ["--model", tiny_model, "--task", "digit", "--searchers", "0",
                                                            "--out", str(tmp_path / "run"), *args]), 1)
    cfg, data, _ = check("--prompts-per-step", "4", "--samples-per-prompt", "4")
    assert cfg.score == "accuracy" and len(data.prompts) == 12 and data.test_answers == ["0", "1", "2", "3"]
    with pytest.raises(ConfigError, match="^--prompts-per-step: .* the task has 12 training problems$"):
        check("--prompts-per-step", "16")
    with pytest.raises(ConfigError, match="^--data: the digit task takes no data folder$"):
        check("--data", str(tmp_path))
    with pytest.raises(ConfigError, match="^--victim: belongs to the redteam task$"):
        check("--victim", tiny_model)
    with pytest.raises(ConfigError, match=rf"^--task: unknown task 'digits' \(choose from {', '.join(tasks.TASKS)}\)$"):
        checks.check(checks.parse(Config, ["--model", tiny_model, "--task", "digits"]), 1)  # the tasks as they are


def run(task, folder, tiny_model, out, *extra):
    """A synchronous run of `task` (its searching in the trainer's process), with the task's folder on the path
    and its line added to tasks.TASKS in that process."""
    argv = ["tba.py", "--model", tiny_model, "--task", task, "--searchers", "0", "--steps", "2",
            "--prompts-per-step", "4", "--samples-per-prompt", "4", "--max-new-tokens", "4", "--out", str(out), *extra]
    script = (f"import runpy, sys; sys.path[:0] = [{ROOT!r}, {str(folder)!r}]; import tasks\n"
              f"tasks.TASKS.update(digit='digit', scored='scored')\n"
              f"sys.argv = {argv!r}\nrunpy.run_path({os.path.join(ROOT, 'tba.py')!r}, run_name='__main__')\n")
    p = subprocess.run([sys.executable, "-c", script], cwd=out.parent, env=env(out.parent), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:]
    rows = metrics(out)
    return [r for r in rows if r["kind"] == "train"], [r for r in rows if r["kind"] == "eval"]


@pytest.mark.engine
def test_a_run_searches_rewards_and_evaluates_with_the_entry(folder, tiny_model, tmp_path):
    """Every trajectory has the entry's reward, and the evaluation scores the held-out problems with it."""
    train, evals = run("digit", folder, tiny_model, tmp_path / "run")
    assert len(train) == 2 and all(r["reward"] == 0.25 for r in train), train
    assert [r["version"] for r in evals] == [0, 2] and all(r["accuracy"] == 0.25 for r in evals), evals
    assert evals[0]["example"]["prompt"] in {f"{a}+{b}=" for a, b in [(10, 20), (10, 21), (10, 22), (10, 23)]}


@pytest.mark.engine
def test_a_task_scored_by_a_model_of_its_own(folder, tiny_model, tiny_rm, tmp_path):
    """The scored task's model gives every trajectory its reward (recomputed here from the checkpoint's buffer),
    and its evaluation's own rows are the run's: `score` (the headline) and `length`."""
    import torch
    from transformers import AutoTokenizer
    from rewards import RewardModel
    from runtime.checkpoint import load_checkpoint
    out = tmp_path / "run"
    train, evals = run("scored", folder, tiny_model, out, "--save-every", "2")
    assert [r["version"] for r in evals] == [0, 2] and all({"score", "length"} <= r.keys() for r in evals), evals
    assert all(1 <= r["length"] <= 4 for r in evals) and len({r["reward"] for r in train}) == 2, train
    arrays = load_checkpoint(str(out / "checkpoint"))["buffer"]
    ends = np.cumsum(arrays["length"])
    responses = [arrays["response"][e - n:e].tolist() for n, e in zip(arrays["length"], ends)]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    sys.path.insert(0, str(folder))
    from digit import load
    prompts = [tokenizer(p.prompt).input_ids for p in load(None)[0]]
    model = RewardModel(tiny_rm, torch.device("cpu"), "float32", tokenizer, non_eos_penalty=False)
    expected = model([prompts[p] for p in arrays["prompt_id"]], responses)
    assert np.allclose(arrays["reward"], expected, atol=1e-4), (arrays["reward"][:4], expected[:4])
    assert len(set(np.round(expected, 4))) > 1  # the model's scores, not a constant
