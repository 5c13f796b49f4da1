"""The trajectory balance (TB) loss of TBA (Bartoldson et al., 2025, Sec. 3), two on-policy
baselines to compare it with, and the sequence log-probs they all need.

Target: pi*(y|x) proportional to pi_ref(y|x) exp(r(y, x) / beta), the KL-regularised RL optimum.
For the K responses y_1..y_K of one prompt x:

    delta_j  = log pi_theta(y_j|x) - log pi_ref(y_j|x) - r(y_j, x) / beta
    log Z(x) = -mean_j delta_j              (the VarGrad estimate; no gradient flows through it)
    L_TB     = mean_j (log Z(x) + delta_j)^2

Log-probs are SUMMED over response tokens (no length normalisation) and come from logits divided
by the sampling temperature, as in the authors' code. pi_ref's log-probs are computed once, by the
searcher that made the trajectory, and travel with it. TB is valid for responses sampled from any
policy, which is what lets TBA train on stale, replayed data.

Every loss (`LOSSES`, chosen with `--loss`) takes the same (B, K) tensors by keyword (`logp`, the trainer's,
with gradient; every number field of buffer.Trajectory; `loss_options`'s numbers) and returns the scalar loss
and a dict of statistics. What it receives, what it says of itself (`flags`, `reads`, `per_token`, `pools`)
and how often it is called: docs/experiments.md, "A loss".
"""

import torch
import torch.utils.checkpoint


# ===== the method: TB ===============================================================================
def tb_loss(logp, logp_ref, reward, beta: float, gamma: float = 1.0, reward_temp: float = 1.0, **_):
    """Trajectory balance with the VarGrad log Z (the paper, Sec. 3). Lee et al.'s red-teaming tempers
    log R = (log pi_ref / gamma + r / beta) / T_R (--gamma-final, --reward-temp); both 1 = the paper's."""
    log_r = (logp_ref / gamma + reward / beta) / reward_temp  # (B, K) log R, R = pi_ref exp(r / beta) at 1, 1
    delta = logp - log_r                               # (B, K) log pi_theta - log R
    log_z = -delta.mean(dim=1, keepdim=True).detach()  # (B, 1) VarGrad log Z: no gradient
    loss = (log_z + delta).pow(2).mean()               # scalar: mean over the B*K responses
    return loss, {"log_z": log_z.squeeze(1)}           # (), {(B,)}


# ===== baselines (for the off-policy study, tools/bench.py part 7) ===============================
def rloo_loss(logp, logp_ref, reward, beta: float, **_):
    """REINFORCE with a leave-one-out baseline (RLOO, Ahmadian et al. 2024; the "(proximal) RLOO"
    of the paper's Table 1) on the KL-regularised reward, with NO off-policy correction: what an
    on-policy method does with stale data.

        R_j   = r_j - beta (log pi_theta(y_j) - log pi_ref(y_j))   (no gradient)
        A_j   = R_j - mean_{i != j} R_i
        L     = -mean_j A_j log pi_theta(y_j)

    On the same data, grad L_TB = 2 (K - 1) / (beta K) * grad L_RLOO exactly (tests/test_loss.py):
    delta_j - mean delta = -(R_j - mean R) / beta, and A_j = K / (K - 1) (R_j - mean R).
    """
    K = logp.shape[1]
    R = (reward - beta * (logp - logp_ref)).detach()    # (B, K) KL-regularised reward
    baseline = (R.sum(dim=1, keepdim=True) - R) / (K - 1)  # (B, K) mean of the other K - 1
    advantage = R - baseline                            # (B, K)
    loss = -(advantage * logp).mean()                   # scalar
    return loss, {"kl": (logp - logp_ref).detach().mean(dim=1)}  # (B,) log pi_theta / pi_ref


def grpo_loss(logp, logp_ref, logp_behaviour, reward, length, beta: float, clip: float, **_):
    """Dr. GRPO (Liu et al. 2025: advantages r - mean r, no division by the standard deviation or
    by the length) with a clipped importance ratio against the behaviour policy, and GRPO's k3 KL
    penalty to pi_ref weighted by beta.

    The ratio is per SEQUENCE, the geometric mean of the per-token ratios (GSPO, Zheng et al.
    2025), because a trajectory carries its behaviour log-prob summed over tokens: per-token
    ratios would need per-token behaviour log-probs stored for every trajectory in the buffer.
    Each term is multiplied by the length, so that on on-policy data (ratio 1, clip inactive) the
    gradient is Dr. GRPO's exactly: mean_j A_j grad log pi_theta(y_j), summed over tokens.

        A_j = r_j - mean_i r_i
        s_j = exp((log pi_theta(y_j) - log mu(y_j)) / |y_j|)                   mu: behaviour policy
        u_j = (log pi_ref(y_j) - log pi_theta(y_j)) / |y_j|
        L   = -mean_j |y_j| min(s_j A_j, clip(s_j, 1 - eps, 1 + eps) A_j)
              + beta mean_j |y_j| (exp(u_j) - u_j - 1)
    """
    advantage = reward - reward.mean(dim=1, keepdim=True)          # (B, K) Dr. GRPO: no std
    ratio = torch.exp((logp - logp_behaviour) / length)            # (B, K) per-token geometric mean
    surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage)  # (B, K)
    u = (logp_ref - logp) / length                                 # (B, K) mean log pi_ref / pi_theta
    kl = torch.exp(u) - u - 1                                      # (B, K) k3, per token
    loss = (-surrogate * length + beta * kl * length).mean()       # scalar
    clipped = ((ratio - 1).abs() > clip).float().detach()          # (B, K)
    return loss, {"clip_frac": clipped.mean(dim=1), "kl": (-u * length).detach().mean(dim=1)}


# ===== per-token baselines and TBA′'s update in the authors' MATH code (their tba-prime, loss.py, train.py) ==
# These take per-token tensors (B, K, T), T the longest response, padded: `token_logp` (the trainer's, with
# gradient), `behaviour_logps` (each token's log-prob when it was sampled: vLLM's, by the weights that made
# it), `ref_logps` (pi_ref's, from the searcher) and `token_mask` (1 on response tokens); each response's token
# sum is divided by `normaliser` (--norm).
def normaliser(norm: str, length, prompt_length, budget: int):
    """(B, K) each response's divisor: its length (response), its prompt's and its own (sequence: the authors'
    MATH runs, their seq_lens at micro-batch 1: train.py:465-468, data.py:647, loss.py:156, 266), or the generation
    budget (Liu et al.'s Dr. GRPO constant)."""
    return {"response": length, "sequence": prompt_length + length,
            "budget": torch.full_like(length, float(budget))}[norm]


def drgrpo_loss(token_logp, behaviour_logps, token_mask, reward, length, prompt_length, is_cap: float = 8.0,
                norm: str = "response", budget: int = 1, **_):
    """Dr. GRPO as the authors ran it for MATH (their RatioConfig, loss.py:192-229): advantage r - mean r over
    the K responses (no division by the standard deviation), the per-token truncated importance ratio
    min(pi_theta / mu, c) (torch.clamp: no gradient above c, as theirs), no PPO clip, no KL; each response's
    tokens summed and divided by its normaliser N_i (`normaliser`).

        A_i = r_i - mean_j r_j
        L   = -mean_i sum_t min(pi_theta(y_it) / mu(y_it), c) A_i / N_i
    """
    advantage = reward - reward.mean(dim=1, keepdim=True)                         # (B, K)
    ratio = torch.exp(token_logp - behaviour_logps).clamp(0, is_cap)              # (B, K, T)
    N = normaliser(norm, length, prompt_length, budget)                           # (B, K)
    loss = -((ratio * token_mask).sum(-1) * advantage / N).mean()                 # scalar
    capped = ((torch.exp(token_logp - behaviour_logps) > is_cap).float() * token_mask).sum(-1) / length
    return loss, {"capped": capped.detach().mean(dim=1)}                           # (B,) share of tokens capped


def tbprime_loss(token_logp, behaviour_logps, ref_logps, token_mask, reward, length, prompt_length, beta: float,
                 importance_weights: bool = True, is_cap: float = 8.0, norm: str = "response", budget: int = 1, **_):
    """TBA′'s update as the authors wrote it for MATH (the gradient of their TB residual with log Z taken under
    the behaviour policy mu): -w_t [A_i - beta (KL_i - mean_j KL^mu_j)] per token, each response's tokens
    summed and divided by its normaliser N_i (`normaliser`). KL is the detached sequence sum of
    clamp(log pi - log pi_ref, +-10); w_t = min(pi_theta / mu, c) with importance weights (its gradient is
    w_t grad log pi), else the plain log-prob's gradient. On on-policy data it is TB's gradient up to the scale
    2 / beta and the normalisation (tests/test_loss.py); docs/departures.md says where it differs from theirs.

        A_i  = r_i - mean_j r_j
        KL_i = sum_t clamp(log pi_theta(y_it) - log pi_ref(y_it), -10, 10),  KL^mu_i the same with mu
        L    = -mean_i sum_t w_t [A_i - beta (KL_i - mean_j KL^mu_j)] / N_i
    """
    kl = ((token_logp - ref_logps).clamp(-10, 10) * token_mask).sum(-1).detach()            # (B, K)
    kl_mu = ((behaviour_logps - ref_logps).clamp(-10, 10) * token_mask).sum(-1)            # (B, K)
    coef = (reward - reward.mean(dim=1, keepdim=True)) - beta * (kl - kl_mu.mean(dim=1, keepdim=True))  # (B, K)
    surrogate = torch.exp(token_logp - behaviour_logps).clamp(0, is_cap) if importance_weights else token_logp
    N = normaliser(norm, length, prompt_length, budget)                                     # (B, K)
    loss = -((surrogate * token_mask).sum(-1) * coef / N).mean()                           # scalar
    return loss, {"kl": kl.mean(dim=1)}                                                     # (B,)


drgrpo_loss.per_token = tbprime_loss.per_token = True  # backward computes per-token log-probs for them
# the trajectories' fields each loss reads beyond the response (a searcher computes pi_ref's only for a loss that
# reads them; a resumed run's buffer must hold them): `reads`
tb_loss.reads = rloo_loss.reads = ("reward", "logp_ref")
grpo_loss.reads = ("reward", "logp_ref", "logp_behaviour")
drgrpo_loss.reads = ("reward", "behaviour_logps")
tbprime_loss.reads = ("reward", "behaviour_logps", "ref_logps")

# the Config fields each loss reads (loss_options passes them; runtime.checks refuses them with another loss); TB's
# reach it annealed, as this step's gamma and reward_temp
tb_loss.flags = ("reward_temp", "gamma_final")
grpo_loss.flags = ("clip",)
drgrpo_loss.flags = ("is_cap", "norm")
tbprime_loss.flags = ("is_cap", "importance_weights", "norm")

LOSSES = {"tb": tb_loss, "rloo": rloo_loss, "grpo": grpo_loss, "drgrpo": drgrpo_loss, "tbprime": tbprime_loss}


def loss_options(cfg, beta: float, gamma: float = 1.0, reward_temp: float = 1.0) -> dict:
    """The keyword arguments, besides the tensors, of every call of --loss: in the training step (tba.backward)
    and the start-up check (runtime.checks.loss_pools) alike. Its own `flags`' values from
    `cfg`, then this step's scheduled beta, gamma and T_R (`scheduled`) and the
    generation budget. A loss's new flag is a field of Config named in its `flags`: nothing else to wire."""
    own = {flag: getattr(cfg, flag) for flag in getattr(LOSSES[cfg.loss], "flags", ())}
    return {**own, "beta": beta, "gamma": gamma, "reward_temp": reward_temp, "budget": cfg.max_new_tokens}


# --- the loss's schedules (the authors' beta, annealed linearly; Lee et al.'s T_R and gamma) ---------------
def scheduled(cfg, step: int) -> dict:
    """This step's beta, gamma and T_R, by keyword: what `loss_options` adds to a loss's own flags."""
    return dict(beta=beta_at(cfg, step), gamma=gamma_at(cfg, step), reward_temp=reward_temp_at(cfg, step))


def linear(start: float, end: float, step: int, steps: float) -> float:
    """`start` at step 0, linearly to `end` at step `steps`, then `end`; `end` throughout if `steps` is 0."""
    return start + (end - start) * (min(1.0, step / steps) if steps else 1.0)


def beta_at(cfg, step: int) -> float:
    if cfg.beta_stop_step and step + 1 >= cfg.beta_stop_step:  # `step` updates done: this is update step + 1
        return cfg.beta_final  # the authors' TL;DR jump (src/tba_trainer_tldr.py:576-580)
    return linear(cfg.beta, cfg.beta_final, step, cfg.beta_anneal_steps)


def reward_temp_at(cfg, step: int) -> float:
    """T_R: --reward-temp at step 0, then linearly to 1 (Lee et al.'s get_total_reward_temp,
    trainers/gfn_trainer.py:253-258; their steps count from 1, ours from 0 like beta_at's); constant without
    an anneal length (one without end), so that --reward-temp alone does what it says."""
    return linear(cfg.reward_temp, 1.0, step, cfg.reward_temp_anneal_steps or float("inf"))


def gamma_at(cfg, step: int) -> float:
    """gamma: 1 at step 0, then linearly to --gamma-final (their get_lm_reward_temp, gfn_trainer.py:260-264)."""
    return linear(1.0, cfg.gamma_final, step, cfg.gamma_anneal_steps)


def reads(loss) -> tuple:
    """The fields a loss reads (its `reads`; one without: every number field, and a per-token one pi_ref's too)."""
    return getattr(loss, "reads", ("reward", "logp_ref", "logp_behaviour") +
                   (("behaviour_logps", "ref_logps") if getattr(loss, "per_token", False) else ()))


# ===== log-probs ====================================================================================
def token_logprobs(logits, targets, temperature: float):
    """log softmax(logits / temperature) at `targets`: (N, C, V), (N, C) -> (N, C), in float32."""
    x = logits.float() / temperature                                          # (N, C, V)
    return x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - x.logsumexp(-1)  # (N, C)


def chunks(logits, chunk_bytes: int = 2**28):
    """The slices of positions of (N, T, V) `logits` whose float32 copy holds at most `chunk_bytes` each: a full
    float32 copy is 2 GB at GSM8K's 20 x 750 tokens x 32k vocabulary, so the log-softmax goes a chunk at a time."""
    N, T, V = logits.shape
    C = max(1, chunk_bytes // (4 * N * V))  # positions per chunk
    return [slice(s, s + C) for s in range(0, T, C)]


def next_token_logprobs(model, input_ids, attention_mask, temperature: float, chunk_bytes: int = 2**28):
    """(slice of positions, (N, C) log-probs of the next tokens from logits / temperature), chunk by chunk, each
    float32 log-softmax recomputed in the backward pass: the only (N, T, V) tensor kept is the model's logits."""
    # use_cache=False: no KV cache built on a scoring pass (models whose config says use_cache build one)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]  # (N, T-1, V)
    targets = input_ids[:, 1:]                                                        # (N, T-1): token t+1
    for at in chunks(logits, chunk_bytes):
        args = (logits[:, at], targets[:, at], temperature)
        yield at, (torch.utils.checkpoint.checkpoint(token_logprobs, *args, use_reentrant=False)
                   if torch.is_grad_enabled() else token_logprobs(*args))            # (N, C)


def response_logprobs(model, input_ids, attention_mask, response_mask, temperature: float, starts, lengths,
                      chunk_bytes: int = 2**28):
    """Each response token's log-prob, from logits / temperature: (N, R), R the longest response, 0 after each
    response's end. `starts`: where each response begins in input_ids; `lengths`: its tokens."""
    positions = torch.cat([lp for _, lp in next_token_logprobs(model, input_ids, attention_mask, temperature,
                                                                chunk_bytes)], dim=1)  # (N, T-1)
    T1, R = positions.shape[1], int(max(lengths))
    at = torch.arange(R, device=positions.device)                                     # (R,)
    index = (torch.as_tensor(starts, device=positions.device)[:, None] - 1 + at).clamp(max=T1 - 1)  # (N, R)
    mask = (at < torch.as_tensor(lengths, device=positions.device)[:, None]).float()  # (N, R)
    return positions.gather(1, index) * mask                                          # (N, R)


def sequence_logprobs(model, input_ids, attention_mask, response_mask, temperature: float,
                      chunk_bytes: int = 2**28):
    """Summed log-prob of each sequence's response tokens, from logits / temperature: (N,). The masks are (N, T),
    prompt, response, right padding; response_mask is 1 on response tokens (EOS included)."""
    mask = response_mask[:, 1:]                                                       # (N, T-1): token t+1
    total = torch.zeros(len(input_ids), device=input_ids.device)                      # (N,)
    for at, lp in next_token_logprobs(model, input_ids, attention_mask, temperature, chunk_bytes):
        total = total + (lp * mask[:, at]).sum(dim=1)
    return total                                                                      # (N,)


# ===== batching sequences ===========================================================================
def unique_pairs(trajectories, prompts) -> tuple[list, list[int]]:
    """The distinct (prompt, response) pairs among `trajectories`, and each trajectory's index into
    them: log-probs are computed once per distinct sequence (sampling repeats short answers often)."""
    first = {}  # (prompt id, response bytes) -> (its pair's index, its first trajectory)
    index = [first.setdefault((t.prompt_id, t.response.tobytes()), (len(first), t))[0] for t in trajectories]
    return [(prompts[t.prompt_id], t.response) for _, t in first.values()], index


def collate(pairs, pad: int, device):
    """(prompt, response) pairs -> input_ids, attention_mask, response_mask, each (N, T), right-padded."""
    seqs = [torch.cat([torch.as_tensor(p).long(), torch.as_tensor(r).long()]) for p, r in pairs]
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pad)          # (N, T)
    at, ends = torch.arange(ids.shape[1]), torch.tensor([len(s) for s in seqs])[:, None]      # (T,), (N, 1)
    starts = torch.tensor([len(p) for p, _ in pairs])[:, None]                                   # (N, 1)
    return ids.to(device), (at < ends).long().to(device), ((at >= starts) & (at < ends)).long().to(device)
