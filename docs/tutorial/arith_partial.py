"""`arith_partial`: arith with partial credit, the answer to exercise 3 of docs/tutorial.md's runs. The
training reward is 1 for the exact answer, 0.5 for a wrong one that starts with the right digit, else 0; held
out: exact match (`metric`), so that its accuracy compares with arith's. Copy it into tasks/ to run it:

    cp docs/tutorial/arith_partial.py tasks/ && python tba.py --task arith_partial
"""
from rewards import arith_reward
from tasks import arith
from tasks.task import Task


def reward(completion: str, answer: str) -> float:
    completion = completion.strip()
    return 1.0 if completion == answer else 0.5 if completion[:1] == answer[:1] else 0.0


TASK = Task(arith.load, reward, metric=arith_reward)
