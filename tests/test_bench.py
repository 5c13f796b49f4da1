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


def test_bench_generation_bound_quick(tiny_model, tmp_path):
    """Part 9 on a tiny budget (X in {1, 4}, synchronous and one searcher under the authors' ratio): rows,
    slowdowns, the reuse cap, ideal, picture."""
    out = tmp_path / "bench"
    p = subprocess.run([*BENCH, "--quick", "--parts", "9", "--out", str(out),
                        "--", "--model", tiny_model, "--steps", "4", "--prompts-per-step", "4",
                        "--samples-per-prompt", "4", "--max-new-tokens", "6", "--sync-every", "2"],
                       cwd=tmp_path, env=env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stdout[-3000:]
    assert "unclosed file" not in p.stdout, p.stdout[-3000:]
    with open(out / "bench.json") as f:
        gb = json.load(f)["generation_bound"]
    assert sorted((r["x"], r["searchers"]) for r in gb["rows"]) == [(1, 0), (1, 1), (4, 0), (4, 1)]
    for r in gb["rows"]:
        if r["x"] == 4:  # each round took 4 x its engine's calibrated cost alone, or longer by itself
            assert r["charged"] >= 1 - 1e-9 and r["contention"] > 0
        assert 1 <= r["steps"] <= 4 and r["uses"] > 0 and 0 <= r["staleness"] <= r["staleness_max"] <= 3
        if r["searchers"]:  # the barrier's ratio: k B K / (N x round) = 2 x 16 / (1 x 4 x 4), and the draws stayed within it
            assert (r["reuse"], r["max_reuse"]) == ("barrier", 2.0) and r["uses"] <= 2 + 1e-9
        assert (r["speedup"] is None) == (not (r["reached"] and next(
            s for s in gb["rows"] if s["x"] == r["x"] and s["searchers"] == 0)["reached"]))
        if r["searchers"] == 0:  # one round a step: its fresh-data throughput is its step rate
            assert r["speedup_throughput"] == pytest.approx(1.0)
    sync4 = next(r for r in gb["rows"] if r["x"] == 4 and r["searchers"] == 0)
    assert sync4["same_as_x1"]  # the slowdown changes no sample, only the time
    for x in ("1", "4"):
        i = gb["ideal"][x]
        assert i["G"] > 0 and i["T"] > 0 and i["bound"] == pytest.approx((i["G"] + i["T"]) / i["T"])
    if HAS_MATPLOTLIB:
        assert (out / "generation_bound.png").stat().st_size > 0
    else:  # the README's test line installs no matplotlib: the numbers are complete, the picture skipped
        assert not (out / "generation_bound.png").exists() and "9. picture skipped: matplotlib is not installed" in p.stdout
    assert "9. generation-bound, emulated" in p.stdout


def test_a_missing_matplotlib_skips_the_picture(tmp_path, monkeypatch, capsys):
    """Without matplotlib (here: its import made to fail), bench.py's picture is skipped with one line
    saying why and how to draw it later; plot.py alone refuses in one line, status 2."""
    import bench
    import plot
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    (tmp_path / "bench.json").write_text(json.dumps({"generation_bound": {}}))
    bench.picture(str(tmp_path / "bench.json"), str(tmp_path / "generation_bound.png"))
    assert capsys.readouterr().out.strip() == (
        "9. picture skipped: matplotlib is not installed (pip install matplotlib); "
        f"`python tools/plot.py --slowdown {tmp_path / 'bench.json'}` draws it later")
    assert not (tmp_path / "generation_bound.png").exists()
    with pytest.raises(SystemExit) as e:
        plot.main(["--slowdown", str(tmp_path / "bench.json"), "-o", str(tmp_path / "x.png")])
    assert e.value.code == 2 and capsys.readouterr().err.strip() == (
        "plot.py: matplotlib is not installed (pip install matplotlib); no picture drawn")
