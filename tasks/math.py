"""`math`: MATH (Hendrycks et al., 2021), the paper's Sec. 6 run with Qwen 2.5 7B, TBA′ against Dr. GRPO
(run_math.sh), as in the authors' code for it (bbartoldson/tba-prime, a fork of prime-rl). docs/tasks.md, "MATH",
gives its data (two formats, told apart line by line), prompt, reward and evaluation.
"""

import importlib
import json
import os

import re

from rewards import batched, hendrycks_normalize, last_boxed, math_reward
from runtime.bounded import Bounded, TimedOut
from runtime.errors import ConfigError
from tasks.task import Problem, Scorer, Task, folder, hub_dataset, read_jsonl, text_fields

INSTRUCTION = " Place your answer at end exactly inside latex box for example \\boxed{12} or \\boxed{51}."
AUTHORS_INSTRUCTION = INSTRUCTION.replace("{12}", "12").replace("{51}", "51")  # what their f-string printed
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
    return Problem(prompt=question, answer=gold)


def prompt(cfg, question: str) -> str:
    """The problem and the instruction: ours (the braces as meant) or the authors' exact text (--math-prompt)."""
    return question + (AUTHORS_INSTRUCTION if cfg.math_prompt == "authors" else INSTRUCTION)


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


# --- --math-grader authors: their sympy check (tba-prime's genesys/math_utils.py at 115573d, lines 160-460; from
# PRM800K's grader), ported with its guards; run in a child process under MATH_SECONDS as math-verify is (theirs had
# no limit). It needs pylatexenc (their LaTeX to text) and sympy.
def authors_reward(completion: str, answer: str) -> float:
    """Their compute_math_reward (genesys/math.py:6-47): the last box against the answer, by Hendrycks'
    normalisation or their sympy check."""
    text = completion.split("</think>")[1] if "</think>" in completion else completion
    given, gold = last_boxed(text), last_boxed(answer) if "\\boxed" in answer else answer
    if not given or not gold:
        return 0.0
    if hendrycks_normalize(given) == hendrycks_normalize(gold):
        return 1.0
    try:
        return float(SYMPY(given, gold))
    except TimedOut:
        return 0.0


def grade_answer_sympy(given: str, truth: str) -> bool:
    """Their grade_answer_sympy (math_utils.py:424-460): normalised strings, then element by element of a tuple;
    unreduced fractions must match exactly, an integer only an integer; else sympy's simplify of the difference."""
    truth, given = normalize(truth), normalize(given)
    if truth is None or given is None:
        return False
    if truth == given:
        return True
    if not given:
        return False
    truths, givens = split_tuple(truth), split_tuple(given)
    if len(truths) > 1 and (truth[0] != given[0] or truth[-1] != given[-1]) or len(truths) != len(givens):
        return False
    for t, g in zip(truths, givens):
        if is_frac(t) and is_frac(g):
            ok = t == g
        elif str_is_int(t) != str_is_int(g):
            ok = False
        else:
            ok = sympy_equal(t, g)
        if not ok:
            return False
    return True


SYMPY = Bounded("tasks.math:grade_answer_sympy", 5, preload=("sympy", "pylatexenc.latex2text"))
UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month", "year",
         "foot", "feet", "inch", "yard")


def normalize(expr: str | None) -> str | None:
    """Their _normalize (math_utils.py:255-318)."""
    if expr is None:
        return None
    m = re.search("^\\\\text\\{(?P<text>.+?)\\}$", expr)
    expr = m.group("text") if m is not None else expr
    for a, b in (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , "),
                 ("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12")):
        expr = expr.replace(a, b)
    for unit in UNITS:
        expr = re.sub(f"{unit}(es)?(s)? *(\\^[0-9]+)?", "", expr)
    expr = re.sub("\\^ *\\\\circ", "", expr)
    if len(expr) > 0 and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(",\\\\! *", "", expr)
    if is_float(expr) and abs(float(expr) - int(round(float(expr)))) <= 1e-7:
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        try:
            expr = parse_latex(expr)
        except Exception:
            pass
    expr = re.sub("- *", "-", expr)
    expr = re.sub("([0-9]) +([0-9])", "\\1+\\2", expr)  # a mixed number: 7 3/4 -> 7+3/4
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if str_is_int(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def parse_latex(expr: str) -> str:
    """Their _parse_latex (math_utils.py:181-197): LaTeX to text sympy can read."""
    from pylatexenc import latex2text
    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    expr = latex2text.LatexNodes2Text().latex_to_text(expr)
    for a, b in (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*")):
        expr = expr.replace(a, b)
    return expr.strip()


def is_float(x: str) -> bool:
    try:
        float(x)
        return True
    except ValueError:
        return False


def is_frac(expr: str) -> bool:
    return bool(re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", expr))


def strip_commas(expr: str) -> str:
    """Commas of thousands (1,000), not a tuple's."""
    while True:
        stripped = re.sub(r"(\d)(,)(\d\d\d)($|\D)", "\\1\\3\\4", expr)
        if stripped == expr:
            return expr
        expr = stripped


def str_is_int(x: str) -> bool:
    try:
        x = float(strip_commas(x))
        return abs(x - int(round(x))) <= 1e-7
    except Exception:
        return False


def split_tuple(expr: str) -> list[str]:
    expr = strip_commas(expr)
    if not expr:
        return []
    if len(expr) > 2 and expr[0] in "([" and expr[-1] in ")]" and all(c not in expr[1:-1] for c in "()[]"):
        return [e.strip() for e in expr[1:-1].split(",")]
    return [expr]


def sympy_equal(truth: str, given: str) -> bool:
    """Their are_equal_under_sympy (math_utils.py:351-362) behind their should_allow_eval (335-348): no more
    than two unknown letters, no nested or long exponents."""
    expr = f"({truth})-({given})"
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    if len(letters) > 2 or "^{" in expr or "^(" in expr or re.search(r"\^[0-9]+\^|\^[0-9][0-9]+", expr):
        return False
    try:
        import sympy
        from sympy.parsing import sympy_parser
        parsed = sympy_parser.parse_expr(expr.replace("^", "**"), transformations=(
            sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)))
        return sympy.simplify(parsed) == 0
    except Exception:
        return False


class MathScorer(Scorer):
    """The default scorer with the grader the flags choose (--math-grader)."""

    def __init__(self, engine, task, evaluates: bool):
        super().__init__(engine, task, evaluates)
        if self.cfg.math_grader == "authors":  # for training and for the held-out figure alike
            self.score = self.metric = batched(authors_reward)


def check(cfg) -> dict:
    try:  # the reward's symbolic check imports it in a process of its own: refused here, in one line, if missing
        importlib.import_module("pylatexenc" if cfg.math_grader == "authors" else "math_verify")
    except ImportError:
        raise ConfigError("--math-grader: the authors' grader reads LaTeX with pylatexenc: pip install pylatexenc"
                          if cfg.math_grader == "authors" else
                          "--task: the math task grades with math-verify: pip install math-verify==0.9.0") from None
    return {}


TASK = Task(load, math_reward, scorer=MathScorer, check=check, chat=True, prompt=prompt,
            flags=("math_grader", "math_prompt"))
