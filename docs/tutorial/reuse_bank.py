"""Exercise 4 of docs/tutorial.md's code section: how many steps two rounds that land at once pay for.

Answer: one, with k = 1. The reuse cap (`ReuseCap`) banks at most k steps' draws, or one round of every
searcher if that is more: here both are 32 x 8 = 256 draws, so the second round's credit is lost, not saved
for later, and after one step the trainer waits for the next round. With `--sync-every 4` the bank holds
4 x 256 draws, and the two rounds pay for two steps. The bound is what keeps a burst of data (a searcher that
was slow, then fast) from paying for a later burst of replay.

    python docs/tutorial/reuse_bank.py
"""

import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo

from buffer import ReuseCap

STEPS = {1: 1, 4: 2}  # the answer: --sync-every k -> steps the two rounds pay for


def steps_after(rounds: int, sync_every: int) -> int:
    """The steps the trainer can take, with run 2's settings, after `rounds` rounds land at once."""
    cfg = SimpleNamespace(max_reuse=1.0, searchers=1, round_prompts=32, search_samples_per_prompt=8,
                          sync_every=sync_every, prompts_per_step=32, samples_per_prompt=8)
    cap, draws = ReuseCap.for_run(cfg, nodes=1), cfg.prompts_per_step * cfg.samples_per_prompt
    cap.receive(rounds * cfg.round_prompts * cfg.search_samples_per_prompt)  # what the buffer has kept
    steps = 0
    while cap.allows(draws):
        cap.draw(draws)
        steps += 1
    return steps


if __name__ == "__main__":
    print("two rounds at once pay for " + ", ".join(f"{steps_after(2, k)} step(s) with --sync-every {k}"
                                                    for k in STEPS))
