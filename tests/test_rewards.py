"""Rewards on strings alone: GSM8K's (the paper's rule) and the toy task's."""

import json
import os

import pytest

from conftest import DATA
from rewards import arith_reward, gsm8k_gold, gsm8k_reward, last_number


def gold_rows():
    for split in ("train", "test"):
        with open(os.path.join(DATA, f"{split}.jsonl")) as f:
            yield from (json.loads(line) for line in f)


def test_every_gold_answer_parses_and_scores_one_against_itself():
    rows = list(gold_rows())
    assert len(rows) > 150
    for row in rows:
        gold = gsm8k_gold(row["answer"])
        assert gold == float(row["answer"].split("####")[-1].strip().replace(",", ""))
        assert gsm8k_reward(row["answer"], row["answer"]) == 1.0
        assert gsm8k_reward(f"So the answer is {gold + 1:.12g}.", row["answer"]) == 0.0


@pytest.mark.parametrize("completion,answer,expected", [
    ("She makes 9 * 2 = $18 every day.", "#### 18", 1.0),
    ("The total is 1,600 apples.", "... #### 1,600", 1.0),          # commas, on both sides
    ("The total is 1600", "#### 1,600", 1.0),
    ("The answer is 1,6000", "#### 1,600", 0.0),
    ("The change is -5 degrees", "#### -5", 1.0),                   # negatives
    ("The change is 5 degrees", "#### -5", 0.0),
    ("It costs 2.50 dollars.", "#### 2.5", 1.0),                    # decimals compare as floats
    ("He ran 7. Then he stopped.", "#### 7", 1.0),                  # sentence-final period
    ("First 12, then 18, finally 20 more.", "#### 18", 0.0),        # the LAST number counts
    ("So 50% of them, that is 50", "#### 50", 1.0),                 # % and $ are not part of numbers
    ("That is $1,234.", "#### 1234", 1.0),
    ("I do not know.", "#### 3", 0.0),                              # no number at all
    ("", "#### 0", 0.0),
])
def test_gsm8k_reward_hard_cases(completion, answer, expected):
    assert gsm8k_reward(completion, answer) == expected


def test_gsm8k_answer_without_marker_is_an_error():
    with pytest.raises(ValueError, match="####"):
        gsm8k_gold("the answer is 4")


def test_last_number():
    assert last_number("a 1,000 b -2.5 c") == -2.5
    assert last_number("none") is None


def test_arith_reward_is_an_exact_match():
    assert arith_reward("132", "132") == 1.0
    assert arith_reward(" 132\n", "132") == 1.0
    assert arith_reward("1320", "132") == 0.0
    assert arith_reward("13", "132") == 0.0
    assert arith_reward("132 because", "132") == 0.0
