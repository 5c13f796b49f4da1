"""README, "Add your own task": a task added to `tasks.TASKS` alone, no other file edited, is checked,
loaded, searched, rewarded and evaluated through its entry."""

import os
import subprocess
import sys

import pytest

from runtime import config
import tasks
from conftest import ROOT, env, metrics

# "digit": the last digit of a + b, 16 problems of which 4 are held out; the reward is a constant, so that
# the rows show whose reward scored the responses. The run below defines the same entry in its own process.
DIGIT = '''
def load_digit(data):
    if data is not None:
        raise tasks.ConfigError("--data: the digit task takes no data folder")
    problems = [tasks.Problem(f"{a}+{b}=", str((a + b) % 10)) for a in range(10, 14) for b in range(20, 24)]
    return problems[4:], problems[:4]

tasks.TASKS["digit"] = tasks.Task(load_digit, reward=lambda completion, answer: 0.25)
'''


@pytest.fixture
def digit(monkeypatch):
    scope = {"tasks": tasks}
    exec(DIGIT, scope)
    monkeypatch.setitem(tasks.TASKS, "digit", tasks.TASKS.pop("digit"))  # removed again after the test
    return scope["load_digit"]


def test_the_checks_ask_the_entry(digit, tiny_model, tmp_path):
    check = lambda *args: config.check(config.parse(["--model", tiny_model, "--task", "digit", "--searchers", "0",
                                                     "--out", str(tmp_path / "run"), *args]), 1)
    cfg, data, _ = check("--prompts-per-step", "4", "--samples-per-prompt", "4")
    assert cfg.score == "accuracy" and len(data.prompts) == 12 and data.test_answers == ["0", "1", "2", "3"]
    with pytest.raises(config.ConfigError, match="^--prompts-per-step: .* the task has 12 training problems$"):
        check("--prompts-per-step", "16")
    with pytest.raises(config.ConfigError, match="^--data: the digit task takes no data folder$"):
        check("--data", str(tmp_path))
    with pytest.raises(config.ConfigError, match="^--victim: belongs to the redteam task$"):
        check("--victim", tiny_model)
    with pytest.raises(config.ConfigError, match=r"^--task: unknown task 'digits' \(choose from arith, gsm8k, tldr, "
                                                 r"redteam, digit\)$"):
        config.check(config.parse(["--model", tiny_model, "--task", "digits"]), 1)


def test_a_run_searches_rewards_and_evaluates_with_the_entry(tiny_model, tmp_path):
    """The synchronous run (its searching in the trainer's process, which registered the task): every
    trajectory has the entry's reward, and the evaluation scores the held-out problems with it."""
    out = tmp_path / "run"
    argv = ["tba.py", "--model", tiny_model, "--task", "digit", "--searchers", "0", "--steps", "2",
            "--prompts-per-step", "4", "--samples-per-prompt", "4", "--max-new-tokens", "4", "--out", str(out)]
    script = (f"import runpy, sys; sys.path.insert(0, {ROOT!r}); import tasks\n{DIGIT}\n"
              f"sys.argv = {argv!r}\nrunpy.run_path({os.path.join(ROOT, 'tba.py')!r}, run_name='__main__')\n")
    p = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env(tmp_path), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:]
    rows = metrics(out)
    train, evals = [r for r in rows if r["kind"] == "train"], [r for r in rows if r["kind"] == "eval"]
    assert len(train) == 2 and all(r["reward"] == 0.25 for r in train), train
    assert [r["version"] for r in evals] == [0, 2] and all(r["accuracy"] == 0.25 for r in evals), evals
    assert evals[0]["example"]["prompt"] in {f"{a}+{b}=" for a, b in [(10, 20), (10, 21), (10, 22), (10, 23)]}
