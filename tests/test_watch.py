"""Runs people can watch: the console (a bar in a terminal, plain lines elsewhere), plot.py's
picture of a run, and the optional Weights & Biases logging (offline)."""

import glob
import json
import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

from conftest import HAS_WANDB, ROOT, SMALL, env, metrics



def test_plain_lines_when_not_a_terminal(logged_run):
    out, stdout = logged_run
    lines = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/5", "4/5", "5/5"]  # every --log-every steps, and the last
    assert "reward" in lines[0] and "stale" in lines[0] and "held-out" in lines[0]
    assert "\r" not in stdout.split("eval  step")[1]  # no bar redraws after the start
    assert len([r for r in metrics(out) if r["kind"] == "train"]) == 5  # metrics.jsonl keeps every step


@pytest.mark.engine
def test_progress_bar_in_a_terminal(tiny_model, tmp_path):
    """Under a pseudo-terminal: a tqdm bar with the time left and the latest values, and the
    evaluations printed above it; no plain step lines."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tba.py"), "--model", tiny_model, *SMALL, "--steps", "6",
                             "--eval-every", "3", "--out", str(tmp_path / "run")],
                            cwd=tmp_path, env=env(tmp_path), stdout=slave, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    output, deadline = b"", time.time() + 300
    while time.time() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            output += chunk
        elif proc.poll() is not None:
            break
    proc.wait(timeout=30)
    os.close(master)
    text = output.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert "6/6 [" in text and "<00:00, reward " in text  # the bar: steps, elapsed < remaining, the postfix
    assert "stale " in text and "held-out " in text and "loss " in text
    assert len(re.findall(r"eval  step +\d+ \| held-out accuracy", text)) >= 2  # printed above the bar
    assert not any(line.lstrip("\r").startswith("step ") for line in text.splitlines())


@pytest.mark.engine
def test_plot_draws_a_run(logged_run, tmp_path):
    pytest.importorskip("matplotlib")
    out, _ = logged_run
    png = tmp_path / "run.png"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot.py"), str(out), str(out), "-o", str(png)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20000  # six panels drawn
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot.py"), str(tmp_path)], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.strip() == f"plot.py: {tmp_path} has no metrics.jsonl (not a run folder)"


@pytest.mark.engine
def test_plot_draws_trl_runs_and_the_study(tmp_path):
    """The benchmark's pictures: a trl_grpo.py run folder (train rows without staleness or wait, labelled by its
    TRL version) beside a tba.py one, and part 7's study from a bench.json."""
    pytest.importorskip("matplotlib")
    trl = tmp_path / "trl"
    trl.mkdir()
    (trl / "config.json").write_text(json.dumps({"versions": {"trl": "9.9.9"}}))
    rows = [{"kind": "eval", "step": 0, "accuracy": 0.3, "time": 1.0, "overhead": 0.0}]
    rows += [{"kind": "train", "step": s, "time": 1.0 + s, "reward": 0.1, "loss": 0.01} for s in range(1, 6)]
    rows += [{"kind": "eval", "step": 5, "accuracy": 0.4, "time": 6.0, "overhead": 0.2}]
    (trl / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = tmp_path / "trl.png"
    p = subprocess.run([sys.executable, "-c", f"import sys; sys.argv = ['plot.py', {str(trl)!r}, '-o', {str(png)!r}]; "
                        f"sys.path.insert(0, {os.path.join(ROOT, 'tools')!r}); import plot, matplotlib.axes as a; "
                        "labels = []; legend = a.Axes.legend; "
                        "a.Axes.legend = lambda self, *x, **k: labels.extend(h.get_label() for h in self.get_lines()) or legend(self, *x, **k); "
                        "plot.main(); print(labels)"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "trl (TRL 9.9.9 GRPOTrainer)" in p.stdout and png.stat().st_size > 20000
    study = {"off_policy": {"losses": ["tb", "grpo"], "rows": [
        {"loss": loss, "lag": lag, "seed": seed, "start": 0.3, "final": 0.5 - 0.01 * lag, "staleness": lag - 0.5 * (lag > 0)}
        for loss in ("tb", "grpo") for lag in (0, 4) for seed in (0, 1)]}}
    (tmp_path / "bench.json").write_text(json.dumps(study))
    png = tmp_path / "study.png"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot.py"), "--study", str(tmp_path / "bench.json"), "-o", str(png)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10000


def test_plot_study_checks_its_file_before_matplotlib(tmp_path, monkeypatch, capsys):
    """plot.py --study on a missing or hand-edited bench.json: one line naming the file (and the field), status 2, and
    that before matplotlib is looked for (here missing), never a traceback."""
    import plot
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    path = tmp_path / "bench.json"
    row = dict(loss="tb", lag=0, seed=0, start=0.3, final=0.5, staleness=0.0)

    def refused(line, study=None):
        if study is not None:
            path.write_text(json.dumps(study))
        with pytest.raises(SystemExit) as e:
            plot.main(["--study", str(path), "-o", str(tmp_path / "x.png")])
        assert e.value.code == 2 and capsys.readouterr().err.strip() == f"plot.py: {line}"

    refused(f"{path} does not exist")
    refused(f"{path} holds no part 7 (bench.py --parts 7)", {"equal_hardware": {}})
    refused(f"{path}: off_policy.losses is missing", {"off_policy": {"rows": [row]}})
    refused(f"{path}: off_policy.rows is empty", {"off_policy": {"losses": ["tb"], "rows": []}})
    refused(f"{path}: off_policy.rows[1].final is missing",
            {"off_policy": {"losses": ["tb"], "rows": [row, {k: v for k, v in row.items() if k != "final"}]}})
    refused(f'{path}: off_policy.rows[0].lag is "4", not a number', {"off_policy": {"losses": ["tb"], "rows": [dict(row, lag="4")]}})
    refused("matplotlib is not installed (pip install matplotlib); no picture drawn",
            {"off_policy": {"losses": ["tb"], "rows": [row]}})  # a good file: only then is matplotlib looked for


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is optional and not installed")
def test_wandb_gets_the_same_rows(logged_run):
    """--wandb in offline mode: every row of metrics.jsonl reaches the W&B run file (keys and values)."""
    out, _ = logged_run
    (run_file,) = glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = open(run_file, "rb").read()
    rows = metrics(out)
    for r in rows:
        key = "train/loss" if r["kind"] == "train" else "eval/accuracy"
        value = r["loss"] if r["kind"] == "train" else r["accuracy"]
        text = json.dumps(int(value) if float(value).is_integer() else value)  # W&B writes 25.0 as 25
        assert key.encode() in data and text.encode() in data, (key, value)


@pytest.mark.engine
def test_wandb_missing_is_one_line(tiny_model, tmp_path, monkeypatch, capsys):
    """Without the package: one line saying how to install it, status 2, before anything starts."""
    import tba
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        tba.main(["--model", tiny_model, "--wandb", "tba-tests"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err == "tba.py: error: --wandb: the wandb package is not installed " \
                                       "(it is optional: pip install wandb)"
    assert not (tmp_path / "runs").exists()


def test_resumed_rows_are_told_apart_and_the_latest_branch_is_read(tmp_path):
    """Each resume evaluates the checkpoint's step again and redoes the steps after it: a resumed process marks its
    rows `resumed: STEP`, and plot.read (bench.py's reader too) keeps, for each step, the latest branch's rows. Here
    a run saved at 5 and died at 7; a resume from 5 died at 8; a second resume from 5 went to 10 (saved); a third,
    from 10, to 12."""
    import dataclasses
    import plot
    from runtime.config import Config
    from runtime.log import Log
    cfg = dataclasses.replace(Config(), out=str(tmp_path))
    log = Log(cfg, 0, 0.0, 5, resumed={"step": 5})  # what tba.Trainer makes for --resume of a step-5 checkpoint
    log.eval(5, {"accuracy": 0.5}, {}, 1.0, (0.0, 0.0))
    log.close()
    assert [r["resumed"] for r in map(json.loads, open(tmp_path / "metrics.jsonl"))] == [5]
    train = lambda step, who, resumed=None: dict(kind="train", step=step, who=who, **({"resumed": resumed} if resumed else {}))
    evals = lambda step, who, resumed=None: dict(train(step, who, resumed), kind="eval")
    rows = [evals(0, "a"), *[train(s, "a") for s in range(1, 6)], evals(5, "a"), train(6, "a"), train(7, "a"),
            train(6, "b", 5), evals(5, "b", 5), train(7, "b", 5), train(8, "b", 5),
            evals(5, "c", 5), *[train(s, "c", 5) for s in range(6, 11)], evals(10, "c", 5),
            train(11, "d", 10), evals(10, "d", 10), train(12, "d", 10), evals(12, "d", 10)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got_train, got_evals, _ = plot.read(str(tmp_path))
    assert [(r["step"], r["who"]) for r in got_train] == [(s, "a") for s in range(1, 6)] + [
        (s, "c") for s in range(6, 11)] + [(11, "d"), (12, "d")]
    assert [(r["step"], r["who"]) for r in got_evals] == [(0, "a"), (5, "c"), (10, "d"), (12, "d")]
    plain = [evals(0, "a"), train(1, "a"), evals(1, "a")]  # a run never resumed: as it is
    assert plot.latest(plain) == plain


def test_plot_refuses_what_it_cannot_draw_in_one_line(tmp_path, capsys):
    """A run being written (its last line half there): drawn without it, saying so; a bad line elsewhere and a
    run with no rows yet: one line, status 2; -o into a folder that does not exist: the folder is made."""
    pytest.importorskip("matplotlib")
    import plot
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"kind": "eval", "step": 0, "accuracy": 0.3, "time": 1.0, "overhead": 0.0}]
    rows += [{"kind": "train", "step": s, "time": 1.0 + s, "reward": 0.1, "loss": 0.01, "staleness": 0.0,
              "staleness_max": 0, "wait": 0.0} for s in range(1, 4)]
    whole = "".join(json.dumps(r) + "\n" for r in rows)
    (run / "metrics.jsonl").write_text(whole + '{"kind": "train", "st')
    png = tmp_path / "new" / "folder" / "run.png"
    plot.main([str(run), "-o", str(png)])
    out, err = capsys.readouterr()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.strip() == str(png)
    assert err.strip() == f"plot.py: {run / 'metrics.jsonl'}: its last line is incomplete (still being written?); left out"

    def refused(text, line):
        (run / "metrics.jsonl").write_text(text)
        with pytest.raises(SystemExit) as e:
            plot.main([str(run), "-o", str(tmp_path / "x.png")])
        assert e.value.code == 2 and capsys.readouterr().err.strip() == line
        assert not (tmp_path / "x.png").exists()

    refused(whole.replace("\n", "\n{oops\n", 1), f"plot.py: {run / 'metrics.jsonl'} line 2: not valid JSON")
    refused(whole + "{oops\n", f"plot.py: {run / 'metrics.jsonl'} line 5: not valid JSON")  # complete, yet bad
    refused("", f"plot.py: {run} has no rows yet (its metrics.jsonl is empty)")
    (tmp_path / "file").write_text("")
    (run / "metrics.jsonl").write_text(whole)
    with pytest.raises(SystemExit) as e:
        plot.main([str(run), "-o", str(tmp_path / "file" / "x.png")])
    assert e.value.code == 2 and capsys.readouterr().err.strip().startswith(
        f"plot.py: cannot write {tmp_path / 'file' / 'x.png'} (")


def test_train_rows_count_the_tokens_generated_and_the_batchs_response_length(tmp_path):
    """A train row's `tokens`: the response tokens of every trajectory received over the run (the fleet's count, which
    checkpoints carry); `response_length`: the batch's mean, in tokens."""
    import dataclasses
    import types

    import numpy as np
    from buffer import ReplayBuffer, ReuseCap, Trajectory
    from runtime.config import Config
    from runtime.log import Log
    from runtime.slowdown import TrainClock
    log = Log(dataclasses.replace(Config(), out=str(tmp_path)), 0, 0.0)
    batch = [[Trajectory(0, np.arange(n, dtype=np.int32), 1.0, 0.0, 0.0, 0) for n in (2, 4)],
             [Trajectory(1, np.arange(n, dtype=np.int32), 0.0, 0.0, 0.0, 0) for n in (6, 8)]]
    fleet = types.SimpleNamespace(received=12, tokens=57, verified={}, nodes=None, sent={})
    log.train_row(1, batch, {"loss": 0.5}, fleet, ReplayBuffer(4, 1.0, 0.0), ReuseCap(0, 1), TrainClock(1.0))
    log.close()
    row = json.loads(open(tmp_path / "metrics.jsonl").read())
    assert (row["samples"], row["tokens"], row["response_length"]) == (12, 57, 5.0)


def test_an_eval_rows_example_names_the_score_it_holds():
    """The eval row's example holds its completion's value of the task's held-out metric, under that metric's name
    (`accuracy`), not under `reward`: a task may shape its training reward apart from it (countdown)."""
    import types
    from tasks.task import Scorer
    scorer = types.SimpleNamespace(engine=types.SimpleNamespace(tokenizer=types.SimpleNamespace(
        decode=lambda ids, skip_special_tokens: "2+2=")), cfg=types.SimpleNamespace(score="accuracy"))
    assert Scorer.example(scorer, [[5, 6]], ["4"], [1]) == {"prompt": "2+2=", "completion": "4", "accuracy": 1.0}
    assert Scorer.example(scorer, [[5, 6]], ["4"], [0.3], "score")["score"] == 0.3
