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


def test_bench_equal_hardware_quick(tiny_model, tmp_path):
    """Part 9 on a tiny budget (X in {1, 4}, one searcher: the one-process baseline, the synchronous baseline on
    the searcher, streaming): rows, G, T and the ideal, the exact lag's sameness across X, the picture."""
    out = tmp_path / "bench"
    p = subprocess.run([*BENCH, "--quick", "--parts", "9", "--out", str(out),
                        "--", "--model", tiny_model, "--steps", "4", "--prompts-per-step", "4",
                        "--samples-per-prompt", "4", "--max-new-tokens", "6"],
                       cwd=tmp_path, env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stdout[-3000:]
    assert "unclosed file" not in p.stdout, p.stdout[-3000:]
    with open(out / "bench.json") as f:
        eh = json.load(f)["equal_hardware"]
    assert sorted((r["x"], r["mode"]) for r in eh["rows"]) == sorted(
        (x, m) for x in (1, 4) for m in ("one process", "sync", "stream"))
    for r in eh["rows"]:
        assert r["G"] > 0 and r["T"] > 0 and r["ideal"] == pytest.approx((r["G"] + r["T"]) / max(r["G"], r["T"]))
        assert 1 <= r["steps"] <= 4 and r["curve"][0][0] == 0
        if r["mode"] == "sync":  # the synchronous baseline on the searcher: every batch of the current weights
            assert r["staleness"] == 0 and r["speedup"] in (None, pytest.approx(1.0))
    sync4 = next(r for r in eh["rows"] if r["x"] == 4 and r["mode"] == "sync")
    assert sync4["same_as_x1"]  # the exact lag's samples do not depend on the slowdown: the same curve
    g1, g4 = (next(r["G"] for r in eh["rows"] if r["x"] == x and r["mode"] == "sync") for x in (1, 4))
    assert g4 > g1  # the emulated device is slower
    assert set(eh["summary"]["cells"]) == {f"1 {x:g} {m}" for x in (1, 4) for m in ("one process", "sync", "stream")}
    if HAS_MATPLOTLIB:
        assert (out / "equal_hardware.png").stat().st_size > 0
    else:  # the README's test line installs no matplotlib: the numbers are complete, the picture skipped
        assert not (out / "equal_hardware.png").exists() and "9. picture skipped: matplotlib is not installed" in p.stdout
    assert "9. asynchrony on equal hardware" in p.stdout


def test_a_missing_matplotlib_skips_the_picture(tmp_path, monkeypatch, capsys):
    """Without matplotlib (here: its import made to fail), bench.py's picture is skipped with one line
    saying why and how to draw it later; plot.py alone refuses in one line, status 2."""
    import bench
    import plot
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    (tmp_path / "bench.json").write_text(json.dumps({"equal_hardware": {}}))
    bench.picture(str(tmp_path / "bench.json"), str(tmp_path / "equal_hardware.png"))
    assert capsys.readouterr().out.strip() == (
        "9. picture skipped: matplotlib is not installed (pip install matplotlib); "
        f"`python tools/plot.py --slowdown {tmp_path / 'bench.json'}` draws it later")
    assert not (tmp_path / "equal_hardware.png").exists()
    with pytest.raises(SystemExit) as e:
        plot.main(["--slowdown", str(tmp_path / "bench.json"), "-o", str(tmp_path / "x.png")])
    assert e.value.code == 2 and capsys.readouterr().err.strip() == (
        "plot.py: matplotlib is not installed (pip install matplotlib); no picture drawn")


def test_a_star_at_an_x_already_run_is_not_run_again(tmp_path, monkeypatch, capsys):
    """Part 9's X star (where the synchronous round takes as long as its step) is not run again when it falls
    on an X already run (4 searchers on 2 cores: the round is longer than the step at X = 1): run twice into
    the same folders, the second set's times came out negative."""
    import bench
    runs = []
    monkeypatch.setattr(bench, "run_until_target", lambda searchers, seed, cap, run, *rest: runs.append(run) or dict(reached=True, seconds=10.0, step=20))
    monkeypatch.setattr(bench, "hardware_row", lambda run, r: dict(reached=True, seconds=10.0, from_first_step=5.0,
                                                                   G=1.0, T=0.1, step=20, staleness=0.0, curve=[]))
    eh = bench.equal_hardware([0], str(tmp_path), [], 60, False, [4], [1.0, "star"], ["sync"], 0.25, 5)
    assert len(runs) == len(set(runs)) == 2 and eh["slowdowns"] == [1.0]  # one process and sync at X = 1 only
    assert "9. N 4: the synchronous round takes as long as its step at X = 1 or below, already run" in capsys.readouterr().out
