"""The losses against loop-written references, the paper's REINFORCE identity, and chunked log-probs."""

import pytest
import torch

from loss import collate, grpo_loss, rloo_loss, sequence_logprobs, tb_loss


def tb_loss_reference(logp, logp_ref, reward, beta, gamma=1.0, reward_temp=1.0):
    """Slow, loop-written TB with the VarGrad log Z, straight from the paper's equations (log R tempered
    as Lee et al.'s: (log pi_ref / gamma + r / beta) / T_R)."""
    B, K = len(logp), len(logp[0])
    total, log_zs = 0.0, []
    for b in range(B):
        deltas = [logp[b][j] - (logp_ref[b][j] / gamma + reward[b][j] / beta) / reward_temp for j in range(K)]
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
        loss, stats = tb_loss(logp, logp_ref, reward, beta)
        log_z = stats["log_z"]
        ref_loss, ref_log_z = tb_loss_reference(logp.tolist(), logp_ref.tolist(), reward.tolist(), beta)
        assert abs(loss.item() - ref_loss) <= 1e-9 * max(1.0, ref_loss)
        assert torch.allclose(log_z, torch.tensor(ref_log_z, dtype=torch.float64), rtol=1e-12, atol=1e-9)


def test_tempered_tb_matches_reference():
    g = torch.Generator().manual_seed(1)
    logp, logp_ref = (-torch.rand(3, 5, generator=g, dtype=torch.float64) * 50 for _ in range(2))
    reward = torch.randn(3, 5, generator=g, dtype=torch.float64)
    loss, stats = tb_loss(logp, logp_ref, reward, 0.05, gamma=1.2, reward_temp=1.7)
    ref_loss, ref_log_z = tb_loss_reference(logp.tolist(), logp_ref.tolist(), reward.tolist(), 0.05, 1.2, 1.7)
    assert abs(loss.item() - ref_loss) <= 1e-9 * max(1.0, ref_loss)
    assert torch.allclose(stats["log_z"], torch.tensor(ref_log_z, dtype=torch.float64))
    assert abs(loss.item() - tb_loss(logp, logp_ref, reward, 0.05)[0].item()) > 1.0  # the temperatures count


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


# --- the baselines of --loss (loss.py) -----------------------------------------------------------------
def random_batch(B, K, seed):
    g = torch.Generator().manual_seed(seed)
    rand = lambda scale: -torch.rand(B, K, generator=g, dtype=torch.float64) * scale
    length = torch.randint(1, 9, (B, K), generator=g).double()
    logp = rand(20).requires_grad_()
    return dict(logp=logp, logp_ref=rand(20), logp_behaviour=logp.detach() + 2.0 * torch.randn(B, K, generator=g, dtype=torch.float64),
                reward=(torch.rand(B, K, generator=g, dtype=torch.float64) > 0.5).double(), length=length)


def rloo_reference(logp, logp_ref, reward, beta):
    """REINFORCE, leave-one-out baseline, KL-regularised reward (no gradient through it): a loop."""
    B, K = len(logp), len(logp[0])
    total = 0.0
    for b in range(B):
        R = [reward[b][j] - beta * (logp[b][j].item() - logp_ref[b][j]) for j in range(K)]
        for j in range(K):
            baseline = sum(R[i] for i in range(K) if i != j) / (K - 1)
            total = total - (R[j] - baseline) * logp[b][j]
    return total / (B * K)


def grpo_reference(logp, logp_ref, logp_behaviour, reward, length, beta, clip):
    """Dr. GRPO with a sequence-level clipped ratio and a k3 KL penalty: a loop over responses."""
    B, K = len(logp), len(logp[0])
    total = 0.0
    for b in range(B):
        mean_r = sum(reward[b]) / K
        for j in range(K):
            n, a = length[b][j], reward[b][j] - mean_r
            ratio = torch.exp((logp[b][j] - logp_behaviour[b][j]) / n)
            clipped = min(max(ratio, torch.tensor(1 - clip, dtype=ratio.dtype)), torch.tensor(1 + clip, dtype=ratio.dtype))
            u = (logp_ref[b][j] - logp[b][j]) / n
            total = total - n * min(ratio * a, clipped * a) + beta * n * (torch.exp(u) - u - 1)
    return total / (B * K)


@pytest.mark.parametrize("B,K,beta,clip", [(1, 2, 1.0, 0.2), (3, 5, 0.05, 0.2), (4, 8, 0.014, 0.1)])
def test_baselines_match_their_loop_references(B, K, beta, clip):
    clipped = 0.0
    for seed in range(3):
        x = random_batch(B, K, seed)
        loss, _ = rloo_loss(**x, beta=beta, clip=clip)
        ref = rloo_reference(x["logp"], x["logp_ref"].tolist(), x["reward"].tolist(), beta)
        assert torch.allclose(loss, ref, rtol=1e-10, atol=1e-12)
        g, g_ref = torch.autograd.grad(loss, x["logp"])[0], torch.autograd.grad(ref, x["logp"])[0]
        assert torch.allclose(g, g_ref, rtol=1e-10, atol=1e-12)

        loss, stats = grpo_loss(**x, beta=beta, clip=clip)
        ref = grpo_reference(x["logp"], x["logp_ref"], x["logp_behaviour"], x["reward"].tolist(), x["length"], beta, clip)
        assert torch.allclose(loss, ref, rtol=1e-10, atol=1e-12)
        g, g_ref = torch.autograd.grad(loss, x["logp"])[0], torch.autograd.grad(ref, x["logp"])[0]
        assert torch.allclose(g, g_ref, rtol=1e-10, atol=1e-12)
        clipped += stats["clip_frac"].sum().item()
    assert clipped > 0  # behaviour log-probs about 2 nats away per sequence: some ratios are clipped


def test_grpo_on_policy_ratio_is_one_and_clip_inactive():
    x = random_batch(3, 6, 0)
    x["logp_behaviour"] = x["logp"].detach().clone()  # on-policy: sampled by the policy being trained
    loss, stats = grpo_loss(**x, beta=0.0, clip=0.2)
    assert stats["clip_frac"].sum() == 0
    g = torch.autograd.grad(loss, x["logp"])[0]
    advantage = x["reward"] - x["reward"].mean(dim=1, keepdim=True)
    assert torch.allclose(g, -advantage / advantage.numel())  # Dr. GRPO: A grad log pi, summed over tokens


def test_rloo_and_tb_gradients_obey_the_papers_identity():
    """grad L_TB = 2 (K - 1) / (beta K) grad L_RLOO on the same responses: the on-policy identity
    of the paper (Sec. 3) with RLOO's leave-one-out baseline, K / (K - 1) times the mean baseline."""
    for B, K, beta in ((2, 2, 1.0), (3, 8, 0.05), (5, 20, 0.014)):
        x = random_batch(B, K, K)
        x["logp_behaviour"] = x["logp"].detach().clone()
        g_tb = torch.autograd.grad(tb_loss(**x, beta=beta)[0], x["logp"])[0]
        g_rloo = torch.autograd.grad(rloo_loss(**x, beta=beta)[0], x["logp"])[0]
        assert g_tb.abs().max() > 1e-3
        assert torch.allclose(g_tb, 2 * (K - 1) / (beta * K) * g_rloo, rtol=1e-10, atol=1e-12)


def test_chunked_logprobs_equal_the_plain_ones(tiny_model):
    """sequence_logprobs over chunks of positions (recomputed in backward) = one float32 log-softmax."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    pairs = [(torch.randint(4, 90, (n,), generator=g).tolist(), torch.randint(4, 90, (m,), generator=g).numpy())
             for n, m in ((5, 3), (9, 7), (4, 12))]
    batch = collate(pairs, 0, "cpu")
    plain = sequence_logprobs(model, *batch, 0.7, chunk_bytes=2**40)  # one chunk
    chunked = sequence_logprobs(model, *batch, 0.7, chunk_bytes=4 * 3 * 100 * 2)  # two positions a chunk
    # float32 sums of up to -141 here, where one ulp is 1.5e-5: 1e-5 plus 1e-6 of the value (summing
    # chunk by chunk instead of at once rounds once per addition)
    assert torch.allclose(plain, chunked, rtol=1e-6, atol=1e-5)
    g_plain = torch.autograd.grad(plain.sum(), list(model.parameters()))
    g_chunked = torch.autograd.grad(chunked.sum(), list(model.parameters()))
    for a, b in zip(g_plain, g_chunked):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    logits = model(input_ids=batch[0], attention_mask=batch[1]).logits[:, :-1].float() / 0.7
    direct = (logits.log_softmax(-1).gather(-1, batch[0][:, 1:, None]).squeeze(-1) * batch[2][:, 1:]).sum(1)
    assert torch.allclose(direct, chunked, rtol=1e-6, atol=1e-5)


# --- the per-token losses: Dr. GRPO and TBA′'s update as the authors ran them for MATH ------------------------
def per_token_batch(B=3, K=4, T=6, seed=0):
    """Random per-token tensors: responses of lengths 1..T, their mask, and float64 log-probs."""
    g = torch.Generator().manual_seed(seed)
    length = torch.randint(1, T + 1, (B, K), generator=g).double()
    mask = (torch.arange(T)[None, None, :] < length[..., None]).double()
    lp = lambda: -torch.rand(B, K, T, generator=g, dtype=torch.float64) * 3 * mask
    reward = (torch.rand(B, K, generator=g, dtype=torch.float64) > 0.5).double()
    prompt_length = torch.randint(3, 40, (B, 1), generator=g).double().expand(B, K)  # one prompt a group
    return dict(token_logp=lp().requires_grad_(True), behaviour_logps=lp(), ref_logps=lp(), token_mask=mask,
                reward=reward, length=length, prompt_length=prompt_length)


def test_drgrpo_on_policy_gradient_is_dr_grpos():
    """On-policy (mu = pi_theta) the ratio is 1 and the gradient is Dr. GRPO's: -A_i / |y_i| on each token of
    response i (the mean over B x K), or / its prompt + response length, or / the generation budget."""
    from loss import drgrpo_loss
    x = per_token_batch()
    x["behaviour_logps"] = x["token_logp"].detach().clone()
    B, K = x["reward"].shape
    A = x["reward"] - x["reward"].mean(1, keepdim=True)
    for norm, by in (("response", x["length"]), ("sequence", x["prompt_length"] + x["length"]),
                     ("budget", torch.full_like(x["length"], 12.0))):
        x["token_logp"].grad = None
        drgrpo_loss(**x, norm=norm, budget=12)[0].backward()
        expected = -(A / by)[..., None] * x["token_mask"] / (B * K)
        assert torch.allclose(x["token_logp"].grad, expected, atol=1e-12), norm


def test_drgrpo_truncates_the_ratio_at_c():
    """A token whose ratio pi / mu is above c gets no gradient (torch.clamp, as theirs); below, ratio x A."""
    from loss import drgrpo_loss
    x = per_token_batch(seed=1)
    x["behaviour_logps"] = x["token_logp"].detach() - torch.where(x["token_mask"] > 0, torch.randn_like(x["token_mask"]) * 3, 0.0)
    drgrpo_loss(**x, is_cap=8.0)[0].backward()
    ratio = torch.exp(x["token_logp"].detach() - x["behaviour_logps"])
    B, K = x["reward"].shape
    A = x["reward"] - x["reward"].mean(1, keepdim=True)
    expected = torch.where(ratio < 8.0, -ratio * (A / x["length"])[..., None], 0.0) * x["token_mask"] / (B * K)
    assert torch.allclose(x["token_logp"].grad, expected, atol=1e-12) and (ratio * x["token_mask"] > 8).any()


def tbprime_reference(token_logp, behaviour_logps, ref_logps, token_mask, reward, length, beta, weights, cap=8.0,
                      **_):
    """Their update transcribed term by term, with loops: -w_t [A_i - beta (KL_i - mean_K KL^mu)] / |y_i|, KL the
    detached sum of clamp(log pi - log pi_ref, +-10), w_t = min(pi / mu, c) (with gradient) or log pi's gradient."""
    B, K, T = token_logp.shape
    total = 0.0
    for b in range(B):
        kl_mu = [sum(max(-10.0, min(10.0, float(behaviour_logps[b, j, t] - ref_logps[b, j, t])))
                     for t in range(int(length[b, j]))) for j in range(K)]
        mean_r = sum(float(reward[b, j]) for j in range(K)) / K
        for i in range(K):
            kl_i = sum(max(-10.0, min(10.0, float(token_logp[b, i, t] - ref_logps[b, i, t]))) for t in range(int(length[b, i])))
            coef = (float(reward[b, i]) - mean_r) - beta * (kl_i - sum(kl_mu) / K)
            for t in range(int(length[b, i])):
                w = (torch.exp(token_logp[b, i, t] - behaviour_logps[b, i, t]).clamp(0, cap) if weights
                     else token_logp[b, i, t])
                total = total - w * coef / float(length[b, i])
    return total / (B * K)


@pytest.mark.parametrize("weights", [True, False])
def test_tbprime_matches_the_authors_formula(weights):
    from loss import tbprime_loss
    x = per_token_batch(seed=2)
    loss = tbprime_loss(**x, beta=0.005, importance_weights=weights)[0]
    (grad,) = torch.autograd.grad(loss, x["token_logp"])
    ref = tbprime_reference(**x, beta=0.005, weights=weights)
    (ref_grad,) = torch.autograd.grad(ref, x["token_logp"])
    assert abs(loss.item() - ref.item()) < 1e-10 and torch.allclose(grad, ref_grad, atol=1e-12)


def their_sample_loss(logp, logp_behav, logp_ref, reward, group_mean_reward, group_mean_kl, prompt_len, beta=0.005,
                      kind="tb", IS=True):
    """One sample's loss in the authors' MATH code (tba-prime at 71c1716), transcribed with plain floats: the token
    sum over the response divided by `seq_lens`, the prompt's and the response's tokens (train.py:465-468,
    data.py:278, 647, loss.py:427-428), at their micro-batch of 1 (configs/training/MATH.toml:12). "tb": loss.py:
    137-156 (the KL detached, clamped at +-10; the mean KL under mu from train.py:316-341); "ratio" (Dr. GRPO):
    loss.py:259-266. The batch's objective is the mean over its samples."""
    import math
    clamp = lambda x, lo, hi: max(lo, min(hi, x))
    R = len(logp)
    if kind == "tb":
        kl = sum(clamp(a - b, -10, 10) for a, b in zip(logp, logp_ref))
        A = (reward - group_mean_reward) - beta * (kl - group_mean_kl)
        tok = [-clamp(math.exp(a - b), 0, 8) * A for a, b in zip(logp, logp_behav)] if IS else [-a * A for a in logp]
    else:
        A = reward - group_mean_reward
        tok = [-clamp(math.exp(a - b), 0, 8) * A for a, b in zip(logp, logp_behav)]
    return sum(tok) / (prompt_len + R)


@pytest.mark.parametrize("kind", ["tb", "ratio"])
def test_the_sequence_normaliser_is_the_authors(kind):
    """--norm sequence: tbprime (IS on and off) and drgrpo give the authors' loss, the mean over samples of their
    per-sample formula, its value (their gradient flows through the same terms: log pi's, with the clamp's)."""
    from loss import drgrpo_loss, tbprime_loss
    x = per_token_batch(seed=4)
    B, K = x["reward"].shape
    for IS in ((True, False) if kind == "tb" else (True,)):
        ours = (tbprime_loss(**x, beta=0.005, importance_weights=IS, norm="sequence") if kind == "tb" else
                drgrpo_loss(**x, norm="sequence"))[0]
        total = 0.0
        for b in range(B):
            n = [int(x["length"][b, j]) for j in range(K)]
            tokens = lambda name, j: x[name][b, j, :n[j]].tolist()
            kl_mu = [sum(max(-10, min(10, a - r)) for a, r in zip(tokens("behaviour_logps", j), tokens("ref_logps", j)))
                     for j in range(K)]
            for i in range(K):
                total += their_sample_loss(tokens("token_logp", i), tokens("behaviour_logps", i), tokens("ref_logps", i),
                                           float(x["reward"][b, i]), float(x["reward"][b].mean()), sum(kl_mu) / K,
                                           int(x["prompt_length"][b, i]), kind=kind, IS=IS)
        assert abs(ours.item() - total / (B * K)) < 1e-10, (kind, IS)
        assert abs(ours.item() - (tbprime_loss(**x, beta=0.005, importance_weights=IS) if kind == "tb" else
                                  drgrpo_loss(**x))[0].item()) > 1e-6  # the response normaliser is another


def test_tbprime_on_policy_is_tbs_gradient_up_to_scale_and_length():
    """mu = pi_theta, no KL clamp active: d tbprime / d log pi_theta(y_it) = beta / (2 |y_i|) x d TB / d log pi_theta(y_i)."""
    from loss import tb_loss, tbprime_loss
    x = per_token_batch(seed=3)
    x["behaviour_logps"] = x["token_logp"].detach().clone()
    beta = 0.05
    tbprime_loss(**x, beta=beta, importance_weights=False)[0].backward()
    logp = (x["token_logp"].detach() * x["token_mask"]).sum(-1).requires_grad_(True)
    logp_ref = (x["ref_logps"] * x["token_mask"]).sum(-1)
    tb_loss(logp, logp_ref, x["reward"], beta)[0].backward()
    expected = (beta / (2 * x["length"]) * logp.grad)[..., None] * x["token_mask"]
    assert torch.allclose(x["token_logp"].grad, expected, atol=1e-12)


@pytest.mark.parametrize("micro_batch", [1, 3])
@pytest.mark.parametrize("loss_name", list(__import__("loss").LOSSES))
def test_micro_batches_smaller_than_k_give_the_same_gradient(tiny_model, loss_name, micro_batch):
    """tba.backward with --micro-batch below K = 4 (passes without gradient for the group's statistics, then passes
    with it) gives the gradient and the loss of one pass over whole prompts, and no forward pass sees more than
    --micro-batch sequences (rank 0's memory at MATH's 16 x 4,096 tokens: docs/gpu.md). Every entry of LOSSES: a new
    loss is covered without editing this test, one that pools across prompts through tba.backward as tba.train
    routes it (tests/test_ranks.py: on two ranks too, a pooled loss among them)."""
    import dataclasses
    import numpy as np
    import tba
    from buffer import Trajectory
    from runtime.config import Config
    from transformers import AutoModelForCausalLM
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 60, 5).tolist() for _ in range(2)]
    # as a run makes them: integer versions, and another count of responses cut at the length limit in each prompt
    groups = [[Trajectory(p, rng.integers(4, 60, int(rng.integers(1, 6))).astype(np.int32), float(rng.integers(2)),
                          float(-rng.random() * 10), 0.0, int(rng.integers(3)), truncated=int(p == 0 and j < 2),
                          behaviour_logps=None) for j in range(4)] for p in range(2)]
    for g in groups:
        for t in g:
            t.behaviour_logps = (-rng.random(len(t.response)) * 2).astype(np.float32)
            t.ref_logps = (-rng.random(len(t.response)) * 2).astype(np.float32)
            t.logp_behaviour = float(t.behaviour_logps.sum())
    from runtime import checks
    pools = checks.loss_pools(Config(loss=loss_name))  # as runtime.checks derives it
    cfg = lambda mb: Config(samples_per_prompt=4, micro_batch=mb, loss=loss_name, temperature=1.0, loss_pools=pools)
    grads, losses = [], []
    for mb in (8, micro_batch):
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64)
        seen = []
        model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(len(kwargs["input_ids"])), with_kwargs=True)
        sums = tba.gradient(cfg(mb))(model, groups, 0, 1, prompts, 0, torch.device("cpu"), cfg(mb), beta=0.05)  # (pooled or not)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        losses.append(sums["loss"])
        assert max(seen) == min(mb, 4 if mb < 4 else 8), seen  # whole prompts (both) at 8; else at most mb
    # the log-softmax is float32: sums in another order
    why = (f"--loss {loss_name} at --micro-batch {micro_batch}: the {{}} differs from one pass's over the whole batch, "
           f"so the loss pools across prompts and got parts of the batch: neither its `pools` nor the start-up "
           f"probe (runtime.checks.loss_pools) said that it pools")
    assert losses[0] == pytest.approx(losses[1], rel=1e-5), why.format(f"loss ({losses[1]}, against {losses[0]} in one pass)")
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-8), why.format("gradient")
    assert grads[0].abs().max() > 1e-4


# --- which losses pool across prompts: what a loss says (`pools`) and the start-up probe (runtime.checks) -----------
def overlong_filtered_tb(logp, logp_ref, reward, truncated, beta, **_):
    """TB over the responses not cut at the length limit (DAPO's overlong filter), a mean over the batch's: pools."""
    delta = logp - logp_ref - reward / beta                      # (B, K)
    log_z = -delta.mean(dim=1, keepdim=True).detach()            # (B, 1)
    keep = (truncated < 0.5).double()                            # (B, K) 0/1
    return ((log_z + delta).pow(2) * keep).sum() / keep.sum(), {"log_z": log_z.squeeze(1)}


def equal_rewards_dropped_tb(logp, logp_ref, reward, beta, **_):
    """TB over the prompts whose rewards are not all equal (DAPO's dynamic sampling), a mean over their responses."""
    delta = logp - logp_ref - reward / beta                      # (B, K)
    log_z = -delta.mean(dim=1, keepdim=True).detach()            # (B, 1)
    keep = (reward.std(dim=1, keepdim=True) > 0).double().expand_as(reward)  # (B, K)
    return ((log_z + delta).pow(2) * keep).sum() / keep.sum(), {}


def per_prompt_filtered_tb(logp, logp_ref, reward, truncated, beta, **_):
    """The overlong filter within each prompt, then the mean over prompts: separable."""
    delta = logp - logp_ref - reward / beta                      # (B, K)
    log_z = -delta.mean(dim=1, keepdim=True).detach()            # (B, 1)
    keep = (truncated < 0.5).double()                            # (B, K)
    return (((log_z + delta).pow(2) * keep).sum(1) / keep.sum(1)).mean(), {}


@pytest.fixture
def losses():
    """loss.LOSSES, with the entries a test adds removed after it."""
    import loss
    before = dict(loss.LOSSES)
    yield loss.LOSSES
    loss.LOSSES.clear()
    loss.LOSSES.update(before)


@pytest.mark.parametrize("fn, pools", [(overlong_filtered_tb, True), (equal_rewards_dropped_tb, True),
                                       (per_prompt_filtered_tb, False)])
def test_the_probe_finds_a_loss_that_pools_through_a_0_1_field(losses, fn, pools, capsys):
    """The probe's batch holds the 0/1 fields as a run makes them, with another count of ones in each prompt: a
    filter over the batch's responses by `truncated` or by equal rewards is found pooling (before, `truncated` was
    continuous noise that no response had cut, and both were judged separable), the same filter within each prompt
    is not (before, its 0/0 on noise read as pooling)."""
    from runtime import checks
    from runtime.config import Config
    losses["mine"] = fn
    assert checks.loss_pools(Config(loss="mine")) is pools
    assert capsys.readouterr().out == ""  # nothing declared: nothing to disagree with


def test_the_probe_feeds_each_field_as_a_run_makes_it(losses):
    """Integer fields integers, `truncated` 0/1 with some cut, `for_step` -1, a prompt's
    responses one `prompt_id` and one `prompt_length`, a cut response the longest."""
    from runtime import checks
    from runtime.config import Config
    seen = []

    def strict(logp, reward, truncated, version, pi_ref_version, for_step, prompt_id, length,
               prompt_length, **_):
        for v in (reward, truncated, version, pi_ref_version, for_step, prompt_id, length, prompt_length):
            assert torch.equal(v, v.round())
        assert set(truncated.unique().tolist()) <= {0.0, 1.0} and set(reward.unique().tolist()) <= {0.0, 1.0}
        assert (for_step == -1).all() and (version >= 0).all()
        assert (prompt_id == prompt_id[:, :1]).all() and (prompt_length == prompt_length[:, :1]).all()
        assert (length[truncated > 0] == length.max()).all()
        seen.append(truncated.sum().item())
        return logp.pow(2).mean(), {}
    losses["strict"] = strict
    assert checks.loss_pools(Config(loss="strict")) is False
    assert seen[0] > 0  # the whole batch has cut responses


@pytest.mark.parametrize("fn, says, line", [
    (tb_loss, True, "says pools = True, and the start-up probe finds that it does not pool: it gets the whole batch "
                    "in every pass"),
    (overlong_filtered_tb, False, "says pools = False, and the start-up probe finds that it pools across prompts: "
                                  "it gets the whole batch in every pass"),
    (tb_loss, False, None), (overlong_filtered_tb, True, None)])
def test_a_loss_says_whether_it_pools_and_a_disagreement_is_one_line(losses, fn, says, line, capsys):
    """`pools` on a loss: whole batches where it or the probe says that it pools (the reading right either way), and
    one line at start-up where they disagree."""
    import functools
    from runtime import checks
    from runtime.config import Config
    mine = functools.wraps(fn)(lambda **kw: fn(**kw))
    mine.pools = says
    losses["mine"] = mine
    assert checks.loss_pools(Config(loss="mine")) is (says or fn is overlong_filtered_tb)
    out = capsys.readouterr().out
    assert (out == f"tba.py: --loss mine {line}\n") if line else out == "", out


def test_a_statistic_named_like_a_row_field_is_refused_in_one_line(losses):
    """A loss's statistic is logged in the train row under its name: one named like a field the row holds (the
    loss itself, the batch's reward, the trainer's count of prompts) would replace it, and is refused at start-up."""
    from runtime import checks
    from runtime.config import Config
    from runtime.errors import ConfigError
    for name in ("loss", "reward", "prompts", "staleness"):
        losses["mine"] = lambda logp, name=name, **_: (logp.pow(2).mean(), {name: logp.mean()})
        with pytest.raises(ConfigError, match=rf"^--loss: mine's statistic {name} is named like a field the train "
                                              rf"rows hold already, whose value it would replace: rename it$"):
            checks.loss_pools(Config(loss="mine"))
    losses["mine"] = lambda logp, **_: (logp.pow(2).mean(), {"mine_reward": logp.mean()})
    assert checks.loss_pools(Config(loss="mine")) is False


def test_a_loss_not_finite_on_the_probe_is_refused_in_one_line(losses):
    from runtime import checks
    from runtime.config import Config
    from runtime.errors import ConfigError
    losses["mine"] = lambda logp, **_: (logp.sum() / 0 * 0, {})
    with pytest.raises(ConfigError, match=r"^--loss: mine fails on the start-up check's batch \(ValueError: its loss "
                                          r"on it is nan\); see docs/experiments.md"):
        checks.loss_pools(Config(loss="mine"))


def test_a_losss_own_flags_reach_it_and_are_refused_with_another_loss(losses):
    """Each loss's `flags`: their values reach every call (loss.loss_options), and one given another value than its
    default with a loss that does not name it is refused in one line, as a task's flag with another task
    (runtime.checks.acts_only's entries for them derive from LOSSES)."""
    from loss import loss_options
    from runtime import checks
    from runtime.config import Config
    from runtime.errors import ConfigError
    owned = {}
    for name, fn in losses.items():
        for flag in getattr(fn, "flags", ()):
            owned.setdefault(flag, []).append(name)
    other = {"clip": 0.1, "is_cap": 2.0, "importance_weights": False, "norm": "budget", "reward_temp": 2.0,
             "gamma_final": 1.5}  # the built-in losses' flags (a researcher's loss may add more)
    assert set(owned) >= set(other)
    for flag in other:
        names = owned[flag]
        for name in losses:
            cfg = Config(loss=name, **{flag: other[flag]})
            if name in names:
                checks.check_unused(cfg)
                if flag not in ("reward_temp", "gamma_final"):  # TB's reach it as this step's (below)
                    assert loss_options(cfg, 0.1, 1.0, 1.0)[flag] == other[flag]
            else:
                with pytest.raises(ConfigError, match=rf"^--{flag.replace('_', '-')}: acts only in --loss "
                                                      rf"{' or '.join(names)}; here it would change nothing$"):
                    checks.check_unused(cfg)
    options = loss_options(Config(loss="tb", reward_temp=2.0, gamma_final=1.5), 0.1, gamma=1.2, reward_temp=1.5)
    assert options["reward_temp"] == 1.5 and options["gamma"] == 1.2 and options["beta"] == 0.1  # this step's


def test_loss_py_imports_torch_alone():
    """TB on one screen stands on torch alone: the start-up probe lives with the other checks (runtime/checks.py)."""
    import ast
    import os
    from conftest import ROOT
    tree = ast.parse(open(os.path.join(ROOT, "loss.py")).read())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert names == {"torch"}, names
