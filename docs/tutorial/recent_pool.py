"""Exercise 3 of docs/tutorial.md's code section: which prompts a batch can draw with recency 1.

Answer: all six, 0-5. The recent pool is made of whole windows (`ReplayBuffer.recent`): the newest windows
that together cover B prompts. Window 1 (since the sync) covers two, prompts 4 and 5, so window 0 joins it,
all of it, prompts 0-3 too: right after a sync a batch is not yet all fresh data. Once prompts 6 and 7 arrive,
window 1 covers B = 4 alone, and the batch draws exactly 4-7.

    python docs/tutorial/recent_pool.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo

import numpy as np

from buffer import ReplayBuffer, Trajectory

FEW = set(range(6))     # the answer with prompts 4 and 5 in the window since the sync
ENOUGH = {4, 5, 6, 7}   # and with 6 and 7 too


def drawn(new: list[int], B: int = 4, K: int = 2, batches: int = 1000) -> set[int]:
    """The prompts that `batches` batches of B x K draw with recency 1, from a buffer holding a response to
    each of prompts 0-3, then a sync, then a response to each prompt of `new`."""
    buffer = ReplayBuffer(capacity=8, recency=1.0, reward_inv_temp=1.0)
    one = lambda p: Trajectory(prompt_id=p, response=np.array([p], np.int32), reward=1.0, logp_ref=0.0,
                               logp_behaviour=0.0, version=0)
    buffer.add([one(p) for p in range(4)])
    buffer.mark_sync()
    buffer.add([one(p) for p in new])
    rng = np.random.default_rng(0)
    return {t.prompt_id for _ in range(batches) for group in buffer.sample(B, K, rng) for t in group}


if __name__ == "__main__":
    print(f"prompts 4, 5 since the sync: the batches draw {sorted(drawn([4, 5]))}; "
          f"4-7: {sorted(drawn([4, 5, 6, 7]))}")
