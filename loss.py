"""The trajectory balance (TB) loss of TBA (Bartoldson et al., 2025, Sec. 3), and the log-probs it needs.

Target: pi*(y|x) proportional to pi_ref(y|x) exp(r(y, x) / beta), the KL-regularised RL optimum.
For the K responses y_1..y_K of one prompt x:

    delta_j  = log pi_theta(y_j|x) - log pi_ref(y_j|x) - r(y_j, x) / beta
    log Z(x) = -mean_j delta_j              (the VarGrad estimate; no gradient flows through it)
    L_TB     = mean_j (log Z(x) + delta_j)^2

Log-probs are SUMMED over response tokens (no length normalisation) and come from logits divided
by the sampling temperature, as in the authors' code. pi_ref's log-probs are computed once, by the
searcher that made the trajectory, and travel with it. TB is valid for responses sampled from any
policy, which is what lets TBA train on stale, replayed data.
"""

import torch.nn.functional as F


def tb_loss(logp, logp_ref, reward, beta: float):
    """Mean TB loss over B prompts x K responses, and log Z per prompt. Inputs are (B, K)."""
    delta = logp - logp_ref - reward / beta            # (B, K) log pi_theta - log R, R = pi_ref exp(r / beta)
    log_z = -delta.mean(dim=1, keepdim=True).detach()  # (B, 1) VarGrad log Z: no gradient
    loss = (log_z + delta).pow(2).mean()               # scalar: mean over the B*K responses
    return loss, log_z.squeeze(1)                      # (), (B,)


def sequence_logprobs(model, input_ids, attention_mask, response_mask, temperature: float):
    """Summed log-prob of each sequence's response tokens, from logits / temperature. Returns (N,).

    input_ids, attention_mask, response_mask: (N, T), prompt then response then right padding;
    response_mask is 1 on response tokens (EOS included) and 0 on prompt and padding.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (N, T, V)
    logits = logits[:, :-1].float() / temperature                              # (N, T-1, V): predicts token t+1
    logp_token = -F.cross_entropy(logits.transpose(1, 2), input_ids[:, 1:], reduction="none")  # (N, T-1)
    return (logp_token * response_mask[:, 1:]).sum(dim=1)                      # (N,)
