"""TBA's replay buffer: every trajectory the searchers made, grouped by prompt, and its sampling; the
reuse cap.

Rules (the paper, Sec. 3.2, and the authors' `buffer_utils.py`):
- One group per prompt, holding the newest `capacity` distinct responses; an exact token duplicate of a
  response already in the group replaces it (the newest copy is kept) and counts its copies, by window.
  Memory is bounded by capacity x the number of prompts in the data set.
- A training batch is B prompts x K responses. For each of the B prompts, independently:
  with probability m (`recency`) a prompt with data added since the last weight sync, and K of
  those recent responses drawn uniformly; otherwise a prompt of the whole buffer, and K of its
  responses drawn by softmax(reward x `reward_inv_temp`) (0 = uniform). With `duplicates` "count" (the
  default) a response is drawn as often as the searchers sent it, as from the raw rounds: VarGrad's log Z
  is a mean over samples of the policy, and collapsing a modal answer's copies into one shrinks its weight
  in a batch (docs/performance.md); "collapse" draws each distinct response once (the authors'
  buffer_utils.py:36-83). Draws are without replacement where the pool holds at least K copies (K distinct
  responses with "collapse"), with replacement where it holds fewer.
- Departure from the authors' MPI code, where data reaches the trainer only at a sync: here it
  streams in, so right after a sync little or nothing is "recent" yet. The recent pool is the data
  of the newest windows (a window: the data added between two syncs) that together cover B prompts:
  the data since the last sync if it covers B, else that of the windows before it too, so that a
  batch's recent prompts are distinct while N searchers' rounds of B / N prompts arrive one by one.
- Prompts are distinct within a batch while the pool has enough of them.
- TBA′ (reference-policy resetting): every trajectory records the pi_ref that scored it; at a
  reset the buffer is emptied and only data scored under the new pi_ref is kept, so that no TB
  group mixes log-probs under two references (recomputing them would need pi_ref in the trainer).
- --lag L (an exact lag): the searchers' rounds for step n, all sampled by the weights of step n - L,
  are kept apart (`rounds`) and make step n's batch alone (`sample_round`), each trajectory once;
  each group is one round's, scored under one pi_ref, so a TBA′ reset drops none of them. Rounds of a step
  already trained are dropped on arrival; a checkpoint keeps none of the steps to come (they are made again).
- Checkpoints: `state` / `from_state` as plain NumPy arrays, the settings by name (no pickle, no code), any
  other attribute (a researcher's) as plain data (`plain`) or named as left out. A trajectory's arrays come
  from its dataclass's fields (`to_arrays`), as on the wire between nodes.
- `ReuseCap` (--max-reuse R): the trainer draws at most R times the trajectories the buffer has kept,
  counted over the run, so scarce data is not replayed without bound (docs/departures.md, "Reuse").
A task may extend it (its entry's `buffer`, tasks/task.py): Lee et al.'s buffer of the best trajectories,
--buffer-keep best, is one.
"""

import dataclasses
import json
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch


def token_field(dtype: str):
    """A field of one value per response token, (T,) `dtype` (None: the trajectory has none)."""
    return field(default=None, metadata={"per_token": dtype})


def vector(dtype: str):
    """A field of one fixed-length vector, (H,) `dtype` (None: the trajectory has none)."""
    return field(default=None, metadata={"vector": dtype})


@dataclass
class Trajectory:
    """One searched response: the record the loss's inputs, the saved buffer and the wire between nodes derive from
    (`to_arrays`): a new field is one line here, and where it is made (searcher.Engine.search)."""
    prompt_id: int           # index into the task's training problems
    response: np.ndarray     # (T,) int32 response token ids, EOS included when generation stopped on it
    reward: float            # r(y, x)
    logp_ref: float          # log pi_ref(y|x), summed over response tokens, from logits / temperature
    logp_behaviour: float    # log-prob under the searcher's policy that sampled y (vLLM's, same temperature)
    version: int             # trainer step whose weights sampled y (0 = the initial model; in flight: the first)
    pi_ref_version: int = 0  # trainer step whose weights were pi_ref when logp_ref was computed (TBA′)
    embedding: np.ndarray | None = vector("float32")  # (H,) unit sentence embedding (--dedup-similarity)
    version_last: int = -1   # --keep-full: the last weights that sampled a token of y (loaded in flight)
    for_step: int = -1       # --lag: the trainer step whose batch this round is for; -1: streamed
    behaviour_logps: np.ndarray | None = token_field("float32")  # (T,) each token's log-prob when sampled
    ref_logps: np.ndarray | None = token_field("float32")  # (T,) each token's log-prob under pi_ref (per-token losses)
    truncated: int = 0       # 1 if y stopped at the length limit (--max-new-tokens, --context) before its end


FIELDS = dataclasses.fields(Trajectory)
SCALARS = [f.name for f in FIELDS if f.type in (int, float)]                 # one number each
PER_TOKEN = ["response"] + [f.name for f in FIELDS if "per_token" in f.metadata]
VECTORS = [f.name for f in FIELDS if "vector" in f.metadata]
DTYPES = {"response": "int32", **{f.name: f.metadata.get("per_token") or f.metadata.get("vector")
                                  for f in FIELDS if f.metadata}}


def to_arrays(trajectories: list[Trajectory]) -> dict[str, np.ndarray]:
    """The trajectories as plain arrays, by field: each number field (N,), each per-token field
    concatenated (sum of T,) beside `length` (N,), each vector field stacked (N, H). A per-token or vector
    field is left out unless every trajectory has it."""
    ts = trajectories
    out = {f.name: np.array([getattr(t, f.name) for t in ts], np.int64 if f.type is int else np.float64)
           for f in FIELDS if f.name in SCALARS}
    out["length"] = np.array([len(t.response) for t in ts], np.int64)
    for name in PER_TOKEN:
        if all(getattr(t, name) is not None for t in ts):
            out[name] = np.concatenate([np.asarray(getattr(t, name)) for t in ts] + [np.zeros(0)]).astype(DTYPES[name])
    for name in VECTORS:
        if ts and all(getattr(t, name) is not None for t in ts):
            out[name] = np.stack([getattr(t, name) for t in ts]).astype(DTYPES[name])
    return out


def from_arrays(a: dict[str, np.ndarray]) -> list[Trajectory]:
    """`to_arrays`'s trajectories back; ValueError if the arrays do not fit together."""
    n, lengths = len(a["length"]), a["length"].astype(np.int64)
    ends = np.cumsum(lengths)
    if any(len(a[name]) != n for name in SCALARS if name in a) or (lengths < 0).any():
        raise ValueError("the number fields do not have one value per trajectory")
    for name in PER_TOKEN:
        if name in a and len(a[name]) != int(ends[-1] if n else 0):
            raise ValueError(f"{name} does not hold one value per response token")
    for name in VECTORS:
        if name in a and (a[name].ndim != 2 or len(a[name]) != n):
            raise ValueError(f"{name} does not hold one vector per trajectory")
    kinds = {f.name: f.type for f in FIELDS}
    scalars = [name for name in SCALARS if name in a]  # a field added since the arrays were written: its default
    return [Trajectory(**{name: kinds[name](a[name][i]) for name in scalars},
                       **{name: a[name][end - length:end].copy() for name in PER_TOKEN if name in a},
                       **{name: a[name][i].copy() for name in VECTORS if name in a})
            for i, (length, end) in enumerate(zip(lengths.tolist(), ends.tolist()))]


class ReplayBuffer:
    # its knobs, each named as here and as its flag (runtime/config.py): the run's buffer is built from them
    # (`from_config`), and saved and rebuilt by name (`settings`, `from_state`)
    FLAGS = {"capacity": "buffer_capacity", "recency": "recency", "reward_inv_temp": "reward_inv_temp",
             "duplicates": "duplicates"}
    # the attributes `state` writes itself; any other it saves as plain data (`plain`), or names as left out
    SAVED = {"groups", "copies", "last_window", "prompts", "size", "window", "pi_ref_version", "next_round",
             "rounds"}

    def __init__(self, capacity: int, recency: float, reward_inv_temp: float, duplicates: str = "count"):
        self.capacity, self.recency, self.reward_inv_temp = capacity, recency, reward_inv_temp
        self.duplicates = duplicates  # count: draws follow the searchers' multiplicities; collapse: one each
        self.window = 0          # number of weight syncs so far
        self.pi_ref_version = 0  # the pi_ref of the data kept (TBA′)
        self.rounds: dict[int, list[Trajectory]] = {}  # --lag: step -> the trajectories of its rounds
        self.next_round = 0      # --lag: the step whose rounds make the next batch (older ones are dropped)
        self.clear()

    def clear(self):
        self.groups: dict[int, OrderedDict] = {}  # prompt id -> {response bytes: (Trajectory, window)}
        self.copies: dict[int, dict] = {}         # prompt id -> {response bytes: {window: copies received in it}}
        self.last_window: dict[int, int] = {}     # prompt id -> the window of its latest data, oldest first
        self.prompts: list[int] = []              # every prompt with a group, in order of arrival
        self.size = 0                             # trajectories held

    def add(self, trajectories: list[Trajectory]) -> list[Trajectory]:
        """Add the trajectories; returns those kept (TBA′: not those scored under an older pi_ref; --lag: not the
        rounds of a step already trained)."""
        rounds = [t for t in trajectories if t.for_step >= self.next_round]
        for t in rounds:
            self.rounds.setdefault(t.for_step, []).append(t)
        kept = [t for t in trajectories if t.for_step < 0 and t.pi_ref_version == self.pi_ref_version]
        for t in kept:
            if t.prompt_id not in self.groups:
                self.prompts.append(t.prompt_id)
            group, key = self.groups.setdefault(t.prompt_id, OrderedDict()), t.response.tobytes()
            self.size += group.pop(key, None) is None  # exact duplicate: the newest copy stands for all
            group[key], counts = (t, self.window), self.copies.setdefault(t.prompt_id, {}).setdefault(key, {})
            counts[self.window] = counts.get(self.window, 0) + 1
            if len(group) > self.capacity:             # keep the newest `capacity`
                self.copies[t.prompt_id].pop(group.popitem(last=False)[0])
                self.size -= 1
            self.last_window.pop(t.prompt_id, None)
            self.last_window[t.prompt_id] = self.window
        return rounds + kept

    def mark_sync(self):
        """Called at every weight sync: data added after this is 'recent'."""
        self.window += 1

    def set_reference(self, version: int):
        """TBA′: pi_ref is now the policy of step `version`; the data scored under the old one goes."""
        self.clear()
        self.pi_ref_version = version

    def newest_version(self) -> int:
        """The newest weight version among the data held (a resumed buffer's), or -1 if empty."""
        return max((t.version for group in self.groups.values() for t, _ in group.values()), default=-1)

    def recent(self, B: int) -> tuple[int, list[int]]:
        """(the oldest window of the recent pool, its prompts): the newest windows that cover B prompts (all
        there are if fewer), from the B-th newest prompt's window on (`last_window` runs oldest first)."""
        windows = list(self.last_window.values())
        cutoff = windows[-min(B, len(windows))] if windows else None
        return cutoff, [prompt for prompt, window in self.last_window.items() if window >= cutoff]

    def whole(self, prompt: int) -> list[Trajectory]:
        """A prompt's trajectories for the whole-buffer draws."""
        return [t for t, _ in self.groups[prompt].values()]

    def multiplicity(self, prompt: int, since: int = -1) -> dict[bytes, int]:
        """Each distinct response's copies received from window `since` on."""
        return {key: sum(n for w, n in counts.items() if w >= since) for key, counts in self.copies[prompt].items()}

    def __len__(self):
        """Trajectories held: for the whole-buffer draws, and the rounds of the steps to come (--lag)."""
        return self.size + self.waiting()

    def waiting(self, step: int | None = None) -> int:
        """--lag: trajectories of the rounds for `step` (None: for every step to come)."""
        return len(self.rounds.get(step, ())) if step is not None else sum(map(len, self.rounds.values()))

    def sample_round(self, step: int, B: int, K: int, n: int, rng: np.random.Generator) -> list[list[Trajectory]]:
        """--lag: B groups of K trajectories from the rounds for `step`, each trajectory used once. A group is n
        responses of one prompt (a round's; two rounds that drew one prompt make two groups, split in a fixed
        order: samples of the same policy either way), taken in prompt order whatever order the rounds came in;
        B of them without replacement, and K distinct responses of each, while there are as many."""
        by_prompt = {}
        for t in sorted(self.rounds.pop(step), key=lambda t: (t.prompt_id, t.response.tobytes())):
            by_prompt.setdefault(t.prompt_id, []).append(t)
        groups = [g[i:i + n] for g in by_prompt.values() for i in range(0, len(g), n)]
        self.next_round = step + 1
        chosen = rng.choice(len(groups), size=B, replace=len(groups) < B)
        return [[groups[j][i] for i in rng.choice(len(groups[j]), size=K, replace=len(groups[j]) < K)] for j in chosen]

    def sample(self, B: int, K: int, rng: np.random.Generator) -> list[list[Trajectory]]:
        """B groups of K trajectories, each group from one prompt (see the module docstring)."""
        assert self.groups, "sample() from an empty buffer"
        since, recent_prompts = self.recent(B)
        chosen, batch = set(), []
        for _ in range(B):
            recent = rng.random() < self.recency
            chosen.add(prompt := pick(recent_prompts if recent else self.prompts, chosen, rng))
            # recent: the newest windows' data (on-policy up to the sync period and a round), uniformly; else
            # the whole group, by `weights`
            group = self.groups[prompt]
            pool = [t for t, w in group.values() if w >= since] if recent else self.whole(prompt)
            weights = np.ones(len(pool)) if recent else self.weights(pool)
            if self.duplicates == "count":  # each distinct response as often as the searchers sent it
                copies = self.multiplicity(prompt, since if recent else -1)
                counts = np.array([copies.get(t.response.tobytes(), 1) for t in pool])
                batch.append([pool[i] for i in draw(counts, weights, K, rng)])
            else:
                p = None if recent else weights / weights.sum()  # uniform as None: NumPy draws another stream for a p
                idx = rng.choice(len(pool), size=K, replace=len(pool) < K, p=p)
                batch.append([pool[i] for i in idx])
        return batch

    def weights(self, pool: list[Trajectory]) -> np.ndarray:
        """The whole-buffer draws' weight of each of a prompt's responses: softmax(reward x inverse
        temperature)."""
        logits = self.reward_inv_temp * np.array([t.reward for t in pool])
        return np.exp(logits - logits.max())

    # --- the knobs, checkpoints: plain arrays -----------------------------------------------------------
    @classmethod
    def from_config(cls, cfg, prompts: list[list[int]] | None = None) -> "ReplayBuffer":
        """The run's buffer, its knobs from the flags (FLAGS); a task's kind may read its prompts too."""
        return cls(**cls.knobs(cfg))

    @classmethod
    def knobs(cls, cfg) -> dict:
        return {name: getattr(cfg, flag) for name, flag in cls.FLAGS.items()}

    def settings(self) -> dict:
        return {name: getattr(self, name) for name in self.FLAGS}

    def state(self) -> dict:
        """The whole buffer as NumPy arrays: its groups' trajectories in order of arrival, each oldest first,
        with their windows, and its settings and counters by name (a JSON text)."""
        rows = [(t, w) for p in self.prompts for t, w in self.groups[p].values()]
        counts = [(i, w, n) for i, (t, _) in enumerate(rows)
                  for w, n in self.copies[t.prompt_id][t.response.tobytes()].items()]
        # --lag's rounds of the steps to come are not kept: a resumed run's searchers make them again, the same
        return dict(**to_arrays([t for t, _ in rows]), window=np.array([w for _, w in rows], np.int64),
                    copies=np.array(counts, np.int64).reshape(-1, 3),  # (row, window, copies received in it)
                    prompts=np.array(self.prompts, np.int64),
                    last_window=np.array([list(self.last_window), list(self.last_window.values())],
                                         np.int64).reshape(2, -1),
                    settings=np.array(json.dumps(dict(self.settings(), kind=type(self).__name__, window=self.window,
                                                      pi_ref_version=self.pi_ref_version,
                                                      next_round=self.next_round))), **self.more())

    def more(self) -> dict:
        """Every other attribute (a researcher's, say each response's draws) as plain data, a JSON text
        (`more`), and those that are not plain data by name (`dropped`: a save says so, a resume starts them
        afresh)."""
        more, dropped = {}, []
        for name, value in vars(self).items():
            if name in self.SAVED or name in self.settings():
                continue
            try:
                more[name] = plain(value)
            except TypeError as e:
                dropped.append(f"{name} ({e})")
        return dict(more=np.array(json.dumps(more)), dropped=np.array(json.dumps(dropped)))

    @classmethod
    def from_state(cls, s: dict) -> "ReplayBuffer":
        settings = json.loads(str(s["settings"]))
        kind, window, version = settings.pop("kind"), settings.pop("window"), settings.pop("pi_ref_version")
        next_round = settings.pop("next_round")
        if kind != cls.__name__:
            raise ValueError(f"a {kind}'s state, not a {cls.__name__}'s")
        buf = cls(**settings)
        rows = from_arrays(s)
        for t, w in zip(rows, s["window"].tolist()):
            buf.groups.setdefault(t.prompt_id, OrderedDict())[t.response.tobytes()] = (t, w)
        for i, w, n in s["copies"].tolist():
            t = rows[i]
            buf.copies.setdefault(t.prompt_id, {}).setdefault(t.response.tobytes(), {})[w] = n
        buf.prompts = s["prompts"].tolist()
        buf.last_window = dict(zip(*s["last_window"].tolist()))
        buf.window, buf.pi_ref_version, buf.next_round = window, version, next_round
        buf.size = len(s["window"])
        for name, value in json.loads(str(s.get("more", "{}"))).items():
            setattr(buf, name, unplain(value))
        return buf


def plain(x):
    """`x` as JSON that `unplain` reads back the same: numbers, strings, None, bytes, NumPy arrays, and lists,
    tuples and dicts (any such keys) of them; TypeError naming what is not."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, (bytes, np.ndarray)):
        return {"bytes": x.hex()} if isinstance(x, bytes) else {
            "array": x.ravel().tolist(), "dtype": str(x.dtype), "shape": list(x.shape)}
    if isinstance(x, (list, tuple)):
        return {type(x).__name__: [plain(v) for v in x]}
    if isinstance(x, dict):  # an OrderedDict too (read back as a dict: its order stays)
        return {"dict": [[plain(k), plain(v)] for k, v in x.items()]}
    raise TypeError(f"a {type(x).__name__}, not plain data")


def unplain(x):
    if not isinstance(x, dict):
        return x
    kind, value = next(iter(x.items()))
    return {"bytes": bytes.fromhex, "list": lambda v: [unplain(i) for i in v],
            "tuple": lambda v: tuple(unplain(i) for i in v),
            "dict": lambda v: {unplain(k): unplain(i) for k, i in v},
            "array": lambda v: np.array(v, x.get("dtype")).reshape(x.get("shape"))}[kind](value)


def loss_inputs(part, device, per_token: bool, prompts) -> dict:
    """The loss's inputs from the trajectories of b groups: each number field (b, K), `length` and `prompt_length`,
    and for a per-token loss each per-token field and `token_mask`, (b, K, T) padded to the longest response."""
    field = lambda f: torch.tensor([[float(f(t)) for t in g] for g in part], device=device)  # (b, K)
    inputs = {name: field(lambda t, name=name: getattr(t, name)) for name in SCALARS}
    inputs["length"] = field(lambda t: len(t.response))
    inputs["prompt_length"] = field(lambda t: len(prompts[t.prompt_id]))
    if per_token:
        R = max(len(t.response) for g in part for t in g)
        padded = lambda f: torch.tensor(np.array([[np.pad(np.asarray(f(t), np.float32), (0, R - len(t.response)))
                                                    for t in g] for g in part]), device=device)  # (b, K, R)
        inputs["token_mask"] = padded(lambda t: np.ones(len(t.response)))
        for name in PER_TOKEN[1:]:  # not the response's token ids
            if all(getattr(t, name) is not None for g in part for t in g):
                inputs[name] = padded(lambda t, name=name: getattr(t, name))
    return inputs


@dataclass
class ReuseCap:
    """--max-reuse R: a step of `draws` is allowed while the draws stay within R x the trajectories kept, over the run
    (0: no cap); the credit banked is at most `bank` draws (no burst of replay, of a silent searcher's data say)."""
    ratio: float         # R: draws allowed per trajectory kept; 0 = no cap
    bank: float          # the most credit kept, in draws
    credit: float = 0.0  # draws allowed before more data must arrive
    counted: int = 0     # trajectories kept so far that have earned credit
    drawn: int = 0       # trajectories drawn for training so far, over the run

    @classmethod
    def for_run(cls, cfg, nodes: int):
        """A run's cap: credit banked up to k steps' draws, or one round of every searcher (of `nodes` nodes), which
        can land at once."""
        rounds = (cfg.max_reuse * cfg.searchers * nodes * cfg.round_prompts * cfg.search_samples_per_prompt
                  if cfg.searchers else 0)
        return cls(cfg.max_reuse, max(cfg.sync_every * cfg.prompts_per_step * cfg.samples_per_prompt, rounds))

    def receive(self, kept: int):
        """`kept`: the trajectories the buffer has kept so far over the run (every node's)."""
        self.credit, self.counted = min(self.bank, self.credit + self.ratio * (kept - self.counted)), kept

    def allows(self, draws: int) -> bool:
        return not self.ratio or self.credit >= draws - 1e-6  # R x received is a float: 1.3 x 216 = 280.8

    def draw(self, draws: int):
        self.drawn, self.credit = self.drawn + draws, self.credit - (draws if self.ratio else 0)


def unfit(trajectories, task: str) -> str | None:
    """Why a round cannot enter the buffer, in one line, or None: a reward that is not a finite number (the
    draws' softmax over rewards would fail far from the task's reward that made it)."""
    bad = next((t for t in trajectories if not np.isfinite(t.reward)), None)
    return bad and (f"the {task} task's reward is {bad.reward} for a response to training prompt "
                    f"{bad.prompt_id}: a reward must be a finite number")


def draw(copies: np.ndarray, weights: np.ndarray, K: int, rng: np.random.Generator) -> list[int]:
    """K draws from a multiset (item i held `copies[i]` times, each copy weighted `weights[i]`), without replacement
    while it holds K copies: a batch follows the searchers' multiplicities, as the raw rounds would."""
    if copies.sum() < K:  # with replacement, by each item's copies' weight
        return rng.choice(len(copies), size=K, p=copies * weights / (copies * weights).sum()).tolist()
    left, out = copies.astype(float), []
    for _ in range(K):
        i = int(rng.choice(len(left), p=left * weights / (left * weights).sum()))
        out.append(i)
        left[i] -= 1
    return out


def pick(pool: list[int], chosen: set[int], rng: np.random.Generator) -> int:
    """A uniform draw from `pool`, avoiding `chosen` while `pool` has prompts outside it."""
    for _ in range(8):  # rejection is cheap when the pool is much larger than the batch
        prompt = pool[rng.integers(len(pool))]
        if prompt not in chosen:
            return prompt
    rest = [p for p in pool if p not in chosen]
    return rest[rng.integers(len(rest))] if rest else prompt
