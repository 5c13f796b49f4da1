"""tools/gpu_probe.py and tools/gpu_checks.py on the CPU: their --reduced runs (the same code at a toy's shapes: every
part and check) print one JSON line a figure, each naming its torch, and exit 0; the parts run in the order given; a
part that raises prints its error line and the next part still runs; one that hangs past its limit has its stacks
dumped and ends the process; the torch APIs are reported; without a GPU and without --reduced they refuse in one line
before allocating anything; the checks can fail (a copy left gathered, an altered or unmapped tensor, a stale copy);
the pieces a GPU run rests on (the rotary buffers rebuilt after the meta device, the grouped-query attention of one
new token) compute what they should. tests/gpu_lease.sh's own tests: tests/test_gpu_lease.py."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import gpu_checks
import gpu_probe
from conftest import ROOT

PROBE = os.path.join(ROOT, "tools", "gpu_probe.py")
CHECKS = os.path.join(ROOT, "tools", "gpu_checks.py")
GROUP_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def in_process(monkeypatch, capsys):
    """Call gpu_probe.main in this process: the environment its process group writes is put back after (unless a
    group was already here, which main keeps); returns (exit status, its JSON lines, its stderr)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        for k in GROUP_ENV:
            monkeypatch.setenv(k, "0")
            monkeypatch.delenv(k)  # absent while main runs, absent again after

    def go(*argv, **kw):
        code = gpu_probe.main(list(argv), **kw)
        out, err = capsys.readouterr()
        return code, [json.loads(line) for line in out.splitlines()], err
    return go


@pytest.mark.engine
def test_the_probe_runs_reduced_on_the_cpu(tmp_path):
    """tools/gpu_probe.py --reduced, as a command: every part, one JSON line a figure, exit status 0."""
    from conftest import env
    p = subprocess.run([sys.executable, PROBE, "--reduced"], cwd=tmp_path, env=env(tmp_path), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    figures = {row["figure"] for row in rows}
    assert figures == {"machine", "torch APIs", "weight write into the shared copy", "MATH step peak memory",
                       "MATH step peak memory per block", "seeded sampling a decoding step", "decode model",
                       "decode step", "GSM8K training step", "timing", "done"}
    assert not any("error" in row for row in rows)
    assert all(row["on"] == f"torch {torch.__version__}, CUDA None, cpu" for row in rows)  # every figure names its torch
    by = {row["figure"]: row for row in rows}
    write = by["weight write into the shared copy"]
    assert write["seconds"] > 0 and write["tensors"] == len(gpu_probe.hf_shapes(gpu_probe.TOY)) == 27
    assert by["seeded sampling a decoding step"]["sequences"] == 256
    assert [row["blocks"] for row in rows if row["figure"] == "MATH step peak memory"] == [1, 3]
    assert by["GSM8K training step"]["pass_seconds"] > 0 and by["GSM8K training step"]["K"] == 4
    decode = [row for row in rows if row["figure"] == "decode step"]
    assert {(row["shape"], row["context"]) for row in decode} == {(s, c) for s in ("rho-math-1b", "Qwen2.5-7B")
                                                                  for c in gpu_probe.DECODE_TOY["contexts"]}
    for row in decode:  # the whole toy grid, eager on the CPU, and its fit
        assert row["mode"] == "eager" and row["note"] is None
        assert row["sequences"] == list(gpu_probe.DECODE_TOY["sequences"]) and all(t > 0 for t in row["seconds"])
        assert row["a"] is not None and row["b"] is not None
    timing = [row["part"] for row in rows if row["figure"] == "timing"]
    assert timing == [key for key, *_ in gpu_probe.parts()] and by["done"]["failed"] == []


def test_qwen_has_339_tensors():
    shapes = gpu_probe.hf_shapes(gpu_probe.QWEN)
    assert len(shapes) == 339 and abs(sum(math.prod(s) for s in shapes.values()) - gpu_probe.QWEN["params"]) < 0.01e9
    assert shapes["model.layers.27.self_attn.k_proj.bias"] == (512,) and shapes["lm_head.weight"] == (152064, 3584)


@pytest.mark.engine
def test_the_checks_run_reduced_on_the_cpu(tmp_path):
    """tools/gpu_checks.py --reduced, as a command: one line of figures a check, each as a GPU would need it."""
    from conftest import env
    p = subprocess.run([sys.executable, CHECKS, "--reduced"], cwd=tmp_path, env=env(tmp_path), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    assert [row["part"] for row in rows if row["figure"] == "timing"] == [key for key, *_ in gpu_checks.checks()]
    assert all(row["on"] == f"torch {torch.__version__}, CUDA None, cpu" for row in rows) and rows[-1]["failed"] == []
    by = {row["figure"]: row for row in rows}
    prints = by["fingerprints against the tolerance"]  # order alone moves no sum past the tolerance; a step does
    assert max(prints["fused"].values()) < 1 and prints["gpu_against_cpu"] < 1 and prints["embedding"]["excess"] < 1
    assert prints["one_step_behind"]["caught"] and prints["one_step_behind"]["excess"] > 1
    dog = by["watchdog's inputs"]
    assert dog["backend"] == "gloo" and dog["sequence_moved_by"] == {"cpu": 1}
    assert dog["seen_while_waiting"]["sleep"]["where"] is None  # the main thread in this file, not torch.distributed
    assert dog["spin"] is None  # on a GPU: the calibration, after a warm-up
    lagged = by["LaggedCopy"]
    assert lagged["max_gap"] == 0 and min(lagged["control_gaps"]) > 1e-4 and lagged["sharded_after_each"] == [True] * 3
    slot = by["flat_slot"]
    assert slot["tensors"] == 27 and slot["exact"] and slot["aligned_64"] and slot["copies_equal"]
    assert slot["block_bytes"] == slot["asked_bytes"] >= slot["gigabytes"] * 1e9 and slot["pinned"] is None
    assert by["Outbox.keep"]["prints_equal_each_tensors"]
    arrival = by["arrival check without vLLM"]
    assert arrival["checked"] == arrival["tensors"] == 27 and arrival["altered_caught"] and arrival["unmapped_caught"]


def test_the_parts_run_in_the_order_given(in_process):
    code, rows, _ = in_process("--reduced", "--parts", "seeded,apis,seeded")
    assert code == 0 and [row["part"] for row in rows if row["figure"] == "timing"] == ["seeded", "apis"]


def test_the_lagged_check_sees_a_copy_left_gathered(in_process, monkeypatch):
    """Without set_reshard_after_forward(True) (runtime/policy.LaggedCopy), FSDP2 keeps the root's parameters
    gathered after each rescore: the check says so."""
    from torch.distributed.fsdp import FSDPModule
    monkeypatch.setattr(FSDPModule, "set_reshard_after_forward", lambda self, *a, **k: None)
    code, rows, _ = in_process("--reduced", "--parts", "lagged", table=gpu_checks.checks)
    assert code == 0 and rows[1]["figure"] == "LaggedCopy" and rows[1]["sharded_after_each"] == [False] * 3


def test_a_part_past_its_limit_dumps_its_stacks_and_ends(tmp_path):
    """faulthandler's time-out: the stacks of every thread on stderr, exit status 1, the lines before it kept and no
    part after it run (tests/gpu_lease.sh starts those again)."""
    from conftest import env
    code = ("import sys, time; sys.path.insert(0, 'tools'); import gpu_probe; "
            "gpu_probe.seeded_sampling = lambda *a: time.sleep(60); "
            "sys.exit(gpu_probe.main(['--reduced', '--parts', 'apis,seeded,write'], limits={'seeded': 2}))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(tmp_path), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1, p.stderr[-2000:]
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    assert [row["figure"] for row in rows] == ["machine", "torch APIs", "timing"]
    assert "Timeout (0:00:02)!" in p.stderr and "in <lambda>" in p.stderr


def test_a_part_that_raises_prints_its_error_and_the_next_part_runs(in_process, monkeypatch):
    def broken(state, device, reduced):
        raise RuntimeError("no allocator accessor on this torch\nsecond line, not printed")
    monkeypatch.setattr(gpu_probe, "weight_write", broken)
    code, rows, err = in_process("--reduced", "--parts", "apis,write,seeded")
    assert code == 1
    assert [row["figure"] for row in rows] == ["machine", "torch APIs", "timing", "weight write into the shared copy",
                                               "timing", "seeded sampling a decoding step", "timing", "done"]
    on = rows[0]["on"]
    assert rows[3] == {"figure": "weight write into the shared copy", "part": "write",
                       "error": "RuntimeError: no allocator accessor on this torch", "on": on}
    assert rows[4] == {"figure": "timing", "part": "write", "seconds": rows[4]["seconds"], "ok": False, "on": on}
    assert rows[5]["sequences"] == 256 and rows[-1]["failed"] == ["write"]
    assert "Traceback" in err and "second line" in err  # the whole story on stderr


def test_the_apis_the_weight_path_uses_are_reported(in_process):
    code, rows, _ = in_process("--reduced", "--parts", "apis")
    assert code == 0
    apis = rows[1]
    assert apis["figure"] == "torch APIs" and set(apis["present"]) == set(gpu_probe.APIS)
    assert apis["present"]["torch._C._accelerator_getAllocatorSettings"] == hasattr(
        torch._C, "_accelerator_getAllocatorSettings")
    assert apis["present"]["torch.distributed.fsdp.fully_shard"]  # a submodule not yet imported is found too
    assert apis["present"]["torch.distributed.fsdp.FSDPModule.set_reshard_after_forward"] is True
    assert apis["present"]["torch.cuda.cudart().cudaHostRegister"] == "not checked: cudart() raised AssertionError"
    assert not gpu_probe.exists("torch.cuda.no_such_function") and not gpu_probe.exists("torch.no_such_module.x")


def test_without_a_gpu_the_full_shapes_are_refused_before_anything(in_process, monkeypatch):
    """Qwen2.5-7B's tensors on the CPU would meet the OOM killer, silently: one line and exit status 11 instead."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, rows, err = in_process()
    assert code == gpu_probe.NO_CUDA == 11 and rows == []
    assert err == ("tools/gpu_probe.py: no CUDA device here; pass --reduced to run the same code at a toy's shapes "
                   "on the CPU\n")
    code, rows, err = in_process("--parts", "apis,nope")
    assert code == 2 and rows == [] and "unknown nope" in err and len(err.splitlines()) == 1
    code, rows, err = in_process(table=gpu_checks.checks, name="tools/gpu_checks.py")
    assert code == 11 and rows == [] and err.startswith("tools/gpu_checks.py: no CUDA device here; pass --reduced")


@pytest.mark.parametrize("tool", [PROBE, CHECKS], ids=["probe", "checks"])
def test_the_command_refuses_without_a_gpu(tmp_path, tool):
    from conftest import env
    p = subprocess.run([sys.executable, tool], cwd=tmp_path, env=dict(env(tmp_path), CUDA_VISIBLE_DEVICES=""),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 11 and p.stdout == "" and len(p.stderr.splitlines()) == 1, p.stderr
    assert "pass --reduced" in p.stderr


def test_the_rotary_buffers_are_computed_after_the_meta_device():
    """to_empty gives the rotary embeddings' inv_freq memory but no values; build() makes them again, in float32
    whatever the weights' dtype."""
    for kind, shape, dtype in (("qwen2", gpu_probe.TOY, torch.float32), ("llama", gpu_probe.TOY_LLAMA, torch.bfloat16)):
        model = gpu_probe.build(kind, shape, 1, torch.device("cpu"), dtype)
        d = shape["hidden_size"] // shape["num_attention_heads"]
        want = 1.0 / (shape["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        rotary = model.model.rotary_emb
        assert rotary.inv_freq.dtype == torch.float32 and torch.allclose(rotary.inv_freq, want)
        assert torch.allclose(rotary.original_inv_freq, want) and next(model.parameters()).dtype == dtype


def test_grouped_query_attention_of_one_token_equals_the_repeated_heads():
    """attend: the query heads of a key/value head as its queries, against each key/value head repeated for its
    query heads (transformers' repeat_kv), one query each."""
    g = torch.Generator().manual_seed(0)
    n, H, Hk, T, d = 3, 8, 2, 5, 4
    q, keys, values = (torch.randn(*s, generator=g) for s in ((n, H, d), (n, Hk, T, d), (n, Hk, T, d)))
    want = torch.nn.functional.scaled_dot_product_attention(
        q.view(n, H, 1, d), keys.repeat_interleave(H // Hk, 1), values.repeat_interleave(H // Hk, 1)).view(n, H, d)
    assert torch.allclose(gpu_probe.attend(q, keys, values), want, atol=1e-6)
    assert not torch.allclose(gpu_probe.attend(q, keys.flip(1), values.flip(1)), want, atol=1e-3)  # heads matter
