"""The replay buffer: one test per rule, and seeded statistical tests of its sampling frequencies."""

import math

import numpy as np
import pytest

from buffer import ReplayBuffer, ReuseCap, Trajectory


def traj(prompt, tokens, reward=0.0, version=0):
    return Trajectory(prompt_id=prompt, response=np.array(tokens, dtype=np.int32), reward=reward,
                      logp_ref=0.0, logp_behaviour=0.0, version=version)


def test_capacity_keeps_the_newest():
    buf = ReplayBuffer(capacity=5, recency=0.0, reward_inv_temp=0.0)
    buf.add([traj(0, [i]) for i in range(8)])
    kept = [int(t.response[0]) for t, _ in buf.groups[0].values()]
    assert kept == [3, 4, 5, 6, 7] and len(buf) == 5


def test_exact_duplicates_keep_the_newest_copy():
    buf = ReplayBuffer(capacity=10, recency=0.0, reward_inv_temp=0.0)
    buf.add([traj(0, [1, 2], reward=0.0, version=0), traj(0, [1, 3], version=0)])
    buf.add([traj(0, [1, 2], reward=1.0, version=4)])
    items = [t for t, _ in buf.groups[0].values()]
    assert len(buf) == 2 and len(items) == 2
    newest = items[-1]  # the duplicate moved to the newest position, with the newer values
    assert newest.response.tolist() == [1, 2] and newest.reward == 1.0 and newest.version == 4
    buf.add([traj(0, [1, 2, 0])])  # a longer response is not a duplicate
    assert len(buf) == 3


def test_memory_is_bounded_by_capacity_times_prompts():
    buf = ReplayBuffer(capacity=4, recency=0.5, reward_inv_temp=1.0)
    rng = np.random.default_rng(0)
    for _ in range(200):
        buf.add([traj(int(rng.integers(10)), rng.integers(0, 50, 3).tolist()) for _ in range(16)])
    assert len(buf) <= 4 * 10
    assert len(buf) == sum(len(g) for g in buf.groups.values())


def test_recent_means_added_since_the_last_sync():
    buf = ReplayBuffer(capacity=100, recency=1.0, reward_inv_temp=0.0)
    buf.add([traj(p, [p, j]) for p in range(5) for j in range(4)])  # window 0: prompts 0-4
    buf.mark_sync()
    buf.add([traj(p, [p, j, 9]) for p in (7, 8) for j in range(4)])  # window 1: prompts 7, 8
    buf.add([traj(3, [3, 0, 9])])                                      # prompt 3 gets one new response
    rng = np.random.default_rng(0)
    for _ in range(50):
        for group in buf.sample(3, 4, rng):
            assert group[0].prompt_id in (7, 8, 3)
            assert all(len(t.response) == 3 for t in group)  # only responses added after the sync
    groups = [g for _ in range(50) for g in buf.sample(3, 4, rng) if g[0].prompt_id == 3]
    assert groups and all(len({t.response.tobytes() for t in g}) == 1 for g in groups)  # 1 recent: replaced


def test_until_new_data_arrives_recent_is_the_newest_data():
    buf = ReplayBuffer(capacity=100, recency=1.0, reward_inv_temp=0.0)
    buf.add([traj(0, [0, j]) for j in range(4)])
    buf.mark_sync()
    buf.add([traj(1, [1, j]) for j in range(4)])
    buf.mark_sync()  # nothing added since this sync
    rng = np.random.default_rng(1)
    assert {g[0].prompt_id for _ in range(30) for g in buf.sample(1, 2, rng)} == {1}


def test_replacement_only_when_fewer_than_k_distinct():
    buf = ReplayBuffer(capacity=100, recency=0.0, reward_inv_temp=0.0)
    buf.add([traj(0, [j]) for j in range(3)] + [traj(1, [j]) for j in range(10)])
    rng = np.random.default_rng(2)
    for _ in range(20):
        for group in buf.sample(2, 6, rng):
            distinct = len({t.response.tobytes() for t in group})
            assert len(group) == 6
            assert distinct == 6 if group[0].prompt_id == 1 else distinct <= 3


def test_prompts_are_distinct_within_a_batch_while_there_are_enough():
    buf = ReplayBuffer(capacity=100, recency=0.5, reward_inv_temp=0.0)
    buf.add([traj(p, [j]) for p in range(6) for j in range(2)])
    rng = np.random.default_rng(3)
    for _ in range(50):
        assert sorted(g[0].prompt_id for g in buf.sample(6, 2, rng)) == list(range(6))
    assert len(buf.sample(9, 2, rng)) == 9  # more prompts asked than held: repeats, no error


def chi_square_p(counts, probs):
    """p-value of Pearson's chi-square test for 3 categories (2 degrees of freedom: exp(-stat / 2))."""
    assert len(counts) == 3
    n = sum(counts)
    stat = sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))
    return math.exp(-stat / 2)


def test_sampling_frequencies_recency_and_reward_softmax():
    """Seeded: prompt frequencies follow m, response frequencies follow softmax(reward x inv_temp)."""
    m, inv_temp = 0.7, 1.5
    buf = ReplayBuffer(capacity=100, recency=m, reward_inv_temp=inv_temp)
    buf.add([traj(p, [p, j], reward=float(j)) for p in range(10) for j in range(3)])  # old: prompts 0-9
    buf.mark_sync()
    buf.add([traj(p, [p, j], reward=float(j)) for p in range(10, 20) for j in range(3)])  # recent: 10-19
    rng = np.random.default_rng(1234)
    recent_prompt, response_counts, old_counts = 0, np.zeros(3), np.zeros(3)
    draws = 20000
    for _ in range(draws):
        (group,) = buf.sample(1, 4, rng)  # K=4 > 3 distinct: with replacement, i.i.d. draws
        if group[0].prompt_id >= 10:
            recent_prompt += 1
        else:  # an old prompt can only come from a whole-buffer draw: reward softmax
            for t in group:
                old_counts[int(t.response[1])] += 1
        for t in group:
            response_counts[int(t.response[1])] += 1
    # P(recent prompt) = m + (1 - m) * 10/20 (whole-buffer draws pick any prompt uniformly)
    p = m + (1 - m) * 0.5
    assert abs(recent_prompt - draws * p) < 5 * math.sqrt(draws * p * (1 - p))
    softmax = np.exp(inv_temp * np.arange(3)) / np.exp(inv_temp * np.arange(3)).sum()
    assert chi_square_p(old_counts, softmax) > 1e-4
    # recent draws are uniform, whole-buffer draws follow the softmax: the mixture over all draws
    mix = m * np.full(3, 1 / 3) + (1 - m) * softmax
    assert chi_square_p(response_counts, mix) > 1e-4
    assert chi_square_p(response_counts, np.full(3, 1 / 3)) < 1e-6  # and it is not uniform


def test_sample_from_empty_buffer_is_an_error():
    with pytest.raises(AssertionError):
        ReplayBuffer(10, 0.5, 0.0).sample(1, 2, np.random.default_rng(0))


def test_reuse_cap_keeps_draws_within_r_times_the_data_received():
    """--max-reuse R: a step of B x K draws is taken only while the draws stay within R times the
    trajectories received, over the run; whatever arrives, the trainer never gets ahead of that."""
    B_K, R = 256, 1.3
    cap = ReuseCap(R, bank=2 * B_K)
    rng = np.random.default_rng(0)
    received = steps = 0
    for _ in range(2000):
        received += int(rng.choice([0, 0, 0, 72, 216]))  # rounds arrive in bursts, or not at all
        cap.receive(received)
        while cap.allows(B_K):
            cap.draw(B_K)
            steps += 1
            assert cap.drawn <= R * received + 1e-6
    assert cap.drawn == steps * B_K and cap.counted == received
    assert cap.drawn > 0.95 * R * received - 2 * B_K  # and it uses what it is allowed: nothing is lost but the bank's excess


def test_reuse_cap_arithmetic_and_bank():
    cap = ReuseCap(1.0, bank=512)
    assert not cap.allows(256)           # nothing received yet
    cap.receive(256)
    assert cap.allows(256) and not cap.allows(257)
    cap.draw(256)
    assert not cap.allows(256) and cap.drawn == 256
    cap.receive(256)                     # the same count again earns nothing
    assert not cap.allows(256)
    cap.receive(100_000)                 # a compute-bound stretch: data piles up while the trainer is busy ...
    for _ in range(2):                   # ... but only the bank (k steps' draws here) is kept:
        assert cap.allows(256)           # two steps, then the trainer waits for new data
        cap.draw(256)
    assert not cap.allows(256) and cap.credit == 0
    authors = ReuseCap(2 * 7 * 20 / (3 * 72), bank=280)  # the authors' GSM8K ratio: 280 draws per 216 made
    authors.receive(216)
    assert authors.allows(280)           # R x received is not a whole number: 1.296... x 216 = 280
    off = ReuseCap(0.0, bank=0)
    assert off.allows(10**9)             # R = 0: no cap
    off.draw(256)
    assert off.drawn == 256 and off.credit == 0
