"""Exercise 2 of docs/tutorial.md's code section: TB with log Z fixed at 0 (`tb_nolog_z`).

Answer: on the same batch its loss is tb_loss's plus the mean over prompts of (log Z)^2, since
mean_j delta_j^2 = mean_j (delta_j - mean delta)^2 + (mean delta)^2 and VarGrad's log Z is -mean delta; and
its gradient is TB's plus one push, the same for every response of a prompt: -2 log Z / (B K). Descent then
raises all of a prompt's sampled responses at once, toward log pi_theta = log R, which would need the policy
to hold the partition function Z while its probabilities sum to 1. Run 2's rows say how big that push is:
their `log_z` stays within 1 of `reward` / beta (between 3 and 6 here), what log Z is while the policy is near
pi_ref (delta_j = -r_j / beta); as large as the differences between responses that TB learns from (-15 and +5
in the page's prediction on the loss). VarGrad's estimate takes that constant out of every residual.

To run it: add `tb_nolog_z_loss` to loss.py and to its LOSSES (docs/experiments.md, "A loss"), then
`python tba.py --loss tb_nolog_z`.

    python docs/tutorial/log_z_fixed.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo

import torch

from loss import tb_loss


def tb_nolog_z_loss(logp, logp_ref, reward, beta: float, **_):
    """Trajectory balance with log Z = 0."""
    delta = logp - logp_ref - reward / beta   # (B, K) log pi_theta - log R
    return delta.pow(2).mean(), {}            # (), {}


def log_z_at_start(reward, beta: float):
    """(B,) VarGrad's log Z while the policy is pi_ref: -mean_j delta_j = mean_j r_j / beta."""
    return reward.mean(dim=1) / beta


def batch(B: int = 4, K: int = 8, beta: float = 0.05, seed: int = 0) -> dict:
    """A random batch, the loss's keyword arguments."""
    g = torch.Generator().manual_seed(seed)
    logp_ref = -20 * torch.rand(B, K, generator=g, dtype=torch.float64)
    return dict(logp=logp_ref + torch.randn(B, K, generator=g, dtype=torch.float64), logp_ref=logp_ref,
                reward=(torch.rand(B, K, generator=g) < 0.4).double(), beta=beta)


if __name__ == "__main__":
    x = batch()
    tb, stats = tb_loss(**x)
    print(f"tb_loss {tb:.3f} + mean (log Z)^2 {(stats['log_z'] ** 2).mean():.3f} = "
          f"{tb + (stats['log_z'] ** 2).mean():.3f}; tb_nolog_z {tb_nolog_z_loss(**x)[0]:.3f}")
