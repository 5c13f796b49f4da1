"""The replay buffer: one test per rule, and seeded statistical tests of its sampling frequencies."""

import json
import math
import threading

import numpy as np
import pytest

from buffer import ReplayBuffer, ReuseCap, Trajectory
from tasks.redteam import BestBuffer


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


def test_recent_covers_b_prompts_when_rounds_are_smaller_than_a_batch():
    """N searchers' rounds of B / N prompts arrive one by one: right after a sync only one has come, and the
    recent pool reaches back to the windows before it until it covers B prompts (distinct in the batch);
    older windows and the responses of other windows to those prompts stay out."""
    buf = ReplayBuffer(capacity=100, recency=1.0, reward_inv_temp=0.0)
    buf.add([traj(p, [p, j]) for p in (0, 1) for j in range(4)])       # window 0: prompts 0, 1
    buf.mark_sync()
    buf.add([traj(p, [p, j, 1]) for p in (2, 3) for j in range(4)])    # window 1: prompts 2, 3
    buf.add([traj(p, [p, j, 1]) for p in (4, 5) for j in range(4)])    # window 1: prompts 4, 5
    buf.mark_sync()
    buf.add([traj(p, [p, j, 2, 2]) for p in (6, 7) for j in range(4)])  # window 2: prompts 6, 7
    assert buf.recent(2) == (2, [6, 7]) and buf.recent(4) == (1, [2, 3, 4, 5, 6, 7])  # whole windows
    rng = np.random.default_rng(0)
    for _ in range(30):
        batch = buf.sample(4, 4, rng)
        assert len({g[0].prompt_id for g in batch}) == 4  # distinct: 6 recent prompts for 4
        assert all(g[0].prompt_id >= 2 and len(g[0].response) >= 3 for g in batch)  # windows 1 and 2 only
    buf.add([traj(6, [6, 0])])  # an old response again: its prompt's newest window is now 2 still
    assert buf.recent(8) == (0, [0, 1, 2, 3, 4, 5, 7, 6])  # fewer than 8 prompts in all: every window


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
# --- --buffer-keep best: Lee et al.'s buffer of the best attacks -----------------------------------------
def scored(prompt, tokens, reward, logp_ref=0.0, embedding=None):
    t = traj(prompt, tokens, reward)
    t.logp_ref, t.embedding = logp_ref, None if embedding is None else np.asarray(embedding, np.float32)
    return t


def best_set(buf, prompt=0):
    return sorted(t.response.tolist() for t, _ in buf.best_of(prompt).values())


def test_best_keeps_the_highest_log_r():
    """log R = logp_ref + reward / beta ranks (not the reward alone); the newest groups are untouched."""
    buf = BestBuffer(capacity=3, recency=0.0, reward_inv_temp=0.0, beta=0.5)
    rows = [([1], -1.0, 0.0), ([2], -0.2, -5.0), ([3], -0.5, 0.0), ([4], -3.0, 0.0), ([5], 0.0, -0.1)]
    buf.add([scored(0, tokens, r, ref) for tokens, r, ref in rows])
    # log R: [1] -2, [2] -5.4, [3] -1, [4] -6, [5] -0.1
    assert best_set(buf) == [[1], [3], [5]] and len(buf) == 3
    assert [t.response.tolist() for t, _ in buf.groups[0].values()] == [[3], [4], [5]]  # the newest, as before
    buf.add([scored(0, [6], -0.25)])  # log R -0.5 pushes out [1] (-2)
    assert best_set(buf) == [[3], [5], [6]]
    buf.add([scored(0, [5], 10.0)])   # an exact duplicate: the copy held stays (theirs)
    assert next(t for t, _ in buf.best_of(0).values() if t.response.tolist() == [5]).reward == 0.0


def test_near_duplicates_keep_the_better_one():
    """Edit distance below `edit` x the two lengths, or embedding cosine above `similarity`: the nearest held
    one is replaced by a better newcomer, in its place, and a worse newcomer is dropped."""
    buf = BestBuffer(capacity=10, recency=0.0, reward_inv_temp=0.0, beta=1.0, edit=0.25)
    buf.add([scored(0, [1, 2, 3, 4], -2.0), scored(0, [7, 8, 9, 10], -2.0)])
    buf.add([scored(0, [1, 2, 3, 5], -3.0)])   # distance 1 < 0.25 x 8, worse: dropped
    assert best_set(buf) == [[1, 2, 3, 4], [7, 8, 9, 10]]
    buf.add([scored(0, [1, 2, 3, 5], -1.0)])   # better: replaces [1, 2, 3, 4]
    assert best_set(buf) == [[1, 2, 3, 5], [7, 8, 9, 10]]
    buf.add([scored(0, [1, 2, 6, 6], -0.5)])   # distance 2 from [1, 2, 3, 5]: not below 2, so it joins
    assert best_set(buf) == [[1, 2, 3, 5], [1, 2, 6, 6], [7, 8, 9, 10]] and len(buf) == 3
    cos = BestBuffer(capacity=10, recency=0.0, reward_inv_temp=0.0, beta=1.0, similarity=0.8)
    cos.add([scored(0, [1], -2.0, embedding=[1, 0]), scored(0, [2], -2.0, embedding=[0, 1])])
    cos.add([scored(0, [3], -1.0, embedding=[0.6, 0.8])])   # cosine 0.8 with [2]: not above, joins
    cos.add([scored(0, [4], -1.0, embedding=[0.96, 0.28])])  # cosine 0.96 with [1]: better, replaces it
    assert best_set(cos) == [[2], [3], [4]]
    plain = BestBuffer(capacity=10, recency=0.0, reward_inv_temp=0.0, beta=1.0)
    plain.add([scored(0, [1, 2, 3, 4], -2.0), scored(0, [1, 2, 3, 5], -3.0)])  # no rule: only exact duplicates
    assert len(plain) == 2


def test_copies_share_a_best_set_and_recent_draws_stay_fresh():
    """B copies of one prompt share one best set; a recent draw takes the data since the last sync, also
    the attacks too poor to enter the best set (TB needs them), a whole-buffer draw the best set by reward."""
    buf = BestBuffer(capacity=2, recency=1.0, reward_inv_temp=0.0, beta=1.0, group_of=[0, 0, 0])
    buf.add([scored(p, [p, 10 + p], 0.0) for p in range(3)])
    buf.mark_sync()
    poor = [scored(p, [p, 20 + p], -50.0) for p in range(3)]
    buf.add(poor)
    assert best_set(buf, 2) == best_set(buf, 0) and len(buf) == 2 and list(buf.best) == [0]
    rng = np.random.default_rng(0)
    assert {t.reward for g in buf.sample(3, 1, rng) for t in g} == {-50.0}  # recent: the poor fresh ones
    buf.recency = 0.0
    assert {t.reward for _ in range(20) for g in buf.sample(3, 2, rng) for t in g} == {0.0}  # the best set


def test_best_buffer_checkpoint_round_trip():
    """state() / from_state(): plain arrays (embeddings included), the settings by name, that give back the same
    buffer and the same draws; a state is read back as its own kind of buffer only."""
    buf = BestBuffer(capacity=3, recency=0.5, reward_inv_temp=1.0, beta=0.1, similarity=0.9, edit=0.2,
                     group_of=[0, 0, 2])
    rng = np.random.default_rng(5)
    for round_ in range(6):
        buf.add([scored(int(rng.integers(3)), rng.integers(0, 9, 4).tolist(), float(rng.normal()), float(rng.normal()),
                        embedding=(e := rng.normal(size=4)) / np.linalg.norm(e)) for _ in range(8)])
        buf.mark_sync()
    s = buf.state()
    assert all(isinstance(v, np.ndarray) and v.dtype != object for v in s.values())
    assert str(s["dropped"]) == "[]" and str(s["more"]) == "{}"  # every attribute is written by its own state()
    back = BestBuffer.from_state(s)
    for name in ("capacity", "recency", "reward_inv_temp", "beta", "similarity", "edit", "group_of", "window",
                 "last_window", "prompts", "size", "best_size", "pi_ref_version"):
        assert getattr(back, name) == getattr(buf, name), name
    for a, b in [(buf.groups, back.groups), (buf.best, back.best)]:
        assert list(a) == list(b)
        for p in a:
            assert list(a[p]) == list(b[p])
            assert all(np.array_equal(x.embedding, y.embedding) and (x.reward, x.logp_ref, w) == (y.reward, y.logp_ref, v)
                       for (x, w), (y, v) in zip(a[p].values(), b[p].values()))
    draw = lambda b: [[t.response.tolist() for t in g] for g in b.sample(3, 2, np.random.default_rng(9))]
    assert draw(buf) == draw(back)
    with pytest.raises(ValueError, match="a BestBuffer's state, not a ReplayBuffer's"):
        ReplayBuffer.from_state(s)
    plain = ReplayBuffer(4, 0.5, 0.0)
    plain.add([scored(1, [1, 2], 0.5)])
    assert [t.response.tolist() for t, _ in ReplayBuffer.from_state(plain.state()).groups[1].values()] == [[1, 2]]


class Counted(ReplayBuffer):
    """A researcher's change: each response's draws for training so far, kept in an attribute of the buffer."""
    def __init__(self, *args, **knobs):
        super().__init__(*args, **knobs)
        self.draws: dict[tuple, int] = {}  # (prompt id, response bytes) -> draws
        self.seen = np.zeros((0, 2), np.int64)
        self.lock = threading.Lock()  # no plain data

    def sample(self, B, K, rng):
        batch = super().sample(B, K, rng)
        for t in (t for g in batch for t in g):
            self.draws[t.prompt_id, t.response.tobytes()] = self.draws.get((t.prompt_id, t.response.tobytes()), 0) + 1
        self.seen = np.concatenate([self.seen, [[len(self.draws), B]]])
        return batch


def test_a_researchers_buffer_attribute_survives_a_checkpoint(tmp_path):
    """Every attribute of the buffer that its state() does not write itself is saved as plain data (no pickle) and
    read back as it was, a draw count per response among them; one that is no plain data is named as dropped
    (the save and the resume say so in one line) and starts afresh."""
    buf = Counted(capacity=4, recency=0.5, reward_inv_temp=0.0)
    rng = np.random.default_rng(0)
    buf.add([traj(p, rng.integers(0, 5, 3).tolist()) for p in range(5) for _ in range(4)])
    for _ in range(3):
        buf.sample(3, 4, rng)
    np.savez(tmp_path / "buffer.npz", **buf.state())
    with np.load(tmp_path / "buffer.npz", allow_pickle=False) as f:
        s = dict(f)
    back = Counted.from_state(s)
    assert back.draws == buf.draws and sum(back.draws.values()) == 3 * 3 * 4
    assert back.seen.dtype == np.int64 and np.array_equal(back.seen, buf.seen) and back.lock is not buf.lock
    assert json.loads(str(s["dropped"])) == ["lock (a lock, not plain data)"]
    draw = lambda b: [[t.response.tolist() for t in g] for g in b.sample(3, 2, np.random.default_rng(9))]
    assert draw(back) == draw(buf) and back.draws == buf.draws


def test_edit_distances_match_a_plain_levenshtein():
    from tasks.redteam import edit_distances

    def levenshtein(a, b):
        d = list(range(len(b) + 1))
        for i in range(1, len(a) + 1):
            prev, d[0] = d[0], i
            for j in range(1, len(b) + 1):
                prev, d[j] = d[j], min(d[j] + 1, d[j - 1] + 1, prev + (a[i - 1] != b[j - 1]))
        return d[len(b)]
    rng = np.random.default_rng(0)
    for _ in range(100):
        a = rng.integers(0, 4, rng.integers(0, 8))
        rows = [rng.integers(0, 4, rng.integers(0, 9)) for _ in range(5)]
        got = edit_distances(a, rows, np.array([len(r) for r in rows]))
        assert got.tolist() == [levenshtein(a.tolist(), r.tolist()) for r in rows]


def test_the_reuse_cap_earns_credit_only_for_what_the_buffer_kept():
    """TBA′: after a reset the buffer drops the data still in flight that was scored under the old pi_ref. The cap
    earns credit only for the trajectories it kept (runtime.fleet.Fleet.add counts them, tba.Trainer.waiting_for
    feeds that count to the cap): fed the count received, a burst of dropped data would pay for steps of replay."""
    import types

    import tba
    from runtime.config import Config
    from runtime.evaluations import Asked
    from runtime.fleet import Fleet
    B, K = 2, 4
    buf = ReplayBuffer(100, recency=1.0, reward_inv_temp=0.0)
    buf.set_reference(4)  # pi_ref is the policy of step 4
    fleet = Fleet.__new__(Fleet)  # its counters only: no searcher is spawned
    fleet.received, fleet.kept, fleet.tokens, fleet.newest, fleet.cfg = 0, 0, 0, 4, Config()
    fleet.evals = Asked(fleet)
    old = [traj(p, [100 + i], version=3) for p in range(B) for i in range(2 * K)]  # scored under pi_ref 0
    for t in old:
        t.pi_ref_version = 0
    new = [traj(p, [i], version=4) for p in range(B) for i in range(K)]
    for t in new:
        t.pi_ref_version = 4
    fleet.add(buf, old + new)
    assert (fleet.received, fleet.kept, len(buf)) == (3 * B * K, B * K, B * K)
    trainer = types.SimpleNamespace(cfg=Config(prompts_per_step=B, samples_per_prompt=K, max_reuse=1.0), fleet=fleet,
                                    buffer=buf, cap=ReuseCap(1.0, bank=100 * B * K), step=4, held_since=None,
                                    initial=0)
    assert tba.Trainer.waiting_for(trainer) is None  # one step's worth was kept: one step
    trainer.cap.draw(B * K)
    assert tba.Trainer.waiting_for(trainer).startswith("fresh data: 8 trajectories drawn for training, 8 kept")


def test_draws_follow_the_searchers_multiplicities():
    """--duplicates count: a response the searchers sent 6 times out of 8 fills about 6 / 8 of a group's draws, as
    the raw rounds would (collapse: one copy like any other, about 1 / 3), recent and whole-buffer draws alike; a
    checkpoint keeps the counts."""
    from buffer import draw
    counts = {}
    for mode in ("count", "collapse"):
        for recency in (1.0, 0.0):
            buf = ReplayBuffer(capacity=10, recency=recency, reward_inv_temp=0.0, duplicates=mode)
            buf.add([traj(0, [5]) for _ in range(6)] + [traj(0, [6]), traj(0, [7])])
            buf = ReplayBuffer.from_state(buf.state())
            assert len(buf) == 3 and buf.multiplicity(0) == {np.array([5], np.int32).tobytes(): 6,
                                                             np.array([6], np.int32).tobytes(): 1,
                                                             np.array([7], np.int32).tobytes(): 1}
            rng = np.random.default_rng(0)
            drawn = [int(t.response[0]) for _ in range(400) for t in buf.sample(1, 4, rng)[0]]
            counts[mode, recency] = drawn.count(5) / len(drawn)
    for recency in (1.0, 0.0):
        assert abs(counts["count", recency] - 6 / 8) < 0.04, counts
        assert abs(counts["collapse", recency] - 1 / 3) < 0.04, counts
    # without replacement from the multiset: 8 copies, K = 8 draws take each copy once
    assert sorted(draw(np.array([6, 1, 1]), np.ones(3), 8, np.random.default_rng(1))) == [0] * 6 + [1, 2]


def test_the_recent_pool_counts_only_its_windows_copies():
    buf = ReplayBuffer(capacity=10, recency=1.0, reward_inv_temp=0.0)
    buf.add([traj(0, [5]) for _ in range(5)])
    buf.mark_sync()
    buf.add([traj(0, [5]), traj(0, [6])])  # one copy of each since the sync
    key = lambda r: np.array([r], np.int32).tobytes()
    assert buf.multiplicity(0, since=1) == {key(5): 1, key(6): 1} and buf.multiplicity(0)[key(5)] == 6


def test_a_lag_round_is_used_once_when_two_rounds_share_a_prompt():
    """--lag: two searchers' rounds both drew prompt 7 (n = 2 each), the second also 5 and 9: each trajectory is in
    at most one group of the batch, and every group is n responses of one prompt; rounds of a step already trained
    are dropped on arrival, and a checkpoint keeps none of the steps to come."""
    buf = ReplayBuffer(capacity=10, recency=1.0, reward_inv_temp=0.0)
    rounds = [traj(p, [p, i, s], version=0) for s, prompts in ((0, [7, 3]), (1, [7, 5, 9])) for p in prompts
              for i in range(2)]
    for t in rounds:
        t.for_step = 4
    buf.add(rounds)
    batch = buf.sample_round(4, 4, 2, 2, np.random.default_rng(0))
    used = [id(t) for g in batch for t in g]
    assert len(used) == len(set(used)) == 8  # B = 4 groups of K = 2, no trajectory twice
    assert all(len({t.prompt_id for t in g}) == 1 for g in batch)
    assert sorted(g[0].prompt_id for g in batch) in ([3, 5, 7, 7], [3, 7, 7, 9], [5, 7, 7, 9], [3, 5, 7, 9])
    late = traj(1, [1], version=0)
    late.for_step = 4
    ahead = traj(1, [2], version=1)
    ahead.for_step = 6
    assert buf.add([late, ahead]) == [ahead] and buf.waiting(4) == 0 and buf.waiting(6) == 1
    back = ReplayBuffer.from_state(buf.state())
    assert back.waiting() == 0 and back.next_round == 5  # remade by the resumed searchers, with the same seeds


def test_collapse_draws_the_recent_pool_as_the_authors_buffer_did():
    """--duplicates collapse, recent draws: NumPy's uniform choice without a p, not with an explicit uniform p,
    which draws another stream: a seeded run keeps the batches it had before the multiplicities came."""
    buf = ReplayBuffer(capacity=10, recency=1.0, reward_inv_temp=0.0, duplicates="collapse")
    buf.add([traj(0, [j]) for j in range(6)])
    drawn = [int(t.response[0]) for t in buf.sample(1, 3, np.random.default_rng(4))[0]]
    rng = np.random.default_rng(4)
    rng.random(), rng.integers(1)  # recent or not, the prompt
    assert drawn == rng.choice(6, size=3, replace=False).tolist()


def test_a_reward_that_is_not_finite_stops_the_run_in_one_line():
    """Issue 67 item 10: a task's reward of NaN went into the buffer and ended in a traceback from its draw ("Probabilities
    contain NaN"), with no checkpoint. The trainer refuses the round with a line naming the reward (Dead: the run stops
    after a checkpoint), and the buffer never holds it."""
    from types import SimpleNamespace
    from runtime.errors import Dead
    from runtime.fleet import Fleet
    fleet = SimpleNamespace(cfg=SimpleNamespace(task="arith"), received=0, kept=0, tokens=0)
    buf = ReplayBuffer(capacity=10, recency=0.5, reward_inv_temp=1.0)
    Fleet.add(fleet, buf, [traj(0, [1, 2], 1.0)])
    with pytest.raises(Dead, match=r"^the arith task's reward is nan for a response to training prompt 3: a reward "
                                   r"must be a finite number$"):
        Fleet.add(fleet, buf, [traj(2, [1], 0.5), traj(3, [1, 2], math.nan)])
    assert fleet.received == 1 and sorted(buf.prompts) == [0]
