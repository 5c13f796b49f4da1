"""What a run reports: `metrics.jsonl` (the full record), `config.json`, the console, and optionally
Weights & Biases. Trainer rank 0 writes; on other ranks every method does nothing.

The console is a progress bar (tqdm) over the steps, with the elapsed and remaining time and the latest
reward, loss, staleness and held-out score, where the output is a terminal; elsewhere (a log file, CI, nohup)
it is one plain line every `--log-every` steps. Evaluations print above the bar. `--wandb PROJECT` sends the
same rows to W&B (the package is optional and imported only then). `check_out` refuses an --out that cannot
take the run's files before the run starts, or that a run still runs in (`hold`).
"""

import dataclasses
import fcntl
import json
import os
import sys
import time

import numpy as np

from runtime.errors import ConfigError


class Log:
    def __init__(self, cfg, rank: int, t0: float, step: int = 0, resumed: dict | None = None):
        self.cfg, self.rank, self.t0 = cfg, rank, t0
        self.overhead = 0.0   # s the trainer spent evaluating and checkpointing (not learning)
        # s of vLLM generation in the rounds received, slept after it and charged in all by
        # --generation-slowdown (X x the generation's cost alone); since this process started
        self.generate = self.slept = self.charged = self.over = 0.0  # over: real compute above the charges
        self.emulated = cfg.generation_slowdown != 1 or cfg.train_slowdown != 1
        self.calibration = {}  # the emulation's costs alone: seconds_per_token (each engine's), train_step
        self.rounds, self.parts = 0, {}  # those rounds; s of each part of their rewards (a task's scorer says)
        self.budgets = {}  # engine (a searcher's number, or "trainer") -> [s charged, s of real compute above them,
        #                    s of work no device pays for: its reloads, its rounds' scoring and pi_ref]
        self.uncharged = {}  # part -> s of that work over the rounds received (`searched`); the trainer's publishes:
        self.published = 0.0  # s, its own work no device pays for
        self.received = []  # [searcher, version, started, cycle] of each round received since the last train row
        self.cpu_bound_said = False
        self.last_eval = None   # the latest eval row
        self.first_eval = None  # {"step", "score"}: the run's first evaluation (carried by checkpoints)
        self.resumed = resumed  # {"step"} where this process resumed the run (None: it did not); + "score"
        self.last_train, self.bar, self.wandb, self.file = None, None, None, None
        self.unwritten = None  # why a row could not be written (a full disk): the run stops, checkpointed
        if rank != 0:
            return
        os.makedirs(cfg.out, exist_ok=True)
        hold(cfg.out)  # (a resume's check took it already)
        self.write_config()
        self.file = open(os.path.join(cfg.out, "metrics.jsonl"), "ab", buffering=0)  # unbuffered: `write`
        if sys.stdout.isatty():
            from tqdm import tqdm
            try:  # follow the terminal's size; one that reports none (0 x 0: tqdm would hide the bar)
                width = {"dynamic_ncols": True} if os.get_terminal_size().lines > 0 else {"ncols": 120, "nrows": 24}
            except OSError:                                                      # gets 120 x 24
                width = {"ncols": 120, "nrows": 24}
            self.bar = tqdm(total=cfg.steps, initial=step, unit="step", file=sys.stdout, **width,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")
        if cfg.wandb:
            import wandb
            self.wandb = wandb.init(project=cfg.wandb, name=os.path.basename(os.path.abspath(cfg.out)),
                                    dir=cfg.out, config=dataclasses.asdict(cfg))
            for kind in ("train", "eval"):
                self.wandb.define_metric(f"{kind}/*", step_metric=f"{kind}/step")

    def searched(self, made: dict):
        """Count one search round's seconds (Engine.search's dict: a searcher's message, or the synchronous
        trainer's own round); with emulated device time, its counters too (`emulation`)."""
        self.generate, self.slept, self.rounds = self.generate + made["generate"], self.slept + made["slept"], self.rounds + 1
        self.charged, self.over = self.charged + made["charged"], self.over + made["over"]
        for part, seconds in made["parts"].items():
            self.parts[part] = self.parts.get(part, 0.0) + seconds
        if self.emulated:
            self.emulation(made)

    def emulation(self, made: dict):
        """The emulation's counters of a round (`searched`; its fields: docs/output.md): the work no device
        pays for (`reload`, `score`), the round listed for the next row's timeline, each engine's first
        calibration into config.json."""
        uncharged = dict(made.get("uncharged") or {})
        if made.get("seconds") is not None:
            uncharged["score"] = max(0.0, made["seconds"] - made["generate"] - made["slept"])
        for part, seconds in uncharged.items():
            self.uncharged[part] = self.uncharged.get(part, 0.0) + seconds
        if made.get("started") is not None:
            self.received.append([made.get("searcher", "trainer"), made["version"], round(made["started"] - self.t0, 4),
                                  round(made["seconds"] + uncharged.get("reload", 0.0), 4)])
        engine, calibrated = str(made.get("searcher", "trainer")), self.calibration.setdefault("seconds_per_token", {})
        budget = self.budgets.setdefault(engine, [0.0, 0.0, 0.0])  # each process's charge, overrun, uncharged work
        budget[0], budget[1], budget[2] = (budget[0] + made["charged"], budget[1] + made["over"],
                                           budget[2] + sum(uncharged.values()))
        if made["seconds_per_token"] and engine not in calibrated and self.rank == 0:
            calibrated[engine] = made["seconds_per_token"]
            self.write_config(**self.calibration)

    def write_config(self, **derived):
        with open(os.path.join(self.cfg.out, "config.json"), "w") as f:
            json.dump(dict(dataclasses.asdict(self.cfg), started=self.t0, **derived), f, indent=1)  # started: Unix time of t = 0

    def now(self) -> float:
        return time.time() - self.t0

    def clock(self) -> tuple[float, float]:
        return self.now(), self.overhead

    def per_round(self) -> dict:
        """The train row's fields of the rewards' parts (red-teaming: the victim, the classifier): the mean
        seconds per round received so far; `uncharged`: the work no device pays for, by part, the same way."""
        if not self.rounds:
            return {}
        mean = lambda parts: {part: seconds / self.rounds for part, seconds in parts.items()}
        return dict(mean(self.parts), **({"uncharged": mean(self.uncharged)} if self.emulated else {}))

    # the train row's own fields, which a loss's statistic may not be named (runtime.checks.probe_pools
    # refuses it, and the sums' `loss` and `prompts`, tba.add_sums); tests/test_e2e checks a run's rows by it
    FIELDS = ("kind step time resumed reward truncated staleness staleness_max lr beta gamma reward_temp "
              "batch_reference wait sync search seconds behaviour_gap trained published rounds samples "
              "tokens response_length reuse verified generate slept charged buffer reference overhead "
              "uncharged samples_per_node version_per_node train_slept train_charged over_budget "
              "over_trainer over_searchers uncharged_trainer uncharged_searchers").split()

    def train_row(self, step: int, batch, stats: dict, fleet, buffer, cap, clock, **fields):
        """The row of training step `step` (rank 0; its fields: docs/output.md): the loss's statistics (means over
        prompts), the batch's reward and staleness, `fields` (the schedules, the step's seconds) and the run's counts;
        with emulated device time, the trainer's charges (`clock`) and a timeline (`emulated_fields`)."""
        if self.rank != 0:
            return
        ts = [traj for group in batch for traj in group]
        mean, stale = lambda f: float(np.mean([f(t) for t in ts])), [step - 1 - t.version for t in ts]
        fields = {k: v for k, v in fields.items() if not (k in ("gamma", "reward_temp") and v == 1.0)}  # Lee et al.'s
        if self.cfg.keep_full:  # weights loaded in flight: from the last weights that sampled each response too
            fields["staleness_last"] = mean(lambda t: step - 1 - t.version_last)
        if self.cfg.ref_reset_every:  # TBA′: the oldest pi_ref that scored a trajectory of the batch
            fields["batch_reference"] = min(t.pi_ref_version for t in ts)
        self.row(kind="train", step=step, time=self.now(), **{k: v for k, v in stats.items() if k != "prompts"},
                 reward=mean(lambda t: t.reward), truncated=mean(lambda t: t.truncated),
                 staleness=float(np.mean(stale)), staleness_max=int(max(stale)), **fields,
                 samples=fleet.received, tokens=fleet.tokens, response_length=mean(lambda t: len(t.response)),
                 reuse=cap.drawn / max(1, fleet.received), verified=min(fleet.verified.values(), default=-1),
                 generate=self.generate, slept=self.slept, charged=self.charged, buffer=len(buffer),
                 reference=buffer.pi_ref_version, overhead=self.overhead, **self.per_round(),
                 **(fleet.nodes.row(fleet.received) if fleet.nodes else {}),
                 **(self.emulated_fields(step, fleet, clock, fields.get("sync", 0.0)) if self.emulated else {}))
        if self.bar is not None or step % self.cfg.log_every == 0 or step == self.cfg.steps:
            self.show()  # the bar follows each row; a plain line every --log-every steps

    def emulated_fields(self, step: int, fleet, clock, sync: float) -> dict:
        """With emulated device time, the train row's timeline (`trained`, `published`, `rounds`:
        docs/output.md), the trainer's charges (--train-slowdown) and the real compute over the charges
        (`over_budget`, `over_shares`)."""
        self.published += sync  # the trainer's publish: its own work no device pays for
        timeline = dict(trained=round(clock.ended - self.t0, 4) if clock.ended else None,
                        published=round(fleet.sent[step], 4) if step in fleet.sent else None, rounds=self.received)
        self.received = []
        if clock.seconds is not None and "train_step" not in self.calibration:  # its cost alone, once known
            self.calibration["train_step"] = clock.seconds
            self.write_config(**self.calibration)
        trainer = dict(train_slept=clock.slept, train_charged=clock.charged) if clock.factor != 1 else {}
        return dict(trainer, **timeline, over_budget=self.over + clock.over, **self.over_shares(clock))

    def over_shares(self, clock) -> dict:
        """Each process's real compute above its own charge, as a share of it, so far: `over_trainer` (its training
        steps; its generation too with --searchers 0) and `over_searchers` ({searcher: share}); and its work no device
        pays for, the same way: `uncharged_trainer` (its publishes; its reloads, scoring and pi_ref with --searchers 0)
        and `uncharged_searchers` (their reloads, scoring and pi_ref). The trainer's own overrun lengthens the critical
        path; pooled with the searchers' charges it would hide (30% over showed as 5%). Said once on the console when
        one process's two shares together are above CPU_BOUND."""
        shares = {engine: (over / charged, uncharged / charged)
                  for engine, (charged, over, uncharged) in self.budgets.items() if charged}
        own = self.budgets.get("trainer", [0.0, 0.0, 0.0])
        charged = clock.charged + own[0]
        out = dict(over_trainer=(clock.over + own[1]) / charged if charged else 0.0,
                   over_searchers={k: v[0] for k, v in shares.items() if k != "trainer"},
                   uncharged_trainer=(self.published + own[2]) / charged if charged else 0.0,
                   uncharged_searchers={k: v[1] for k, v in shares.items() if k != "trainer"})
        bound = self.cpu_bound(out)
        if bound and not self.cpu_bound_said and self.last_train is not None and self.last_train["step"] >= 5:
            self.cpu_bound_said = True
            self.print(f"tba.py: warning: {bound}: the emulated device time is not what paces the run", file=sys.stderr)
        return out

    CPU_BOUND = 0.10  # a process's real compute more than 10% above its own charge, counting its work no device pays
    #                  for: the CPU, not the emulation, sets its pace

    def cpu_bound(self, shares: dict) -> str:
        """Which processes run over their charge, with their uncharged work, by more than CPU_BOUND ("" if none)."""
        searchers = shares.get("uncharged_searchers") or {}
        each = {"the trainer": shares["over_trainer"] + shares.get("uncharged_trainer", 0.0),
                **{f"searcher {k}": v + searchers.get(k, 0.0) for k, v in shares["over_searchers"].items()}}
        over = [f"{who} {share:.0%}" for who, share in each.items() if share > self.CPU_BOUND]
        return f"CPU-bound ({', '.join(over)} over its own charge, uncharged work counted)" if over else ""

    def eval(self, version: int, scores: dict, example: dict, seconds: float, made: tuple[float, float]):
        """An evaluation of the weights of step `version` (rank 0); time and overhead: when they were made."""
        if self.rank != 0:
            return
        self.row(kind="eval", step=version, version=version, **scores, time=made[0], overhead=made[1],
                 seconds=seconds, example=example)
        if self.bar is not None and self.last_train is not None:  # the bar's postfix has the held-out score
            self.show()

    def row(self, **row):  # (rank 0's: `train_row` and `eval` return on the others)
        if self.resumed is not None:  # a resumed process's rows: which branch of the run they belong to
            row["resumed"] = self.resumed["step"]  # (tools/plot.py, `latest`, keeps the latest branch's)
        if self.file is not None:
            self.write(json.dumps(row).encode() + b"\n")
        if self.wandb is not None:
            self.wandb.log({f"{row['kind']}/{k}": v for k, v in row.items() if isinstance(v, (int, float))})
        if row["kind"] == "eval":
            self.last_eval = row
            self.first_eval = self.first_eval or {"step": row["step"], "score": row[self.cfg.score]}
            if self.resumed is not None:
                self.resumed.setdefault("score", row[self.cfg.score])
            self.print(f"eval  step {row['step']:5d} | held-out {self.cfg.score.replace('_', ' ')} "
                       f"{row[self.cfg.score]:.3f}")
        else:
            self.last_train = row

    def write(self, data: bytes):
        """A row into metrics.jsonl. One that fails (a full disk) is cut off (no half line is left), and
        stops the run after a checkpoint (the fleets' stop_reason: `unwritten`); no later row is written."""
        at = self.file.tell()
        try:
            while data:  # (a write may take part of it)
                data = data[self.file.write(data):]
        except OSError as e:
            self.file.truncate(at)
            self.file.close()
            self.file = None
            why = e.strerror or type(e).__name__
            self.unwritten = f"{self.cfg.out}/metrics.jsonl could not be written ({why})"

    def show(self):
        """The console, of the latest train row: the bar's position and postfix, or a plain line."""
        last = self.last_train
        held_out = f" | held-out {self.last_eval[self.cfg.score]:.3f}" if self.last_eval else ""
        cut = f" | cut {last['truncated']:.1%}" if last.get("truncated") else ""  # responses at the length limit
        brief = (f"reward {last['reward']:.3f}{cut} | loss {last['loss']:.4g} | stale {last['staleness']:.1f}/"
                 f"{last['staleness_max']}{held_out}")
        if self.bar is not None:
            self.bar.update(last["step"] - self.bar.n)
            self.bar.set_postfix_str(brief, refresh=True)
        else:
            print(f"step {last['step']:5d}/{self.cfg.steps} | {brief} | beta {last['beta']:.4f} | lr {last['lr']:.2e} | "
                  f"wait {last['wait']:.2f}s | samples {last['samples']} | {last['time']:.0f}s", flush=True)

    def print(self, line: str, file=None):
        """A line on the console, above the bar if there is one."""
        if self.rank != 0:
            return
        if self.bar is not None:
            self.bar.write(line, file=file or sys.stdout)
        else:
            print(line, file=file or sys.stdout, flush=True)

    def summary(self):
        first, last, score = self.first_eval, self.last_eval, self.cfg.score.replace("_", " ")
        resumed = (f" | resumed at step {self.resumed['step']} ({self.resumed['score']:.3f})"
                   if self.resumed and "score" in self.resumed else "")
        x, y = self.cfg.generation_slowdown, self.cfg.train_slowdown  # tools/bench.py part 9's emulation: said
        slowed = "".join(f" | {what} slowed {factor:g}x (emulated)" for what, factor in (("generation", x), ("training", y))
                         if factor != 1)
        bound = self.cpu_bound(self.last_train) if self.last_train and "over_trainer" in self.last_train else ""
        slowed += f" | {bound}: the CPU, not the emulation, set the pace" if bound else ""
        reuse = f" | {self.last_train['reuse']:.2f} draws a trajectory" if self.last_train else ""
        self.print(f"done: {self.cfg.steps} steps in {self.now():.0f} s | held-out {score} {first['score']:.3f} "
                   f"(step {first['step']}) -> {last[self.cfg.score]:.3f} (step {last['step']}){resumed}{reuse}{slowed} | "
                   f"{self.cfg.out}")

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.rank == 0 and os.path.realpath(self.cfg.out) in HELD:  # the run's end: its folder is free
            os.close(HELD.pop(os.path.realpath(self.cfg.out)))


def check_out(out: str, resume: str | None):
    """Refuse in one line an --out that holds files, unless it is the run of --resume's checkpoint (the parent
    of its real path: OUT/checkpoint links to OUT/checkpoint-STEP), or that cannot be created and written
    (a file is written and removed). Folders made for the check are removed again: nothing is left until the
    run starts."""
    if os.path.isdir(out) and os.listdir(out):
        if not resume:  # a finished run's --resume alone would be refused as finished
            hint = ("it holds a finished run: pass a new --out, or --resume OUT/checkpoint with --steps "
                    "above its step" if os.path.isdir(os.path.join(out, "final")) else
                    "pass --resume to continue a run")
            raise ConfigError(f"--out: {out} exists and is not empty ({hint})")
        run = os.path.dirname(os.path.realpath(resume))
        if os.path.realpath(out) != run:  # another run's rows, checkpoints and final model would be overwritten
            raise ConfigError(f"--out: {out} exists and is not empty, and is not the run of the checkpoint "
                              f"({run}); pass a new or empty folder, or leave --out out to continue in {run}")
        hold(out)  # (a fresh run's folder is new or empty: its Log holds it)
    made, parent = [], os.path.abspath(out)
    while not os.path.exists(parent):
        made.append(parent)
        parent = os.path.dirname(parent)
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, f".write-test-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"--out: cannot write to {out} ({e.strerror or type(e).__name__})") from None
    finally:
        for folder in made:  # deepest first
            try:
                os.rmdir(folder)
            except OSError:
                pass


HELD = {}  # run folder (real path) -> a descriptor of it, locked while this process's run lives there


def hold(out: str):
    """Lock the folder OUT while this process's run lives (flock: the lock goes with its holder, killed or
    not). A run that still runs there is refused in one line: two runs in one folder interleave their rows and
    delete each other's checkpoints."""
    if os.path.realpath(out) in HELD:
        return
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"--resume: a run still runs in {out}: stop it first, or resume once it has "
                          f"ended") from None
    HELD[os.path.realpath(out)] = fd
