"""What a task is: its problems, its reward and its evaluation, and the loaders the tasks share.

A task is one file of this folder holding `TASK = Task(...)`, named by its file (`tasks.TASKS`; __init__.py
says what happens to one that does not import). The rest of the code asks the entry, never the task's name:
- `load(--data folder or None) -> (train, test)` problems, each `Problem(prompt, answer)`;
- `reward(completion, answer) -> float`, the training reward: a plain string function (rewards.py), or none
  where a model scores the responses (`--reward-model`, or a `Scorer` of the task's own);
- `metric(completion, answer) -> float`: the held-out figure (default: `reward`); the evaluation never scores
  with the training reward, so a reward shaped for training (docs/experiments.md) leaves the held-out figures;
- `defaults`: {flag: value} the task needs (countdown: a longer --max-new-tokens) where the line gives none;
- `demos() -> [Problem(prompt, solution)]`: solved problems, for a warm start of the tiny model on the task;
- `scorer`: the task's work in a searcher's engine, each round and evaluation: `Scorer` below (the string
  reward or `--reward-model`; the accuracy of one response a held-out prompt), or a subclass (tldr, redteam);
- `check(cfg) -> {derived field: value}`: the task's own flags, refused in one line, and what they derive;
- `flags`: the flags that belong to it alone (refused with any other task);
- `memory(cfg, evaluates, engines, beside)`: the GPU memory of the extra engines and models its scorer loads
  beside the policy's and pi_ref (runtime/gpu.memory_needs);
- `buffer(cfg, prompts) -> ReplayBuffer`: its replay buffer (red-teaming's `--buffer-keep best`: a subclass);
- `score`: the evaluation's headline figure; `max_prompt`: longer prompts (in tokens) are dropped; `fill`: the
  training prompts repeated to fill a batch of B; `chat`: each prompt a user turn of the model's chat template
  (runtime/checks.py tokenizes them; a model without one is refused); `prompt(cfg, text)`: a problem's prompt
  as the flags make it (math's instruction, ours or the authors').
Bad data raises ConfigError with a one-line message; tba.py prints it and exits with 2.
"""

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from buffer import ReplayBuffer
from rewards import RewardModel, batched
from runtime.errors import ConfigError


@dataclass
class Problem:
    prompt: str  # what the model is given
    answer: str  # what the reward compares against (GSM8K: the data set's whole answer field)


@dataclass
class Data:
    """A run's problems as it uses them (runtime.checks makes it): token ids of the prompts and the answers
    the reward compares against, for searching (train) and for the evaluation (held out)."""
    prompts: list[list[int]]       # training prompts, searched on
    answers: list[str]             # their answers
    test_prompts: list[list[int]]  # held-out prompts, evaluated on
    test_answers: list[str]        # their answers

    def digest(self, n: int | None = None) -> str:
        """A hash of the first `n` training problems (all): a checkpoint's buffer indexes them by position."""
        rows = [self.prompts[:n], self.answers[:n]]
        return hashlib.sha256(json.dumps(rows, default=str).encode()).hexdigest()[:16]


class Scorer:
    """A task's work inside a searcher's engine (searcher.Engine): the reward of a round's responses, and the
    evaluation. This one scores with the task's string reward (or `--reward-model` in its place) and evaluates
    the accuracy (pass@1) of one response per held-out prompt, greedy or at --eval-temperature. `seconds`: the
    last reward's time by part, for the train rows (red-teaming: the victim's, the classifier's)."""

    def __init__(self, engine, task: "Task", evaluates: bool):
        self.engine, self.cfg, self.seconds = engine, engine.cfg, {}
        if self.cfg.reward_model_path:
            with engine.beside():  # a transformers model beside vLLM (runtime/vllm_env.py)
                self.score = RewardModel(self.cfg.reward_model_path, engine.device, self.cfg.dtype, engine.tokenizer,
                                         self.cfg.non_eos_penalty, batch=self.cfg.score_batch)
        else:
            self.score = batched(task.reward)
        held_out = task.metric or task.reward  # the held-out figure: the task's own string function where it has one
        self.metric = batched(held_out) if held_out else self.score

    def reward(self, prompts, responses, completions, answers) -> list[float]:
        """The rewards of one round: prompt and response token ids, the responses' text, the answers."""
        return self.score(prompts, responses, completions, answers)

    def annotate(self, trajectories, completions):
        """Fill in what the task's buffer needs beyond the reward (red-teaming: the attacks' embeddings)."""

    def loaded(self, named_tensors: list):
        """The engine has loaded new policy weights (TL;DR keeps a transformers copy at them)."""

    def evaluate(self, prompts: list[list[int]], answers: list[str], beat=lambda done: None) -> tuple[dict, dict]:
        """One response to each prompt with the loaded weights: each score's mean, and the first problem's
        example. In parts of a search round's size (256 at least), each followed by beat(prompts done): a long
        evaluation (TL;DR's at 2.8B: about 15 minutes on an A100) is then no silence to the trainer's watch,
        while a part that hangs is."""
        size = max(256, self.cfg.prompts_per_step * self.cfg.search_samples_per_prompt)
        rows, example = {}, None
        for i in range(0, len(prompts), size):
            part, first = self.evaluate_part(prompts[i:i + size], answers[i:i + size])
            for k, v in part.items():
                rows.setdefault(k, []).extend(v)
            example = example or first
            beat(min(i + size, len(prompts)))
        return {k: float(np.mean(v)) for k, v in rows.items()}, example

    def evaluate_part(self, prompts: list[list[int]], answers: list[str]) -> tuple[dict, dict]:
        """evaluate() on some prompts: each score's value for each response (the task's metric, never the
        training reward of `reward`, which a subclass may shape), and the first one's example."""
        responses, texts = self.engine.respond(prompts)
        scores = self.metric(prompts, responses, texts, answers)
        return {self.cfg.score: list(scores)}, self.example(prompts, texts, scores)

    def example(self, prompts, texts, values, name: str | None = None) -> dict:
        """The eval row's `example`: the first problem's prompt, its completion, and that completion's value
        of the score `name` (default: the task's headline score, `Task.score`), under that name."""
        return dict(prompt=self.engine.tokenizer.decode(prompts[0], skip_special_tokens=True), completion=texts[0],
                    **{name or self.cfg.score: float(values[0])})


@dataclass(frozen=True)
class Task:
    """What `--task NAME` is (the module docstring gives each field's contract)."""
    load: Callable
    reward: Callable | None = None
    metric: Callable | None = None
    defaults: dict = field(default_factory=dict)
    demos: Callable | None = None
    scorer: type = Scorer
    score: str = "accuracy"
    check: Callable = lambda cfg: {}
    flags: tuple[str, ...] = ()
    memory: Callable = lambda cfg, evaluates, engines, beside: None  # no models of its own
    buffer: Callable = ReplayBuffer.from_config
    max_prompt: int | None = None
    fill: bool = False
    chat: bool = False
    prompt: Callable = lambda cfg, text: text  # a problem's prompt as the run's flags make it (math: the instruction)


# --- loaders the tasks share ------------------------------------------------------------------------
def read_jsonl(path: str, problem) -> list[Problem]:
    """`problem(row, where)` for each JSON object line of `path`; ConfigError in one line naming what is wrong."""
    if not os.path.isfile(path):
        raise ConfigError(f"--data: {path} does not exist")
    problems = []
    try:
        with open(path, encoding="utf-8-sig") as f:  # a byte-order mark (Windows editors write one) is dropped
            lines = f.read().split("\n")  # not splitlines(): JSON strings may hold U+2028
    except UnicodeDecodeError as e:
        raise ConfigError(f"--data: {path} is not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r})") from None
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError(f"--data: {path} line {line_no}: not valid JSON") from None
        if not isinstance(row, dict):
            raise ConfigError(f"--data: {path} line {line_no}: not a JSON object")
        problems.append(problem(row, f"{path} line {line_no}"))
    if not problems:
        raise ConfigError(f"--data: {path} holds no problems")
    return problems


def text_fields(row: dict, where: str, *fields: str):
    """Refuse a row whose `fields` are missing or not text."""
    for name in fields:
        if not isinstance(row.get(name), str):
            raise ConfigError(f"--data: {where}: missing or non-text field {name!r}")


def hub_dataset(name: str, config, files: str):
    """A data set of the Hugging Face hub (its splits); refused in one line naming the `files` --data would take."""
    try:
        from datasets import load_dataset  # optional: only this path needs it
    except ImportError:
        raise ConfigError(f"--data: no folder given and the 'datasets' package is not installed; "
                          f"pass --data DIR holding {files}") from None
    try:
        return load_dataset(name, config)
    except Exception as e:  # no network, no hub: one line, naming the flag to use instead
        raise ConfigError(f"--data: could not load {name} from the Hugging Face hub "
                          f"({type(e).__name__}); pass --data DIR holding {files}") from None


def folder(data: str) -> str:
    if not os.path.isdir(data):
        raise ConfigError(f"--data: {data} is not a folder")
    return data


def load_splits(name: str, config, splits: tuple[str, str], problem):
    """A loader of a data set with two splits, (train, test), from --data's JSONL files or the hub."""
    def load(data: str | None) -> tuple[list[Problem], list[Problem]]:
        if data is None:
            ds = hub_dataset(name, config, " and ".join(f"{s}.jsonl" for s in splits))
            return tuple([problem(r, f"{name} {s} row {i}") for i, r in enumerate(ds[s])] for s in splits)
        return tuple(read_jsonl(os.path.join(folder(data), f"{split}.jsonl"), problem) for split in splits)
    return load
