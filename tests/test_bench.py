"""bench.py on a tiny budget: it runs end to end, its bench.json is well formed, and it leaves no file
open (Python's ResourceWarning, shown with -W); without matplotlib it skips its picture, saying so."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, env

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
BENCH = [sys.executable, "-W", "always::ResourceWarning", os.path.join(ROOT, "tools", "bench.py")]


@pytest.mark.engine
def test_bench_quick(tiny_model, tmp_path):
    out = tmp_path / "bench"
    p = subprocess.run([*BENCH, "--quick", "--out", str(out), "--",
                        "--model", tiny_model, "--steps", "6", "--prompts-per-step", "4", "--samples-per-prompt", "4",
                        "--max-new-tokens", "6"],
                       cwd=tmp_path, env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:]
    assert "unclosed file" not in p.stdout, p.stdout[-3000:]
    with open(out / "bench.json") as f:
        r = json.load(f)
    assert r["machine"]["cores"] >= 1 and r["seeds"] == [0]
    runs = r["time_to_target"]
    assert sorted(x["searchers"] for x in runs) == [0, 1]
    for x in runs:
        assert isinstance(x["reached"], bool) and (x["seconds"] is None) == (not x["reached"])
        assert x["target"] == x["start_accuracy"] + 0.15
        assert x["seconds_per_step"] > 0 and x["first_step_seconds"] > 0
        assert x["curve"][0][1] == 0 and all(0 <= acc <= 1 for _, _, acc in x["curve"])
    (async_run,) = [x for x in runs if x["searchers"] == 1]
    assert 0 < async_run["utilisation"] <= 1
    tiny = r["sync_cost"]["tiny"]
    assert tiny["publish"] > 0 and tiny["reload"] > 0 and tiny["plain_copy"] > 0 and tiny["ratio"] > 0
    assert r["searcher_overhead"]["ratio"] > 0 and r["trainer_overhead"]["ratio"] > 0
    for line in ("1. time to target", "2. trainer utilisation", "3. weight sync", "4. searcher", "5. trainer"):
        assert line in p.stdout


@pytest.mark.engine
def test_bench_equal_hardware_quick(tiny_model, tmp_path):
    """Part 9 on a tiny budget (one searcher, G_1 / T = 1 with both phases emulated: the synchronous baseline on the
    searcher, then streaming at least as long): one calibration handed to both runs, rows with G, T, the ideal,
    throughput apart from learning, the accuracy at the synchronous run's time, the CPU used and the share over
    budget; the picture."""
    out = tmp_path / "bench"
    p = subprocess.run([*BENCH, "--quick", "--parts", "9", "--out", str(out),
                        "--", "--model", tiny_model, "--steps", "6", "--prompts-per-step", "4",
                        "--samples-per-prompt", "4", "--max-new-tokens", "6"],
                       cwd=tmp_path, env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stdout[-3000:]
    assert "unclosed file" not in p.stdout, p.stdout[-3000:]
    with open(out / "bench.json") as f:
        eh = json.load(f)["equal_hardware"]
    costs = json.loads((out / "calibration.json").read_text())
    three = ("seconds_per_token", "train_step", "tokens_per_batch")  # tba.py reads the first two, --costs all three
    assert costs == {k: eh["costs"][k] for k in three} and all(v > 0 for v in costs.values())
    assert sorted((r["ratio"], r["mode"]) for r in eh["rows"]) == [(1.0, "stream"), (1.0, "sync")]
    for r in eh["rows"]:
        assert r["G"] > 0 and r["T"] > 0 and r["ideal"] == pytest.approx((r["G"] + r["T"]) / max(r["G"], r["T"]))
        assert r["steps_per_s"] > 0 and r["cpu"] > 0 and 0 <= r["over_budget"] and r["curve"][0][0] == 0
        config = json.loads((out / f"hardware-n1-r1-linear-{r['mode']}-seed0" / "config.json").read_text())
        assert (config["generation_slowdown"], config["train_slowdown"]) == (r["x"], r["y"]) and r["y"] > 1
        assert config["calibration"] == str(out / "calibration.json")  # the same costs for both modes
        if r["mode"] == "sync":
            assert r["staleness"] == 0 and r["speedup"] == pytest.approx(1.0)
    sync, stream = sorted(eh["rows"], key=lambda r: r["mode"] != "sync")
    if sync["reached"]:  # streaming ran at least as long as the synchronous run took: its accuracy at that time
        assert stream["accuracy_at_sync"] is not None
    assert set(eh["summary"]["cells"]) == {f"1 1.0 {sync['x']} {sync['y']} linear {m}" for m in ("sync", "stream")}
    if HAS_MATPLOTLIB:
        assert (out / "equal_hardware.png").stat().st_size > 0
    else:  # the README's test line installs no matplotlib: the numbers are complete, the picture skipped
        assert not (out / "equal_hardware.png").exists() and "9. picture skipped: matplotlib is not installed" in p.stdout
    assert "9. asynchrony on equal hardware" in p.stdout


def test_a_point_gives_its_ratio_of_round_to_step():
    """Part 9's point: Y makes the training step STEP seconds (MIN_Y x a step alone where that is longer), X makes
    N searchers' synchronous round `ratio` x that, from the calibration's costs (a batch's tokens over N searchers)."""
    import bench
    costs = dict(seconds_per_token=2e-4, train_step=0.1, tokens_per_batch=1000)
    for ratio, n in ((0.5, 4), (2, 4), (4, 1)):
        x, y = bench.point(costs, ratio, n)
        T, G = y * costs["train_step"], x * costs["tokens_per_batch"] / n * costs["seconds_per_token"]
        assert T == pytest.approx(bench.STEP, rel=0.01) and G / T == pytest.approx(ratio, rel=0.01)
    # a step alone slower than STEP (a busy machine's calibration): T = MIN_Y x it, the trainer still emulated
    slow = dict(costs, train_step=0.5)
    x, y = bench.point(slow, 1.0, 4)
    T, G = y * slow["train_step"], x * slow["tokens_per_batch"] / 4 * slow["seconds_per_token"]
    assert y == bench.MIN_Y > 1 and G / T == pytest.approx(1.0, rel=0.01)


# a row of part 9 as bench.py's hardware_row writes it, with the fields plot.py --slowdown reads
ROW = dict(searchers=1, ratio=1.0, x=2.0, y=1.5, shape="linear", mode="sync", seed=0, ideal=1.8, speedup_first_step=1.0,
           steps_per_s=0.5, step=6, reached=True)


def test_part9_in_parts_is_read_as_one(tmp_path):
    """plot.py --slowdown A B: a sweep run in two invocations drawn as one (every row, every searcher count)."""
    import plot
    for name, n, ratio in (("a", 4, 1.0), ("b", 1, 2.0)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"equal_hardware": {
            "gain": 0.15, "searchers": [n], "rows": [dict(ROW, searchers=n, ratio=ratio, mode="sync")]}}))
    eh = plot.read_part9([str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert eh["searchers"] == [1, 4] and [r["ratio"] for r in eh["rows"]] == [1.0, 2.0] and eh["gain"] == 0.15
    # another target, or a file without part 9: refused in one line (plot.main: status 2), not drawn together
    (tmp_path / "c.json").write_text(json.dumps({"equal_hardware": {"gain": 0.25, "searchers": [4], "rows": []}}))
    (tmp_path / "d.json").write_text(json.dumps({"settings": {}}))
    for other, line in (("c", f"{tmp_path / 'c.json'}: another target or other emulated costs than {tmp_path / 'a.json'}"),
                        ("d", f"{tmp_path / 'd.json'} holds no part 9 (bench.py --parts 9)")):
        with pytest.raises(plot.BadRun) as e:
            plot.read_part9([str(tmp_path / "a.json"), str(tmp_path / f"{other}.json")])
        assert str(e.value) == line


def test_a_missing_matplotlib_skips_the_picture(tmp_path, monkeypatch, capsys):
    """Without matplotlib (here: its import made to fail), bench.py's picture is skipped with one line
    saying why and how to draw it later; plot.py alone refuses in one line, status 2."""
    import bench
    import plot
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    (tmp_path / "bench.json").write_text(json.dumps({"equal_hardware": {"gain": 0.15, "searchers": [1], "rows": [ROW]}}))
    bench.picture(str(tmp_path / "bench.json"), str(tmp_path / "equal_hardware.png"))
    assert capsys.readouterr().out.strip() == (
        "9. picture skipped: matplotlib is not installed (pip install matplotlib); "
        f"`python tools/plot.py --slowdown {tmp_path / 'bench.json'}` draws it later")
    assert not (tmp_path / "equal_hardware.png").exists()
    with pytest.raises(SystemExit) as e:
        plot.main(["--slowdown", str(tmp_path / "bench.json"), "-o", str(tmp_path / "x.png")])
    assert e.value.code == 2 and capsys.readouterr().err.strip() == (
        "plot.py: matplotlib is not installed (pip install matplotlib); no picture drawn")


def test_plot_checks_a_bench_json_before_matplotlib(tmp_path, monkeypatch, capsys):
    """plot.py --slowdown on a hand-edited or missing bench.json: one line naming the file and the field, status 2,
    before matplotlib is looked for (here missing: a file's fault is still the one named), never a traceback."""
    import plot
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    good = {"equal_hardware": {"gain": 0.15, "searchers": [1], "rows": [ROW], "costs": None}}
    path = tmp_path / "bench.json"

    def refused(text, line):
        path.write_text(text)
        with pytest.raises(SystemExit) as e:
            plot.main(["--slowdown", str(path), "-o", str(tmp_path / "x.png")])
        assert e.value.code == 2 and capsys.readouterr().err.strip() == f"plot.py: {line}"

    def edited(change, line):
        part = json.loads(json.dumps(good))
        change(part["equal_hardware"])
        refused(json.dumps(part), line)

    with pytest.raises(SystemExit) as e:
        plot.main(["--slowdown", str(tmp_path / "none.json")])
    assert e.value.code == 2 and capsys.readouterr().err.strip() == f"plot.py: {tmp_path / 'none.json'} does not exist"
    refused("", f"{path} does not read as a bench.json (not JSON)")
    refused("[1, 2]", f"{path} holds no part 9 (bench.py --parts 9)")
    edited(lambda eh: eh.pop("gain"), f"{path}: equal_hardware.gain is missing")
    edited(lambda eh: eh.update(gain="0.15"), f'{path}: equal_hardware.gain is "0.15", not a number')
    edited(lambda eh: eh.update(searchers=[]), f"{path}: equal_hardware.searchers is [], not a list of searcher counts")
    edited(lambda eh: eh.update(rows={}), f"{path}: equal_hardware.rows is {{}}, not a list")
    edited(lambda eh: eh.update(rows=[3]), f"{path}: equal_hardware.rows[0] is not an object")
    edited(lambda eh: eh["rows"][0].pop("shape"), f"{path}: equal_hardware.rows[0].shape is missing")
    edited(lambda eh: eh["rows"][0].update(step=True), f"{path}: equal_hardware.rows[0].step is true, not a number or null")
    edited(lambda eh: eh["rows"][0].update(searchers=1.5), f"{path}: equal_hardware.rows[0].searchers is 1.5, not a whole number")
    edited(lambda eh: eh.update(costs=[]), f"{path}: equal_hardware.costs is [], not an object or null")
    path.write_text(json.dumps(good))  # a good file: only now is matplotlib looked for
    with pytest.raises(SystemExit) as e:
        plot.main(["--slowdown", str(path), "-o", str(tmp_path / "x.png")])
    assert e.value.code == 2 and "matplotlib is not installed" in capsys.readouterr().err

