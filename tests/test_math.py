"""The math task: its data (both formats, the hub's names), its prompts as chat turns, --context (prompt and
response together), and a short run of it with the real vLLM CPU engine. Its reward: tests/test_rewards.py."""

import json
import os
import re
import sys

import numpy as np
import pytest

import tasks
from conftest import MATH, metrics, run_tba
from rewards import last_boxed
from runtime import checks, tiny
from runtime.config import Config
from runtime.errors import ConfigError

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
TASK = tasks.get("math")


def rows(split: str) -> list[dict]:
    with open(os.path.join(MATH, f"{split}.jsonl")) as f:
        return [json.loads(line) for line in f]


# --- the data --------------------------------------------------------------------------------------
def test_the_shipped_slice_loads_in_both_formats():
    from runtime.config import Config
    train, test = TASK.load(MATH)
    assert len(train) == 40 and len(test) == 60
    instruction = " Place your answer at end exactly inside latex box for example \\boxed{12} or \\boxed{51}."
    assert all(TASK.prompt(Config(task="math"), p.prompt).endswith(instruction) for p in train + test)
    assert train[0].prompt == rows("train")[0]["prompt"]  # the instruction joins with the flags (`prompt`)
    truths = [json.loads(r["verification_info"])["ground_truth"] for r in rows("train")]
    assert [p.answer for p in train] == [last_boxed(t) if "\\boxed" in t else t for t in truths]
    assert sum("\\boxed" in t for t in truths) == 13  # both kinds of ground truth
    assert [p.answer for p in test] == [r["answer"] for r in rows("test")]


def write(folder, train, test):
    folder.mkdir(exist_ok=True)
    for name, lines in (("train", train), ("test", test)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return str(folder)


def test_rows_of_either_format_and_their_refusals(tmp_path):
    genesys = {"prompt": "What is 2+3?", "verification_info": {"ground_truth": 5}}  # an object, a number
    solution = {"problem": "What is 1/2 of 1?", "solution": "Half: $\\boxed{\\frac{1}{2}}$."}  # no answer field
    train, test = TASK.load(write(tmp_path / "ok", [genesys], [solution]))
    assert (train[0].answer, test[0].answer) == ("5", "\\frac{1}{2}")
    bad = [({"prompt": "p", "verification_info": "{not json"}, "verification_info is not valid JSON"),
           ({"prompt": "p", "verification_info": {"answer": 5}}, "no answer"),
           ({"prompt": "p", "verification_info": {"ground_truth": ["1", "2"]}}, "no answer"),
           ({"prompt": "p", "verification_info": {"ground_truth": "\\boxed{"}}, "empty answer"),
           ({"prompt": 3, "verification_info": {"ground_truth": "1"}}, "missing or non-text field 'prompt'"),
           ({"problem": "p", "solution": "no box"}, "no answer"),
           ({"problem": "p"}, "missing or non-text field 'solution'"),
           ({"question": "p", "answer": "1"}, "neither a genesys row"),
           ({"problem": "p", "answer": " "}, "empty answer")]
    for row, match in bad:
        folder = write(tmp_path / "bad", [genesys, row], [solution])
        with pytest.raises(ConfigError, match=f"^--data: {re.escape(folder)}/train.jsonl line 2: .*{match}"):
            TASK.load(folder)
    os.remove(tmp_path / "ok" / "test.jsonl")
    with pytest.raises(ConfigError, match="^--data: .*/ok/test.jsonl does not exist$"):
        TASK.load(str(tmp_path / "ok"))


def test_training_problems_held_out_are_dropped(tmp_path):
    held = {"problem": "What is 2+3?", "answer": "5"}
    other = {"problem": "What is 2+4?", "answer": "6"}
    train, test = TASK.load(write(tmp_path / "a", [{"prompt": "What is 2+3?", "verification_info": '{"ground_truth": "5"}'},
                                                   other], [held]))
    assert [p.answer for p in train] == ["6"] and [p.answer for p in test] == ["5"]
    with pytest.raises(ConfigError, match="^--data: every training problem is also a held-out one$"):
        TASK.load(write(tmp_path / "b", [held], [held]))


def test_the_hub_sets_and_their_refusals(monkeypatch):
    import tasks.math as math_task
    line = {"prompt": "What is 2+3?", "verification_info": '{"ground_truth": "5"}', "task_type": "verifiable_math"}
    asked = []
    monkeypatch.setattr(math_task, "hub_dataset", lambda name, config, files: asked.append(name) or
                        {"train": [dict(line, prompt=f"{name} {i}") for i in range(2)]})
    train, test = TASK.load(None)
    assert asked == ["justus27/math-hendrycks-genesys-format", "PrimeIntellect/MATH-500"]
    assert [p.prompt.split(" Place")[0] for p in test] == ["PrimeIntellect/MATH-500 0", "PrimeIntellect/MATH-500 1"]
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(ConfigError, match=r"^--data: no folder given and the 'datasets' package is not installed; "
                                          r"pass --data DIR holding train.jsonl and test.jsonl$"):
        TASK.load(None)
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ConfigError, match=r"^--task: the math task grades with math-verify: pip install "):
        TASK.check(Config(task="math"))


# --- chat prompts and --context (runtime/checks.py) ------------------------------------------------
@pytest.fixture(scope="module")
def chat_models(tmp_path_factory):
    """Random tiny Llamas with the character tokenizer: with no chat template, with one, and with one that
    writes BOS for a tokenizer that also adds it."""
    from tokenizers import processors
    root, models = tmp_path_factory.mktemp("chat"), {}
    for kind in ("plain", "chat", "bos"):
        tok = tiny.make_tokenizer()
        if kind != "plain":
            tok.chat_template = TEMPLATE
        if kind == "bos":
            tok._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
        models[kind] = str(root / kind)
        tiny.make_model(models[kind], max_len=2048, tokenizer=tok)
    return models


def check(model, tmp_path, *args):
    cfg = checks.parse(Config, ["--model", model, "--task", "math", "--data", MATH, "--searchers", "0",
                                "--prompts-per-step", "4", "--max-new-tokens", "64", "--out", str(tmp_path / "run"), *args])
    return checks.check(cfg, 1)


def test_prompts_are_chat_turns(chat_models, tmp_path, monkeypatch):
    from transformers import AutoTokenizer
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    train, test = TASK.load(MATH)
    for kind in ("chat", "bos"):
        cfg, data, _ = check(chat_models[kind], tmp_path)
        tokenizer = AutoTokenizer.from_pretrained(chat_models[kind])
        assert tokenizer.decode(data.prompts[0]) == f"<s>user: {TASK.prompt(cfg, train[0].prompt)}\nassistant:"
        assert tokenizer.decode(data.test_prompts[-1]) == f"<s>user: {TASK.prompt(cfg, test[-1].prompt)}\nassistant:"
        assert data.prompts[0].count(tokenizer.bos_token_id) == 1  # the template's, not added again
        assert data.answers == [p.answer for p in train]
        assert cfg.max_model_len == max(map(len, data.prompts + data.test_prompts)) + 64
    assert AutoTokenizer.from_pretrained(chat_models["bos"])("x").input_ids[0] == 1  # it would have added one
    with pytest.raises(ConfigError, match=f"^--model: the math task's prompts are chat turns, and the tokenizer of "
                                          f"{chat_models['plain']} has no chat template$"):
        check(chat_models["plain"], tmp_path)


def test_context_bounds_prompt_and_response(chat_models, tmp_path, monkeypatch):
    from searcher import max_tokens
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, data, _ = check(chat_models["chat"], tmp_path)
    longest = max(map(len, data.prompts + data.test_prompts))
    cfg, _, _ = check(chat_models["chat"], tmp_path, "--context", str(longest + 10))
    assert cfg.max_model_len == longest + 10
    short = min(data.prompts, key=len)
    assert max_tokens(cfg, short) == 64 and max_tokens(cfg, max(data.prompts, key=len)) <= 10
    cfg, _, _ = check(chat_models["chat"], tmp_path, "--context", "100000")
    assert cfg.max_model_len == longest + 64  # --max-new-tokens binds first
    with pytest.raises(ConfigError, match=f"^--context: {longest} tokens leave no room for a response to the "
                                          f"longest prompt's {longest} tokens$"):
        check(chat_models["chat"], tmp_path, "--context", str(longest))
    with pytest.raises(ConfigError, match="^--context: must be 0"):
        check(chat_models["chat"], tmp_path, "--context", "-1")
    with pytest.raises(ConfigError, match=rf"^--context: 4000 new tokens \+ the longest prompt's {longest} tokens "
                                          r"\(at most --context 3000\) = 3000 exceeds the model's context of 2048"):
        check(chat_models["chat"], tmp_path, "--context", "3000", "--max-new-tokens", "4000")
    with pytest.raises(ConfigError, match=rf"^--max-new-tokens: 4000 new tokens \+ the longest prompt's {longest} "
                                          rf"tokens = {longest + 4000} exceeds the model's context of 2048 tokens$"):
        check(chat_models["chat"], tmp_path, "--max-new-tokens", "4000")


# --- a run -----------------------------------------------------------------------------------------
@pytest.mark.engine
def test_a_math_run_with_a_context(chat_models, tmp_path):
    """A synchronous run of the math task (its reward's checking process in a process running vLLM): the prompts
    are chat turns, and a response stops where --context leaves no more room after its prompt."""
    from transformers import AutoTokenizer
    from runtime.checkpoint import load_checkpoint
    problems = [{"problem": f"What is {n} + {n}?" + " Think." * n, "answer": str(2 * n)} for n in range(1, 7)]
    data = write(tmp_path / "data", problems[:4], problems[4:])
    tokenizer = AutoTokenizer.from_pretrained(chat_models["chat"])
    asked = lambda p: TASK.prompt(Config(task="math"), p.prompt)  # the problem and its instruction, as a run's
    prompts = [checks.encode(tokenizer, asked(p), True) for p in TASK.load(data)[0]]
    context = max(len(checks.encode(tokenizer, asked(p), True)) for p in sum(TASK.load(data), [])) + 6
    out = tmp_path / "run"
    p = run_tba(["--model", chat_models["chat"], "--task", "math", "--data", data, "--searchers", "0", "--steps", "2",
                 "--prompts-per-step", "2", "--samples-per-prompt", "2", "--max-new-tokens", "48", "--context",
                 str(context), "--eval-every", "2", "--save-every", "2", "--out", str(out)], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:]
    rows_ = metrics(out)
    train, evals = [r for r in rows_ if r["kind"] == "train"], [r for r in rows_ if r["kind"] == "eval"]
    assert len(train) == 2 and all(r["reward"] == 0.0 for r in train)  # a random model boxes nothing
    assert evals and evals[0]["example"]["prompt"].endswith("\\boxed{12} or \\boxed{51}.\nassistant:")
    arrays = load_checkpoint(str(out / "checkpoint"))["buffer"]
    ends = np.cumsum(arrays["length"])
    caps = [min(48, context - len(prompts[i])) for i in arrays["prompt_id"]]
    assert max(caps) < 48  # the context binds for every prompt
    for n, end, cap in zip(arrays["length"], ends, caps):
        ended = arrays["response"][end - 1] == tokenizer.eos_token_id
        assert n == cap or (ended and n < cap), (n, cap)


def test_the_authors_grader_and_prompt_are_switches():
    """--math-grader authors: their sympy check with its guards (stricter than math-verify: unreduced fractions,
    exponents in braces); --math-prompt authors: their instruction as their f-string printed it."""
    from runtime.config import Config
    from tasks import math as m
    assert m.grade_answer_sympy("\\frac{1}{2}", "0.5") and m.grade_answer_sympy("(1,2)", "(1, 2)")
    assert m.grade_answer_sympy("x^2+1", "1+x^2") and m.grade_answer_sympy("5\\%", "5")
    assert not m.grade_answer_sympy("\\frac{2}{4}", "\\frac{1}{2}")  # unreduced: a string match or nothing
    assert not m.grade_answer_sympy("2^{10}", "1024")  # their guard: no braced exponent reaches sympy
    assert not m.grade_answer_sympy("3.5", "3")  # an integer answer wants an integer
    assert m.authors_reward("so \\boxed{0.5}", "\\frac12") == 1.0 and m.authors_reward("\\boxed12", "12") == 0.0
    assert m.prompt(Config(task="math"), "2+2?").endswith("for example \\boxed{12} or \\boxed{51}.")
    assert m.prompt(Config(task="math", math_prompt="authors"), "2+2?") == (
        "2+2? Place your answer at end exactly inside latex box for example \\boxed12 or \\boxed51.")
