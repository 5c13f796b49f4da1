"""The TB loss against a loop-written reference, and the paper's REINFORCE identity."""

import torch

from loss import sequence_logprobs, tb_loss
from searcher import collate


def tb_loss_reference(logp, logp_ref, reward, beta):
    """Slow, loop-written TB with the VarGrad log Z, straight from the paper's equations."""
    B, K = len(logp), len(logp[0])
    total, log_zs = 0.0, []
    for b in range(B):
        deltas = [logp[b][j] - logp_ref[b][j] - reward[b][j] / beta for j in range(K)]
        log_z = -sum(deltas) / K
        log_zs.append(log_z)
        total += sum((log_z + d) ** 2 for d in deltas)
    return total / (B * K), log_zs


def test_tb_loss_matches_reference():
    g = torch.Generator().manual_seed(0)
    for B, K, beta in ((1, 2, 1.0), (3, 5, 0.05), (7, 20, 0.014)):
        logp = -torch.rand(B, K, generator=g, dtype=torch.float64) * 50
        logp_ref = -torch.rand(B, K, generator=g, dtype=torch.float64) * 50
        reward = (torch.rand(B, K, generator=g, dtype=torch.float64) > 0.5).double()
        loss, log_z = tb_loss(logp, logp_ref, reward, beta)
        ref_loss, ref_log_z = tb_loss_reference(logp.tolist(), logp_ref.tolist(), reward.tolist(), beta)
        assert abs(loss.item() - ref_loss) <= 1e-9 * max(1.0, ref_loss)
        assert torch.allclose(log_z, torch.tensor(ref_log_z, dtype=torch.float64), rtol=1e-12, atol=1e-9)


def test_log_z_carries_no_gradient():
    logp = torch.tensor([[-1.0, -3.0]], requires_grad=True)
    loss, _ = tb_loss(logp, torch.zeros(1, 2), torch.tensor([[1.0, 0.0]]), beta=1.0)
    loss.backward()
    # delta = [-2, -3], log Z = 2.5: d/dlogp_j mean_j (log Z + delta_j)^2 = (log Z + delta_j) / 1 with log Z fixed
    assert torch.allclose(logp.grad, torch.tensor([[0.5, -0.5]]))


def test_on_policy_gradient_is_reinforce_with_kl_regularised_reward(tiny_model):
    """On-policy, grad L_TB = (2 / beta) grad L_RF, where L_RF is REINFORCE with a mean baseline and
    the KL-regularised reward r - beta (log pi - log pi_ref) (the paper's identity, Sec. 3)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64)
    with torch.no_grad():  # a reference policy that differs from the current one
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    prompts = [[5, 17, 22, 9], [30, 31]]
    K, beta, T = 6, 0.3, 0.8
    pairs = []
    for prompt in prompts:  # on-policy samples from the current model at temperature T
        out = model.generate(torch.tensor([prompt]), do_sample=True, temperature=T, top_k=0, top_p=1.0,
                             max_new_tokens=5, num_return_sequences=K, pad_token_id=0)
        pairs += [(prompt, out[j, len(prompt):]) for j in range(K)]
    batch = collate(pairs, 0, "cpu")
    with torch.no_grad():
        logp_ref = sequence_logprobs(ref, *batch, T).view(2, K)
    reward = torch.randint(0, 2, (2, K)).double()

    logp = sequence_logprobs(model, *batch, T).view(2, K)
    tb, _ = tb_loss(logp, logp_ref, reward, beta)
    g_tb = torch.autograd.grad(tb, list(model.parameters()))

    logp = sequence_logprobs(model, *batch, T).view(2, K)
    kl_reward = (reward - beta * (logp - logp_ref)).detach()
    advantage = kl_reward - kl_reward.mean(dim=1, keepdim=True)
    reinforce = -(advantage * logp).mean()
    g_rf = torch.autograd.grad(reinforce, list(model.parameters()))

    scale = max(a.abs().max().item() for a in g_tb)
    assert scale > 1e-3  # a real gradient, not zeros on both sides
    for a, b in zip(g_tb, g_rf):  # equal up to float32 rounding (log-softmax runs in float32)
        assert torch.allclose(a, (2 / beta) * b, rtol=1e-5, atol=1e-6 * scale)
