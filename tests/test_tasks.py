"""README, "Add your own task" (docs/experiments.md): a task is one new file with its `TASK`; no other file is edited
(the tests' own tasks live outside tasks/, so their lines are added to `tasks.TASKS` in their process). A task with a string reward is checked, loaded, searched, rewarded and evaluated through its
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


def test_countdown_rewards_a_right_expression_and_the_format_and_its_metric_only_the_right_one():
    from tasks.countdown import countdown_correct, countdown_reward, demos, splits
    assert countdown_reward("2*7+11", "7,2,11>25") == countdown_correct(" 11+2*7 ", "7,2,11>25") == 1.0
    assert countdown_reward("2*7-11", "7,2,11>25") == 0.1 and countdown_correct("2*7-11", "7,2,11>25") == 0.0
    assert countdown_reward("2*7", "7,2,11>25") == countdown_reward("2*7+12", "7,2,11>25") == 0.0  # not its numbers
    assert countdown_reward("__import__('os')", "7,2,11>25") == 0.0  # only digits and + - * are evaluated
    train, test = splits()
    assert len(test) == 400 and not {p.prompt for p in train} & {p.prompt for p in test}
    assert all(countdown_correct(d.answer, a.answer) == 1.0 for d, a in zip(demos(), train))  # each demo solves it


def test_a_tasks_defaults_give_way_to_the_command_line(tiny_model, tmp_path):
    """countdown's --max-new-tokens 12 where the line does not give the flag; the line's value where it does, the
    global default 8 included (compared with the default, it would have been taken for not given)."""
    check = lambda *args: checks.check(checks.parse(Config, ["--model", tiny_model, "--task", "countdown", "--searchers",
                                                             "0", "--out", str(tmp_path / "run"), *args]), 1)[0]
    assert check().max_new_tokens == 12
    assert check("--max-new-tokens", "8").max_new_tokens == check("--max-new-tokens=8").max_new_tokens == 8
    assert checks.parse(Config, ["--no-importance-weights", "--lr=1", "--task", "x"]).given == ("importance_weights", "lr", "task")


@pytest.mark.parametrize("flag", [f.name for f in __import__("dataclasses").fields(Config) if f.metadata.get("choices")])
def test_every_flag_with_a_fixed_set_of_values_refuses_others(flag, tiny_model):
    """One rule for every flag with choices (a new one is covered without editing this test): a typo such as
    --math-grader sympy or --math-prompt Authors was taken before as the default, silently."""
    name = "--" + flag.replace("_", "-")
    with pytest.raises(ConfigError, match=rf"^{name}: unknown 'Bogus' \(choose from "):
        checks.check(checks.parse(Config, ["--model", tiny_model, name, "Bogus"]), 1)


def test_the_flags_fixed_on_resume_are_those_declared_so():
    from runtime.checkpoint import fixed_on_resume
    fixed = fixed_on_resume()
    assert {"task", "model", "temperature", "math_grader", "math_prompt", "buffer_capacity"} <= set(fixed)
    assert "lr" not in fixed and "steps" not in fixed


def test_help_lists_the_tasks_and_losses_as_they_are():
    from loss import LOSSES
    text = checks.parser(Config).format_help()
    assert all(name in text for name in [*tasks.TASKS, *LOSSES]) and "{tasks}" not in text and "{losses}" not in text


@pytest.mark.engine
def test_responses_cut_at_the_length_limit_are_counted(tiny_model, tmp_path):
    """A response of one token (--max-new-tokens 1) ends before its end almost always: every train row says how many
    were cut, and so does the console."""
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tba.py"), "--model", tiny_model, "--task", "countdown",
                        "--searchers", "0", "--steps", "2", "--prompts-per-step", "4", "--samples-per-prompt", "4",
                        "--max-new-tokens", "1", "--eval-every", "0", "--out", str(out)], cwd=tmp_path,
                       env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:]
    train = [r for r in metrics(out) if r["kind"] == "train"]
    assert all(r["truncated"] > 0.5 for r in train), [r["truncated"] for r in train]
    assert "cut " in p.stdout  # the console line says it


# --- a file of tasks/ that makes no task (issue 58, items 7 and 15) -------------------------------------------------
BROKEN = {  # name: (the file, the line its use says after "--task: FILE ")
    "unclosed": ("from tasks.task import Task\nTASK = Task(load=(\n", "does not import (SyntaxError: '(' was never "
                 "closed, line 2)"),
    "needs": ("import numpy\nimport no_such_package\n", "does not import (ModuleNotFoundError: No module named "
              "'no_such_package', line 2)"),
    "divides": ("from tasks.task import Task\nTASK = Task(load=1 / 0)\n", "does not import (ZeroDivisionError: "
                "division by zero, line 2)"),
    "helper": ("SHARED = 1  # a module the tasks import\n", "holds no `TASK = Task(...)` (tasks/task.py says what a "
               "task is)"),
}


@pytest.fixture
def beside(tmp_path, monkeypatch):
    """A second folder of the tasks package (as a file of tasks/ would be), holding BROKEN's files, a copy of arith
    beside a package folder of its name (`shadowed/__init__.py`) and one beside a folder without one (`plain/`)."""
    where = tmp_path / "tasks"
    where.mkdir()
    for name, (code, _) in BROKEN.items():
        (where / f"{name}.py").write_text(code)
    for name in ("shadowed", "plain"):
        (where / f"{name}.py").write_text("from tasks.arith import TASK\n")
        (where / name).mkdir()
    (where / "shadowed" / "__init__.py").write_text("TASK = None\n")
    monkeypatch.setattr(tasks, "__path__", [*tasks.__path__, str(where)])
    for name in [*BROKEN, "shadowed", "plain"]:
        monkeypatch.setitem(tasks.TASKS, name, f"tasks.{name}")
    yield where
    for name in [*BROKEN, "shadowed", "plain"]:
        sys.modules.pop(f"tasks.{name}", None)


@pytest.mark.parametrize("name", [*BROKEN, "shadowed"])
def test_a_file_that_makes_no_task_is_named_in_one_line_when_used(name, beside, tiny_model, tmp_path):
    """`--task NAME` of a file that does not import (a syntax error, a missing import, an error at its top), holds no
    TASK, or is shadowed by a package folder of its name, is refused in one line naming the file; before, each
    ended every run, whatever --task, in a traceback (the checks import every task), and a folder tasks/NAME/ with
    an __init__.py silently took the place of tasks/NAME.py."""
    file = str(beside / f"{name}.py")
    line = (f"--task: {beside / name}/ shadows {file} (Python imports a folder holding __init__.py before a file of "
            f"its name): rename or remove one") if name == "shadowed" else f"--task: {file} {BROKEN[name][1]}"
    with pytest.raises(ConfigError) as e:
        checks.check(checks.parse(Config, ["--model", tiny_model, "--task", name, "--out", str(tmp_path / "run")]), 1)
    assert str(e.value) == line


def test_a_broken_task_file_leaves_the_other_tasks_alone(beside, tiny_model, tmp_path):
    """Beside the broken files, arith checks as ever; a folder without __init__.py beside a task's file (data, say)
    shadows nothing; names() lists the tasks that load."""
    cfg, _, _ = checks.check(checks.parse(Config, ["--model", tiny_model, "--out", str(tmp_path / "run")]), 1)
    assert cfg.task == "arith"
    assert tasks.get("plain") is tasks.get("arith")
    assert "plain" in tasks.names() and not {*BROKEN, "shadowed"} & set(tasks.names())


def test_a_task_file_that_waits_at_import_holds_no_other_run(beside, tiny_model, tmp_path):
    """Issue 67 item 11: a file of tasks/ that waits at its top (a download) made --help and every run silent,
    whatever --task: discovery imported every task. --help lists the files without importing any; a run of another
    task imports its own alone (others only for a flag of the tasks' section it does not own, each within a
    deadline)."""
    import time
    (beside / "waits.py").write_text("import time\ntime.sleep(600)\n")
    tasks.TASKS["waits"] = "tasks.waits"
    try:
        help = " ".join(checks.parser(Config).format_help().split())
        assert "waits" in help and "unclosed" in help and "tasks.waits" not in sys.modules, help
        cfg, _, _ = checks.check(checks.parse(Config, ["--steps", "5", "--out", str(tmp_path / "run")]), 1)
        assert cfg.task == "arith" and "tasks.waits" not in sys.modules
        t0 = time.time()
        assert "waits" not in tasks.names(deadline=0.5) and "arith" in tasks.names(deadline=0.5)
        assert time.time() - t0 < 30
        with pytest.raises(ConfigError, match=r"^--task: .*waits.py does not import within 0.5 s \(it waits at its top"):
            tasks.get("waits", 0.5)
    finally:
        del tasks.TASKS["waits"]


def test_the_tiny_models_builder_names_a_broken_task_file(beside):
    """`python -m runtime.tiny --task NAME` of a file that does not import says why, as --task does."""
    from runtime import tiny
    with pytest.raises(SystemExit) as e:
        tiny.main(["--task", "needs"])
    assert e.value.code == f"runtime.tiny: --task: {beside / 'needs'}.py {BROKEN['needs'][1]}"


def test_the_tasks_page_has_a_row_for_every_task_the_readme_names():
    """docs/tasks.md's table has a row for each task the README's "Tasks" names (countdown was missing); a task a
    researcher adds needs neither (docs/experiments.md: no page edited)."""
    import re
    from test_readme import section
    named = set(re.findall(r"`(\w+)`", section("Tasks"))) & set(tasks.TASKS)
    page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "tasks.md")).read()
    rows = {line.split("|")[1].split("`")[1] for line in page.splitlines() if line.startswith("| `")}
    assert len(named) >= 6 and named <= rows, named - rows


def test_a_hub_loader_names_each_problem_by_split_and_row(monkeypatch):
    """tasks.task.load_splits without --data: each split of the hub's data set, each problem named by its split and
    row (a refusal says where), and the files --data would take said to hub_dataset (its refusal names them)."""
    import tasks.task
    from tasks.task import Problem
    asked = []
    rows = {"train": [{"q": "1"}, {"q": "2"}], "test": [{"q": "3"}]}
    monkeypatch.setattr(tasks.task, "hub_dataset", lambda name, config, files: asked.append((name, config, files))
                        or rows)
    load = tasks.task.load_splits("owner/set", "main", ("train", "test"), lambda row, where: Problem(row["q"], where))
    train, test = load(None)
    assert asked == [("owner/set", "main", "train.jsonl and test.jsonl")]
    assert [(p.prompt, p.answer) for p in train + test] == [
        ("1", "owner/set train row 0"), ("2", "owner/set train row 1"), ("3", "owner/set test row 0")]
