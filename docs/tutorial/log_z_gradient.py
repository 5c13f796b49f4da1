"""Exercise 1 of docs/tutorial.md's code section: tb_loss with log Z left in the graph (no `.detach()`).

Answer: the gradient does not change, exactly. With log Z = -mean_i delta_i the loss is
mean_j (delta_j - mean_i delta_i)^2, whose gradient is
    d L / d logp_j = 2 / (B K) [(delta_j - mean delta) - mean_i (delta_i - mean delta)];
the second term, the part through log Z, is a mean of deviations from their mean: zero. The `.detach()` saves
autograd work and changes no estimator: VarGrad's log Z is the prompt's own mean, and the loss the variance of
delta over its K responses.

    python docs/tutorial/log_z_gradient.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo

import torch

from loss import tb_loss

SAME_GRADIENT = True  # the answer


def tb_loss_attached(logp, logp_ref, reward, beta: float, **_):
    """tb_loss without `.detach()`: log Z in the graph."""
    delta = logp - logp_ref - reward / beta     # (B, K)
    log_z = -delta.mean(dim=1, keepdim=True)    # (B, 1) with gradient
    return (log_z + delta).pow(2).mean(), {"log_z": log_z.squeeze(1)}


def gradients(B: int = 4, K: int = 8, beta: float = 0.05, seed: int = 0):
    """The gradient of tb_loss and of tb_loss_attached with respect to `logp`, (B, K) each, on one random
    batch, and the attached version's log Z."""
    g = torch.Generator().manual_seed(seed)
    logp_ref = -20 * torch.rand(B, K, generator=g, dtype=torch.float64)    # (B, K) summed log-probs
    logp0 = logp_ref + torch.randn(B, K, generator=g, dtype=torch.float64)  # (B, K) a policy near pi_ref
    reward = (torch.rand(B, K, generator=g) < 0.4).double()                # (B, K) right or wrong
    out = []
    for loss_fn in (tb_loss, tb_loss_attached):
        logp = logp0.clone().requires_grad_()
        loss, stats = loss_fn(logp=logp, logp_ref=logp_ref, reward=reward, beta=beta)
        loss.backward()
        out.append(logp.grad)
    return out[0], out[1], stats["log_z"]


if __name__ == "__main__":
    detached, attached, _ = gradients()
    print(f"largest gradient {detached.abs().max():.4f}; largest difference between the two "
          f"{(detached - attached).abs().max():.2e}")
