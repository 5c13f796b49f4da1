"""docs/tutorial.md's walk through one step's code stays true: each `name` (file:first-last) it gives is
where that function or class is defined now (found with `ast`), each quoted `code` (file:n) is on that line,
the walk stops at every file of the README's reading order, every prediction is answered after it, and each
exercise's answer beside the page (docs/tutorial/*.py) is run and its claim checked with the project's own
functions.

When the code moves, `python tests/test_tutorial_code.py` rewrites the page's line numbers (a name or a line
that is gone is said, and left for a person to mend)."""

import ast
import importlib.util
import os
import re
import sys

import pytest
import torch

from conftest import ROOT

PAGE = os.path.join(ROOT, "docs", "tutorial.md")
ANSWERS = os.path.join(ROOT, "docs", "tutorial")
REF = re.compile(r"`([^`\n]+)` \(((?:[\w-]+/)*[\w-]+\.py):(\d+)(?:-(\d+))?\)")  # `what` (file:first[-last])
NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")  # a definition's name; anything else quotes a line


def spans(path: str) -> dict[str, tuple[int, int]]:
    """Each function and class of a file by its qualified name (`Class.method`) -> its lines, `def` to end."""
    out = {}

    def visit(node, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.setdefault(prefix + child.name, (child.lineno, child.end_lineno))
                visit(child, prefix + child.name + ".")
    with open(os.path.join(ROOT, path)) as f:
        visit(ast.parse(f.read()), "")
    return out


def now(m: re.Match) -> str:
    """The reference `m` as the code stands; ValueError where its file, name or line is gone."""
    what, path, line = m[1], m[2], int(m[3])
    if not os.path.isfile(os.path.join(ROOT, path)):
        raise ValueError(f"{m[0]}: there is no {path}")
    if NAME.fullmatch(what):
        if what not in spans(path):
            raise ValueError(f"{m[0]}: {path} defines no {what} now (renamed? moved?): name what runs now")
        return "`{}` ({}:{}-{})".format(what, path, *spans(path)[what])
    with open(os.path.join(ROOT, path)) as f:
        holding = [i for i, text in enumerate(f, 1) if what in text]
    if not holding:
        raise ValueError(f"{m[0]}: no line of {path} holds `{what}` now")
    return f"`{what}` ({path}:{min(holding, key=lambda i: abs(i - line))})"


def test_each_reference_is_where_the_code_is():
    refs = list(REF.finditer(open(PAGE).read()))
    assert len(refs) >= 30, f"the walk gives its functions as `name` (file:first-last): {len(refs)} found"
    moved = []
    for m in refs:
        try:
            if now(m) != m[0]:
                moved.append(f"{m[0]} moved: it is {now(m)} now")
        except ValueError as e:
            moved.append(str(e))
    assert not moved, ("docs/tutorial.md's references:\n" + "\n".join(moved)
                       + "\n(python tests/test_tutorial_code.py rewrites the line numbers)")


def test_the_walk_stops_at_every_file_of_the_reading_order():
    readme = open(os.path.join(ROOT, "README.md")).read()
    order = readme.split("## Read the code in this order")[1].split("\n## ")[0]
    stops = re.findall(r"^\d+\. `([\w/]+\.py)`", order, re.M)
    walked = {m[2] for m in REF.finditer(open(PAGE).read())}
    assert len(stops) >= 5 and not set(stops) - walked, (stops, walked)


def test_each_prediction_is_answered_after_its_question():
    parts = open(PAGE).read().split("**Predict.**")[1:]
    assert len(parts) >= 9, len(parts)
    for part in parts:
        question, rest = part.split("\n\n", 1)
        section = re.split(r"^#", rest, flags=re.M)[0]
        assert "<details>" not in question and "What it shows" not in question, question
        assert "<details><summary>Answer</summary>" in section or "**What it shows.**" in section, question


def answer(name: str):
    spec = importlib.util.spec_from_file_location(f"tutorial_{name}", os.path.join(ANSWERS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_exercise_has_its_answer_and_each_answer_its_check():
    linked = set(re.findall(r"\]\(tutorial/(\w+)\.py\)", open(PAGE).read()))
    beside = {f[:-3] for f in os.listdir(ANSWERS) if f.endswith(".py")}
    checked = {name[len("test_answer_"):] for name in globals() if name.startswith("test_answer_")}
    assert linked == beside == checked, (linked, beside, checked)


def test_answer_log_z_gradient():
    """Exercise 1: log Z in the graph gives the same gradient."""
    a = answer("log_z_gradient")
    detached, attached, log_z = a.gradients()
    assert log_z.requires_grad  # the answer's log Z is in the graph: its loss is not tb_loss again
    assert detached.abs().max() > 0.1  # a batch with a gradient
    assert torch.allclose(detached, attached, rtol=1e-9, atol=1e-12) == a.SAME_GRADIENT


def test_answer_log_z_fixed():
    """Exercise 2: log Z fixed at 0 adds the mean of (log Z)^2 to TB's loss and -2 log Z / (B K) to each
    response's gradient; log Z is mean r / beta at pi_ref (on run 2's rows: tests/test_tutorial.py)."""
    from loss import tb_loss
    a = answer("log_z_fixed")
    x = a.batch()
    grads = []
    for loss_fn in (tb_loss, a.tb_nolog_z_loss):
        logp = x["logp"].clone().requires_grad_()
        loss, stats = loss_fn(**dict(x, logp=logp))
        loss.backward()
        grads.append((loss.detach(), logp.grad, stats))
    (tb, tb_grad, stats), (fixed, fixed_grad, _) = grads
    log_z, (B, K) = stats["log_z"], tb_grad.shape
    assert (log_z ** 2).mean() > 1  # log Z away from 0: the two losses differ
    assert torch.isclose(fixed, tb + (log_z ** 2).mean(), rtol=1e-12)
    assert torch.allclose(fixed_grad - tb_grad, (-2 * log_z / (B * K))[:, None].expand(B, K), rtol=1e-9)
    at_start = tb_loss(**dict(x, logp=x["logp_ref"]))[1]["log_z"]
    assert torch.allclose(at_start, a.log_z_at_start(x["reward"], x["beta"]))


def test_answer_recent_pool():
    """Exercise 3: the recent pool is whole windows, the newest that cover B prompts."""
    a = answer("recent_pool")
    assert a.drawn([4, 5]) == a.FEW and a.drawn([4, 5, 6, 7]) == a.ENOUGH


def test_answer_reuse_bank():
    """Exercise 4: the reuse cap banks at most k steps' draws, or a round of every searcher."""
    a = answer("reuse_bank")
    assert {k: a.steps_after(2, k) for k in a.STEPS} == a.STEPS
    assert a.steps_after(1, 1) == 1 and a.steps_after(0, 1) == 0  # one round, one step; none, none


def test_answer_arith_partial():
    """Exercise 3 of the runs: 1 for the answer, 0.5 for a wrong one with its first digit, else 0; held out:
    exact match, on arith's problems (its run learns: tests/test_tutorial.py)."""
    from tasks import arith
    task = answer("arith_partial").TASK
    said = ("132", " 132\n", "139", "1", "13", "232", "", "32")
    assert [task.reward(c, "132") for c in said] == [1, 1, .5, .5, .5, 0, 0, 0]
    assert [task.metric(c, "132") for c in ("132", "139")] == [1, 0]
    assert task.load(None) == arith.load(None) and task.demos is None  # demos: --model tiny is arith's model


def test_the_prediction_on_tb_loss_as_the_page_answers_it():
    """Section 6, the loss: one prompt, two of K = 8 right, logp = logp_ref, beta 0.05: log Z 5, gradients
    -3.75 and 1.25 (the right ones raised by descent, the wrong lowered, summing to 0)."""
    from loss import tb_loss
    reward = torch.tensor([[1.0, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.float64)
    logp = torch.zeros(1, 8, dtype=torch.float64, requires_grad=True)
    loss, stats = tb_loss(logp=logp, logp_ref=torch.zeros_like(logp), reward=reward, beta=0.05)
    loss.backward()
    assert stats["log_z"].item() == pytest.approx(5.0)
    assert logp.grad[0].tolist() == pytest.approx([-3.75] * 2 + [1.25] * 6)


if __name__ == "__main__":  # rewrite the page's line numbers where the code moved
    page = open(PAGE).read()

    def mended(m: re.Match) -> str:
        try:
            return now(m)
        except ValueError as e:
            print(e, file=sys.stderr)
            return m[0]
    with open(PAGE, "w") as f:
        f.write(REF.sub(mended, page))
