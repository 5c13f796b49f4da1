"""Reward functions: plain `reward(completion, answer) -> float`, testable on strings alone (MATH's symbolic
check of two answers runs in a child process under a hard time limit, runtime/bounded.py, so that no answer can
hang or crash a round), and `RewardModel`, a learned reward (`--reward-model`, the paper's TL;DR reward). The
searcher calls either kind the same way, once per round: `reward(prompts, responses, completions, answers) ->
list[float]` (a string reward through `batched`).
"""

import functools
import re

from runtime.bounded import Bounded, TimedOut
from runtime.errors import ConfigError
from runtime.hub import load_tokenizer, resolve_model

# The authors' number pattern: decimals, numbers with a leading dot, scientific notation,
# integers; each with an optional sign. `$` and `%` are not part of a number.
NUMBER = re.compile(r"[+-]?\d+\.\d*|[+-]?\.\d+|[+-]?\d+e[-+]?\d+|[+-]?\d+")


def last_number(text: str) -> float | None:
    """The last number in `text` (commas removed) as a float, or None if there is none."""
    numbers = NUMBER.findall(text.replace(",", ""))
    return float(numbers[-1]) if numbers else None


def gsm8k_gold(answer: str) -> float:
    """The gold number of a GSM8K answer field: what follows its `####` marker."""
    if "####" not in answer:
        raise ValueError(f"GSM8K answer has no '####' marker: {answer[-60:]!r}")
    gold = last_number(answer.split("####")[-1])
    if gold is None:
        raise ValueError(f"GSM8K answer has no number after '####': {answer[-60:]!r}")
    return gold


def gsm8k_reward(completion: str, answer: str) -> float:
    """1.0 if the last number of `completion` equals the gold `####` number of `answer`."""
    predicted = last_number(completion)
    return float(predicted is not None and predicted == gsm8k_gold(answer))


def arith_reward(completion: str, answer: str) -> float:
    """1.0 if the completion is exactly `answer` (surrounding whitespace aside), else 0.0."""
    return float(completion.strip() == answer)


# --- MATH: the authors' grading (bbartoldson/tba-prime src/zeroband/inference/genesys/math.py) ------------
def math_reward(completion: str, answer: str) -> float:
    """1.0 if the last \\boxed{} of `completion` holds `answer` (a LaTeX answer, or one in a box); else 0.0.
    Only the text after `</think>` counts where there is one (their math.py:11-14 take what lies between the
    first and a second); no box, or one whose braces do not close, is 0 (math.py:16-18)."""
    text = completion.split("</think>")[1] if "</think>" in completion else completion
    given = last_boxed(text)
    gold = last_boxed(answer) if "\\boxed" in answer else answer  # math.py:31-36
    if not given or not gold:  # an empty box is wrong (their sympy grader: math_utils.py:434-435)
        return 0.0
    return float(hendrycks_normalize(given) == hendrycks_normalize(gold) or symbolic_equal(gold, given))


def last_boxed(text: str) -> str | None:
    """What the last `\\boxed{...}` of `text` holds, braces matched; None if there is none, if the last
    `\\boxed` is not followed by `{` (`\\boxed 5`, `\\boxed12`) or if its braces never close: their
    last_boxed_only_string and remove_boxed (math_utils.py:379-414; their `\\fbox` fallback ends in None too)."""
    start = text.rfind("\\boxed")
    if start < 0 or not text.startswith("\\boxed{", start):
        return None
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + len("\\boxed{"):i]
    return None


MATH_SECONDS = 5  # a hard limit on one symbolic check (its child killed past it); a typical one takes 5-10 ms
MATH_VERIFY_SECONDS = 1  # math-verify's own limits, inside the child (each parse and comparison; whole seconds)
SYMBOLIC = Bounded("rewards:math_verify_equal", MATH_SECONDS, preload=("math_verify",))


@functools.lru_cache(maxsize=1 << 16)  # a group's K responses often box the same answer
def symbolic_equal(gold: str, given: str) -> bool:
    """math-verify's equivalence of two boxed answers, in a child process (runtime/bounded.py): False when it
    takes longer than MATH_SECONDS, so that a pathological answer can neither hang a round nor crash it."""
    try:
        return SYMBOLIC(gold, given)
    except TimedOut:
        return False


def math_verify_equal(gold: str, given: str) -> bool:
    """math-verify's verdict (HF's math-verify 0.9.0) on two answers, each parsed inside a box: a bare LaTeX
    answer has no delimiters for its LaTeX extraction (108 of MATH-500's 500 answers then fail against
    themselves). This replaces the authors' sympy grader (grade_answer_sympy, math_utils.py:424-460)."""
    from math_verify import parse, verify
    box = lambda s: parse("\\boxed{" + s + "}", parsing_timeout=MATH_VERIFY_SECONDS)
    return bool(verify(box(gold), box(given), timeout_seconds=MATH_VERIFY_SECONDS))


def hendrycks_normalize(answer: str) -> str:
    """Hendrycks et al.'s MATH normalisation, as the authors' mathd_normalize_answer (math_utils.py:15-164):
    an enclosing \\text{} off, then _strip_string; an answer that makes it fail stays as it is."""
    answer = answer.strip()
    try:
        m = re.search(r"^\\text\{(?P<text>.+?)\}$", answer)
        if m is not None:
            answer = m.group("text").strip()
        return _strip_string(answer)
    except Exception:
        return answer


def _fix_fracs(string: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{72} -> \\frac{1}{72}."""
    substrs = string.split("\\frac")
    new_str = substrs[0]
    for substr in substrs[1:]:
        new_str += "\\frac"
        if substr[0] == "{":  # an empty one raises, as theirs: the whole normalisation then gives up
            new_str += substr
        elif len(substr) < 2:
            return string
        elif substr[1] != "{":
            new_str += "{" + substr[0] + "}{" + substr[1] + "}" + substr[2:]
        else:
            new_str += "{" + substr[0] + "}" + substr[1:]
    return new_str


def _fix_a_slash_b(string: str) -> str:
    """3/4 -> \\frac{3}{4}, for integers written as they are."""
    parts = string.split("/")
    if len(parts) != 2:
        return string
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return string
    return f"\\frac{{{a}}}{{{b}}}" if string == f"{a}/{b}" else string


def _remove_right_units(string: str) -> str:
    """What precedes "\\text{ " (MATH writes units so); two of them fail the answer's normalisation."""
    if "\\text{ " not in string:
        return string
    splits = string.split("\\text{ ")
    assert len(splits) == 2
    return splits[0]


def _fix_sqrt(string: str) -> str:
    """\\sqrt3 -> \\sqrt{3}."""
    splits = string.split("\\sqrt")
    new_string = splits[0]
    for split in splits[1:]:
        new_string += "\\sqrt" + split if split[:1] == "{" else "\\sqrt{" + split[0] + "}" + split[1:]
    return new_string


def _strip_string(string: str) -> str:
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                     ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        string = string.replace(old, new)
    string = _remove_right_units(string)
    string = string.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not string:
        return string
    if string[0] == ".":
        string = "0" + string
    if len(string.split("=")) == 2 and len(string.split("=")[0]) <= 2:  # "k = 5" -> "5"
        string = string.split("=")[1]
    string = _fix_sqrt(string).replace(" ", "")
    string = _fix_fracs(string)
    if string == "0.5":
        string = "\\frac{1}{2}"
    return _fix_a_slash_b(string)


# --- the one interface the searcher calls, once per round, for either kind of reward -------------
def batched(reward):
    """A string reward as the searcher calls every reward: on the lists of one round."""
    return lambda prompts, responses, completions, answers: [reward(c, a) for c, a in zip(completions, answers)]


def check_reward_model(name: str, flag: str) -> str:
    """The local folder of a reward model (--FLAG): a sequence classifier with exactly one output, and its
    tokenizer; refused in one line otherwise."""
    from transformers import AutoConfig
    path = resolve_model(name, flag)
    config = AutoConfig.from_pretrained(path)
    kinds = getattr(config, "architectures", None) or []
    if not any(k.endswith("ForSequenceClassification") for k in kinds):
        raise ConfigError(f"--{flag}: {path} is not a sequence classifier (architectures: {', '.join(kinds) or 'none'})")
    if config.num_labels != 1:
        raise ConfigError(f"--{flag}: {path} has {config.num_labels} outputs; a reward model has exactly one")
    load_tokenizer(path, flag)
    return path


class RewardModel:
    """A learned reward (`--reward-model`): a Hugging Face sequence classifier with one output, read as in the paper's
    TL;DR runs and the authors' `tba_trainer_tldr.py` (TRL's `get_reward`; docs/tasks.md, "Reward models"): at the
    response's last token (its first EOS) whatever the padding token (transformers' own pooling reads the token
    before EOS when pad = EOS). Build it under `Engine.beside()` in a process that runs vLLM (see searcher.py)."""

    def __init__(self, path: str, device, dtype, policy_tokenizer, non_eos_penalty: bool,
                 batch: int = 64, penalty: float = -1.0):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.torch, self.device, self.batch = torch, torch.device(device), batch
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=getattr(torch, dtype))
        self.model.to(self.device).eval().requires_grad_(False)
        self.tokenizer, self.policy_tokenizer = AutoTokenizer.from_pretrained(path), policy_tokenizer
        self.same_vocab = self.tokenizer.get_vocab() == policy_tokenizer.get_vocab()
        self.eos, self.non_eos_penalty, self.penalty = policy_tokenizer.eos_token_id, non_eos_penalty, penalty
        pad = self.tokenizer.pad_token_id  # in its own tokens, for `score(pooling=True)`
        self.pad = pad if pad is not None else self.tokenizer.eos_token_id

    def __call__(self, prompts, responses, completions=None, answers=None) -> list[float]:
        """Rewards of (prompt ids, response ids) pairs in the policy's tokens."""
        cut = [list(r[:list(r).index(self.eos) + 1]) if self.eos in list(r) else list(r) for r in responses]
        scores = self.score([list(p) + r for p, r in zip(prompts, cut)])
        return [s if self.eos in r or not self.non_eos_penalty else self.penalty for s, r in zip(scores, cut)]

    def score(self, sequences: list[list[int]], pooling: bool = False) -> list[float]:
        """The model's output at the last token of each sequence (policy token ids). `pooling`: where
        transformers' sequence-classification pooling reads it instead, the last token that is not
        padding, with pad = EOS where the tokenizer has no pad token (as the authors' eval_tldr/
        load_and_eval.py sets it): a response ending in EOS is read at the token before
        (transformers/models/gpt_neox/modeling_gpt_neox.py:513-526, transformers/modeling_layers.py:160-173)."""
        if not self.same_vocab:  # another tokenizer: score the text, with its own EOS where there was one
            ends = [s[-1:] == [self.eos] for s in sequences]
            texts = self.policy_tokenizer.batch_decode(sequences, skip_special_tokens=True)
            sequences = [self.tokenizer(t).input_ids + ([self.tokenizer.eos_token_id] if e else [])
                         for t, e in zip(texts, ends)]
        torch, out = self.torch, []
        with torch.no_grad():
            for i in range(0, len(sequences), self.batch):
                part = sequences[i:i + self.batch]
                T = max(len(s) for s in part)
                ids = torch.tensor([s + [0] * (T - len(s)) for s in part], device=self.device)          # (n, T)
                mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in part], device=self.device)
                hidden = self.model.base_model(input_ids=ids, attention_mask=mask,  # no KV cache for one pass
                                               use_cache=False).last_hidden_state                   # (n, T, H)
                last = torch.tensor([last_token(s, self.pad if pooling else None) for s in part], device=self.device)
                out += self.model.score(hidden[torch.arange(len(part)), last]).squeeze(-1).float().tolist()
        return out


def last_token(sequence: list[int], pad: int | None) -> int:
    """The index read as a sequence's score: its last token, or with `pad` the last token that is not
    `pad` (transformers' argmax of index x (token != pad): 0 when every token is padding)."""
    if pad is None:
        return len(sequence) - 1
    return max((i for i, t in enumerate(sequence) if t != pad), default=0)
