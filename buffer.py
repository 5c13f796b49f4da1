"""TBA's replay buffer: every trajectory the searchers made, grouped by prompt, and its sampling.

Rules (the paper, Sec. 3.2, and the authors' `buffer_utils.py`):
- One group per prompt, holding the newest `capacity` trajectories; an exact token duplicate of a
  response already in the group replaces it (the newest copy is kept). Memory is bounded by
  capacity x the number of prompts in the data set.
- A training batch is B prompts x K responses. For each of the B prompts, independently:
  with probability m (`recency`) a prompt with data added since the last weight sync, and K of
  those recent responses drawn uniformly; otherwise a prompt of the whole buffer, and K of its
  responses drawn by softmax(reward x `reward_inv_temp`) (0 = uniform). Draws are without
  replacement where the pool holds at least K responses, with replacement where it holds fewer.
- Departure from the authors' MPI code, where data reaches the trainer only at a sync: here it
  streams in, so right after a sync little or nothing is "recent" yet. The recent pool is the data
  of the newest windows (a window: the data added between two syncs) that together cover B prompts:
  the data since the last sync if it covers B, else that of the windows before it too, so that a
  batch's recent prompts are distinct while N searchers' rounds of B / N prompts arrive one by one.
- Prompts are distinct within a batch while the pool has enough of them.
- TBA′ (reference-policy resetting): every trajectory records the pi_ref that scored it; at a
  reset the buffer is emptied and only data scored under the new pi_ref is kept, so that no TB
  group mixes log-probs under two references (recomputing them would need pi_ref in the trainer).
- `--buffer-keep best` (Lee et al.'s red-teaming buffer, their utils.py:289-480): beside the newest
  data, which the recent draws keep using, each prompt has a set of its best `capacity` trajectories
  by log R = logp_ref + reward / beta (at gamma = T_R = 1, as theirs ranks), from which the
  whole-buffer draws come. A newcomer that is an exact duplicate of one held is dropped (theirs keeps
  the copy held); one that is a near-duplicate of one held (embedding cosine above `similarity`, or
  token edit distance below `edit` x the two lengths; the nearest held one) replaces it if its log R
  is higher and is dropped otherwise; else it joins, and the lowest log R leaves when the set is
  full. Copies of one prompt (red-teaming searches one instruction as B copies) share one set
  (`group_of`). Departures: theirs takes the first near-duplicate in heap order, ours the nearest;
  their edit distance leaves EOS out, ours counts it as a token.
- Checkpoints store the buffer as plain arrays (`state`, `from_state`): no pickle, no code.
- `ReuseCap` (--max-reuse R): the trainer learns only as fast as data arrives. It draws at most R
  times the trajectories it has received, counted over the run, so scarce data is not replayed
  without bound (the authors' trainer gets the same bound by waiting at each sync for every
  searcher's round: docs/performance.md).
"""

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass
class Trajectory:
    prompt_id: int           # index into the task's training problems
    response: np.ndarray     # (T,) int32 response token ids, EOS included when generation stopped on it
    reward: float            # r(y, x)
    logp_ref: float          # log pi_ref(y|x), summed over response tokens, from logits / temperature
    logp_behaviour: float    # log-prob under the searcher's policy that sampled y (vLLM's, same temperature)
    version: int             # trainer step whose weights sampled y (0 = the initial model)
    ref_version: int = 0     # trainer step whose weights were pi_ref when logp_ref was computed (TBA′)
    embedding: np.ndarray | None = None  # (H,) float32 unit sentence embedding (--dedup-similarity), else None


class ReplayBuffer:
    def __init__(self, capacity: int, recency: float, reward_inv_temp: float, keep: str = "newest",
                 beta: float = 1.0, similarity: float = 0.0, edit: float = 0.0, group_of=None):
        self.capacity, self.recency, self.reward_inv_temp = capacity, recency, reward_inv_temp
        self.keep, self.beta, self.similarity, self.edit = keep, beta, similarity, edit  # keep: newest | best
        self.group_of = None if group_of is None else [int(p) for p in group_of]  # prompt id -> its first copy's
        self.best: dict[int, OrderedDict] = {}    # keep best: first copy's id -> {response bytes: (Trajectory, window)}
        self.best_size = 0
        self.groups: dict[int, OrderedDict] = {}  # prompt id -> {response bytes: (Trajectory, window)}
        self.window = 0                           # number of weight syncs so far
        self.newest: dict[int, int] = {}          # prompt id -> the newest window with its data, oldest first
        self.prompts: list[int] = []              # every prompt with a group, in order of arrival
        self.size = 0                             # trajectories held
        self.reference = 0                        # ref_version of the data kept (TBA′)

    def add(self, trajectories: list[Trajectory]):
        for t in trajectories:
            if t.ref_version != self.reference:  # scored under another pi_ref (TBA′): not kept
                continue
            if t.prompt_id not in self.groups:
                self.groups[t.prompt_id] = OrderedDict()
                self.prompts.append(t.prompt_id)
            group = self.groups[t.prompt_id]
            key = t.response.tobytes()
            self.size -= group.pop(key, None) is not None  # exact duplicate: drop the older copy
            group[key] = (t, self.window)
            self.size += 1
            if len(group) > self.capacity:                 # keep the newest `capacity`
                group.popitem(last=False)
                self.size -= 1
            self.newest.pop(t.prompt_id, None)
            self.newest[t.prompt_id] = self.window
            if self.keep == "best":
                self.keep_best(t)

    # --- --buffer-keep best (see the module docstring) ---------------------------------------------
    def log_r(self, t: Trajectory) -> float:
        return t.logp_ref + t.reward / self.beta

    def best_of(self, prompt: int) -> OrderedDict:
        return self.best.setdefault(self.group_of[prompt] if self.group_of else prompt, OrderedDict())

    def keep_best(self, t: Trajectory):
        best, key = self.best_of(t.prompt_id), t.response.tobytes()
        if key in best:  # an exact duplicate: the copy held stays
            return
        near = self.nearest(best, t)
        if near is not None:  # a near-duplicate: the better of the two stays, in the held one's place
            if self.log_r(best[near][0]) >= self.log_r(t):
                return
            del best[near]
            best[key] = (t, self.window)
            return
        best[key] = (t, self.window)
        self.best_size += 1
        if len(best) > self.capacity:  # the lowest log R leaves (perhaps the newcomer)
            del best[min(best, key=lambda k: self.log_r(best[k][0]))]
            self.best_size -= 1

    def nearest(self, best: OrderedDict, t: Trajectory) -> bytes | None:
        """The key of the held trajectory nearest to `t` if it is a near-duplicate, else None."""
        keys, held = list(best), [x for x, _ in best.values()]
        if self.similarity and t.embedding is not None:
            have = [i for i, x in enumerate(held) if x.embedding is not None]
            if have:
                cos = np.stack([held[i].embedding for i in have]) @ t.embedding  # (n,) unit vectors
                j = int(np.argmax(cos))
                if cos[j] > self.similarity:
                    return keys[have[j]]
        if self.edit and held:
            lengths = np.array([len(x.response) for x in held])
            total = lengths + len(t.response)                                     # (n,)
            distance = edit_distances(t.response, [x.response for x in held], lengths)
            j = int(np.argmin(distance / np.maximum(total, 1)))
            if distance[j] < self.edit * total[j]:
                return keys[j]
        return None

    def mark_sync(self):
        """Called at every weight sync: data added after this is 'recent'."""
        self.window += 1

    def set_reference(self, version: int):
        """TBA′: pi_ref is now the policy of step `version`; the data scored under the old one goes."""
        window = self.window
        self.__init__(self.capacity, self.recency, self.reward_inv_temp, self.keep, self.beta, self.similarity,
                      self.edit, self.group_of)
        self.window, self.reference = window, version

    def recent(self, B: int) -> tuple[int, list[int]]:
        """(the oldest window of the recent pool, its prompts): the newest windows that cover B prompts
        (all there are if fewer)."""
        prompts, cutoff = [], None
        for prompt, window in reversed(self.newest.items()):
            if len(prompts) >= B and window != cutoff:
                break
            prompts.append(prompt)
            cutoff = window
        return cutoff, prompts[::-1]

    def __len__(self):
        """Trajectories held for the whole-buffer draws: the newest, or the best sets."""
        return self.best_size if self.keep == "best" else self.size

    def sample(self, B: int, K: int, rng: np.random.Generator) -> list[list[Trajectory]]:
        """B groups of K trajectories, each group from one prompt (see the module docstring)."""
        assert self.groups, "sample() from an empty buffer"
        cutoff, recent_prompts = self.recent(B)
        chosen: set[int] = set()
        batch = []
        for _ in range(B):
            recent = rng.random() < self.recency
            prompt = pick(recent_prompts if recent else self.prompts, chosen, rng)
            chosen.add(prompt)
            items = self.groups[prompt].values()
            if recent:   # data of the newest windows (on-policy up to the sync period and a round), uniformly
                pool_t = [t for t, w in items if w >= cutoff]
                probs = None
            else:        # the whole group (or its best set), by softmax(reward x inverse temperature)
                pool_t = [t for t, _ in (self.best_of(prompt).values() if self.keep == "best" else items)]
                logits = self.reward_inv_temp * np.array([t.reward for t in pool_t])
                probs = np.exp(logits - logits.max())
                probs /= probs.sum()
            idx = rng.choice(len(pool_t), size=K, replace=len(pool_t) < K, p=probs)
            batch.append([pool_t[i] for i in idx])
        return batch


    # --- checkpoints: plain arrays -------------------------------------------------------------------
    def state(self) -> dict:
        """The whole buffer as NumPy arrays (groups in order of arrival, each oldest first, then the best
        sets in their order; `pool` tells them apart)."""
        rows = [(t, w) for p in self.prompts for t, w in self.groups[p].values()]
        pool = [0] * len(rows)
        rows += [(t, w) for group in self.best.values() for t, w in group.values()]
        pool += [1] * (len(rows) - len(pool))
        ts = [t for t, _ in rows]
        embedded = bool(ts) and all(t.embedding is not None for t in ts)
        return dict(
            prompt_id=np.array([t.prompt_id for t in ts], np.int64),
            reward=np.array([t.reward for t in ts], np.float64),
            logp_ref=np.array([t.logp_ref for t in ts], np.float64),
            logp_behaviour=np.array([t.logp_behaviour for t in ts], np.float64),
            version=np.array([t.version for t in ts], np.int64),
            ref_version=np.array([t.ref_version for t in ts], np.int64),
            window=np.array([w for _, w in rows], np.int64),
            length=np.array([len(t.response) for t in ts], np.int64),
            tokens=np.concatenate([t.response for t in ts] + [np.zeros(0, np.int32)]).astype(np.int32),
            prompts=np.array(self.prompts, np.int64),
            newest=np.array([list(self.newest), list(self.newest.values())], np.int64).reshape(2, -1),
            counters=np.array([self.window, self.reference], np.int64),
            settings=np.array([self.capacity, self.recency, self.reward_inv_temp, self.keep == "best", self.beta,
                               self.similarity, self.edit], np.float64),
            pool=np.array(pool, np.int8),
            group_of=np.array(self.group_of if self.group_of is not None else [], np.int64),
            embedding=np.stack([t.embedding for t in ts]).astype(np.float32) if embedded else np.zeros((0, 0), np.float32))

    @classmethod
    def from_state(cls, s: dict) -> "ReplayBuffer":
        settings = s["settings"].tolist() + [0.0, 1.0, 0.0, 0.0][len(s["settings"]) - 3:]  # older: newest
        capacity, recency, inv_temp, best, beta, similarity, edit = settings
        group_of = s["group_of"].tolist() if "group_of" in s and len(s["group_of"]) else None
        buf = cls(int(capacity), recency, inv_temp, "best" if best else "newest", beta, similarity, edit, group_of)
        ends = np.cumsum(s["length"])
        pool = s["pool"] if "pool" in s else np.zeros(len(ends), np.int8)
        embedding = s["embedding"] if "embedding" in s and len(s["embedding"]) else None
        for i, end in enumerate(ends.tolist()):
            t = Trajectory(int(s["prompt_id"][i]), s["tokens"][end - s["length"][i]:end].copy(), float(s["reward"][i]),
                           float(s["logp_ref"][i]), float(s["logp_behaviour"][i]), int(s["version"][i]),
                           int(s["ref_version"][i]), None if embedding is None else embedding[i].copy())
            group = buf.groups.setdefault(t.prompt_id, OrderedDict()) if pool[i] == 0 else buf.best_of(t.prompt_id)
            group[t.response.tobytes()] = (t, int(s["window"][i]))
        buf.prompts = s["prompts"].tolist()
        if "newest" in s:
            buf.newest = dict(zip(*s["newest"].tolist()))
            buf.window, buf.reference = s["counters"].tolist()
        else:  # written before the recent pool covered B prompts: each prompt's newest window, from its data
            buf.window, _, buf.reference = s["counters"].tolist()
            newest = {p: max(w for _, w in g.values()) for p, g in buf.groups.items()}
            buf.newest = dict(sorted(newest.items(), key=lambda pw: pw[1]))
        buf.size, buf.best_size = int((pool == 0).sum()), int((pool == 1).sum())
        return buf


@dataclass
class ReuseCap:
    """--max-reuse R: a step of `draws` trajectories is allowed only while the trajectories drawn for
    training stay within R times those received, over the run (R = 0: no cap). The credit this leaves
    is kept up to `bank` draws, so that a stretch where data arrives faster than the trainer can use it
    cannot pay for a later burst of replay (a silent searcher would otherwise be replayed for as many
    steps as were banked)."""
    ratio: float         # R: draws allowed per trajectory received; 0 = no cap
    bank: float          # the most credit kept, in draws
    credit: float = 0.0  # draws allowed before more data must arrive
    counted: int = 0     # trajectories received so far that have earned credit
    drawn: int = 0       # trajectories drawn for training so far, over the run

    def receive(self, samples: int):
        """`samples`: the trajectories received so far over the run (every node's)."""
        self.credit = min(self.bank, self.credit + self.ratio * (samples - self.counted))
        self.counted = samples

    def allows(self, draws: int) -> bool:
        return not self.ratio or self.credit >= draws - 1e-6  # R x received is a float: 1.3 x 216 = 280.8

    def draw(self, draws: int):
        self.drawn += draws
        if self.ratio:
            self.credit -= draws


def pick(pool: list[int], chosen: set[int], rng: np.random.Generator) -> int:
    """A uniform draw from `pool`, avoiding `chosen` while `pool` has prompts outside it."""
    for _ in range(8):  # rejection is cheap when the pool is much larger than the batch
        prompt = pool[rng.integers(len(pool))]
        if prompt not in chosen:
            return prompt
    rest = [p for p in pool if p not in chosen]
    return rest[rng.integers(len(rest))] if rest else prompt


def edit_distances(a: np.ndarray, rows: list, lengths: np.ndarray) -> np.ndarray:
    """Levenshtein distance between the token sequence `a` and each of `rows`, all at once: the
    dynamic programme runs over a's tokens, vectorised over the rows and their positions (an
    insertion chain along a row is a running minimum). Returns (n,) int64."""
    n, L = len(rows), int(lengths.max(initial=0))
    padded = np.full((n, L), -1, np.int64)                      # (n, L), -1 matches no token
    for i, r in enumerate(rows):
        padded[i, :len(r)] = r
    at = np.arange(L + 1)                                       # (L+1,)
    prev = np.tile(at, (n, 1))                                  # (n, L+1): distances of a[:0] to rows[:, :j]
    for i, token in enumerate(np.asarray(a, np.int64), 1):
        base = np.empty_like(prev)                              # (n, L+1): deletion or substitution
        base[:, 0] = i
        base[:, 1:] = np.minimum(prev[:, 1:] + 1, prev[:, :-1] + (padded != token))
        prev = np.minimum.accumulate(base - at, axis=1) + at    # then insertions along the row
    return prev[np.arange(n), lengths]
