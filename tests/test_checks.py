"""Memory and start-up checks: activation checkpointing that changes no number, scoring
passes without a KV cache, vLLM's engine core kept in the searcher process, and resuming from a
checkpoint that is incomplete or run with other flags."""

import os
import re
import traceback

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from runtime import checks
from runtime import gpu
from runtime import ranks
from runtime import policy
import tba
from runtime.config import Config
from buffer import ReplayBuffer
from conftest import free_port, metrics, report_of, run_tba
from runtime.errors import ConfigError
from test_faults import SMALL, sync_checkpoint


# ===== --activation-checkpointing =================================================================
def recompute_rank(path, port, results):
    """One gloo rank: the gradient of tba.backward on one batch, with and without recomputation, and
    the bytes autograd saved for the backward pass in each case."""
    import numpy as np
    from buffer import Trajectory
    try:
        torch.set_num_threads(1)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cfg = Config(model=path, prompts_per_step=2, samples_per_prompt=4, micro_batch=8, timeout=60)
        ranks.init_distributed(cfg.timeout, "cpu")
        rng = np.random.default_rng(0)
        prompts = [rng.integers(4, 90, size=int(n)).tolist() for n in rng.integers(5, 12, size=4)]
        batch = [[Trajectory(p, rng.integers(4, 90, size=int(rng.integers(2, 7))).astype(np.int32),
                             float(rng.integers(2)), -5.0, -5.0, 0) for _ in range(4)] for p in (0, 2)]
        out = {}
        for recompute in (False, True):
            model = policy.load_policy(path, torch.device("cpu"), "float32", recompute=recompute)
            saved = []

            def pack(t):
                saved.append(t.numel() * t.element_size())
                return t
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                sums = tba.gradient(cfg)(model, batch, 0, 1, prompts, 0, torch.device("cpu"), cfg, beta=cfg.beta)
            out[recompute] = dict(loss=sums["loss"], saved=sum(saved),
                                  grads={n: p.grad.full_tensor().clone() for n, p in model.named_parameters()})
        results.put({"loss": [out[r]["loss"] for r in (False, True)], "saved": [out[r]["saved"] for r in (False, True)],
                     "differ": [n for n in out[False]["grads"]
                                if not torch.equal(out[False]["grads"][n], out[True]["grads"][n])],
                     "names": sorted(out[False]["grads"]) == sorted(out[True]["grads"])})
    except BaseException:
        results.put({"error": traceback.format_exc()})
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.engine
@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_activation_checkpointing_saves_less_and_changes_no_gradient(arch, tmp_path):
    import models
    path = str(tmp_path / "model")
    kwargs = dict(arch="gpt_neox", tokenizer=models.make_bpe_tokenizer()) if arch == "gpt_neox" else {}
    models.make_model(path, hidden=64, layers=3, heads=2, **kwargs)
    got = report_of(recompute_rank, path)
    assert got["names"] and got["differ"] == [], got["differ"]  # bit for bit, same parameter names
    assert got["loss"][0] == got["loss"][1]
    assert got["saved"][1] < 0.6 * got["saved"][0], got["saved"]  # the blocks' activations are not kept


@pytest.mark.engine
def test_activation_checkpointing_gives_the_same_run(tiny_model, tmp_path):
    """The synchronous run, same seed, with and without: the same loss rows and final weights."""
    from transformers import AutoModelForCausalLM
    common = ["--model", tiny_model, "--searchers", "0", "--steps", "4", "--seed", "5", *SMALL]
    for name, extra in (("plain", []), ("recompute", ["--activation-checkpointing"])):
        p = run_tba([*common, *extra, "--out", str(tmp_path / name)], tmp_path)
        assert p.returncode == 0, p.stdout[-3000:]
    rows = {n: [(r["step"], r["loss"], r["reward"]) for r in metrics(tmp_path / n) if r["kind"] == "train"]
            for n in ("plain", "recompute")}
    assert rows["plain"] == rows["recompute"] and len(rows["plain"]) == 4
    a, b = (AutoModelForCausalLM.from_pretrained(tmp_path / n / "final").state_dict() for n in ("plain", "recompute"))
    assert all(torch.equal(a[k], b[k]) for k in a)


# ===== scoring passes build no KV cache ==========================================================
def test_scoring_builds_no_kv_cache(tiny_neox, tiny_rm):
    """pi_ref's log-probs (loss.sequence_logprobs, also the trainer's) and the reward model's scores
    run one forward pass: a KV cache there is memory outside vLLM's budget for nothing."""
    import numpy as np
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from loss import collate, sequence_logprobs
    from rewards import RewardModel
    caches = []
    record = lambda module, args, kwargs, output: caches.append(getattr(output, "past_key_values", None))
    ref = AutoModelForCausalLM.from_pretrained(tiny_neox).eval()
    ref.config.use_cache = True  # as the configs of Pythia and Llama checkpoints say
    ref.register_forward_hook(record, with_kwargs=True)
    pairs = [([5, 6, 7], np.array([8, 9], np.int32)), ([5, 6], np.array([10, 11, 12], np.int32))]
    with torch.no_grad():
        sequence_logprobs(ref, *collate(pairs, 0, "cpu"), 1.0)
    rm = RewardModel(tiny_rm, "cpu", "float32", AutoTokenizer.from_pretrained(tiny_neox), False)
    rm.model.config.use_cache = True
    rm.model.base_model.register_forward_hook(record, with_kwargs=True)
    rm.score([[5, 6, 7, 8], [5, 6]])
    assert len(caches) == 2 and caches == [None, None], caches


# ===== VLLM_ENABLE_V1_MULTIPROCESSING ===========================================================
@pytest.mark.engine
def test_vllm_multiprocessing_is_refused(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    p = run_tba(["--model", tiny_model, "--steps", "1", *SMALL, "--out", str(tmp_path / "run")], tmp_path)
    assert p.returncode == 2, p.stdout[-3000:]
    assert p.stdout.strip().splitlines() == [
        "tba.py: error: VLLM_ENABLE_V1_MULTIPROCESSING=1: tba.py keeps vLLM's engine core in the searcher process "
        "(the shared weights and their lock are there); unset it or set it to 0"], p.stdout[-3000:]


# ===== resume edge cases ==========================================================================
@pytest.fixture(scope="module")
def checkpoint(tiny_model, tmp_path_factory):
    return sync_checkpoint(tmp_path_factory, tiny_model)[0] / "checkpoint"


@pytest.mark.engine
def test_resume_without_model_weights_is_refused(tiny_model, checkpoint, tmp_path, refusal):
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    os.remove(broken / "model" / "model.safetensors")
    status, lines = refusal(["--model", tiny_model, "--searchers", "0", *SMALL, "--resume", str(broken),
                             "--out", str(tmp_path / "b")])
    assert status == 2 and lines == [
        f"tba.py: error: --resume: {broken / 'model'} holds no weights (none of model.safetensors, "
        f"model.safetensors.index.json, pytorch_model.bin, pytorch_model.bin.index.json; an incomplete checkpoint?)"]


@pytest.mark.engine
def test_resume_with_truncated_weights_is_refused(tiny_model, checkpoint, tmp_path, refusal):
    """A checkpoint whose model.safetensors was cut short (a full disk, a copy stopped half-way): one line. Before, a
    SafetensorError traceback from load_policy."""
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    weights = broken / "model" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])
    status, lines = refusal(["--model", tiny_model, "--searchers", "0", *SMALL, "--resume", str(broken),
                             "--out", str(tmp_path / "b")])
    assert status == 2 and len(lines) == 1 and lines[0].startswith(
        f"tba.py: error: --resume: {weights} is truncated (its tensors end at byte "), lines
    assert lines[0].endswith(": it would not load; an incomplete checkpoint?"), lines


def test_a_checkpoint_without_its_buffer_or_model_config_is_refused_in_one_line(tmp_path):
    """runtime.checkpoint.load_checkpoint names the file an incomplete checkpoint lacks, before anything reads it."""
    from runtime.checkpoint import load_checkpoint
    (tmp_path / "model").mkdir()
    (tmp_path / "trainer.pt").write_bytes(b"")
    for name in ("buffer.npz", "model/config.json"):
        with pytest.raises(ConfigError) as e:
            load_checkpoint(str(tmp_path))
        assert str(e.value) == f"--resume: {tmp_path} has no {name} (an incomplete checkpoint?)"
        (tmp_path / name).write_text("{}")


def test_a_damaged_safetensors_file_is_named_from_its_header(tmp_path):
    """hub.safetensors_damage reads the header alone (plain json and struct) and finds every damage that safetensors
    would refuse the file for: a file cut anywhere, bytes added, a header that is not JSON or whose ranges do not
    tile the data; an intact file passes. A sharded model's shards are each checked, a missing one named."""
    import json
    import struct
    from safetensors.torch import load_file, save_file
    from runtime.hub import check_weights, safetensors_damage
    intact = tmp_path / "intact.safetensors"
    save_file({"a": torch.zeros(10), "b": torch.ones(3), "empty": torch.zeros(0)}, str(intact), metadata={"x": "y"})
    data = intact.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    overlap = dict(header, b=dict(header["b"], data_offsets=[36, 48]))
    rehead = lambda h: (lambda raw: struct.pack("<Q", len(raw)) + raw)(json.dumps(h).encode()) + data[8 + n:]
    damaged = {"cut in the data": data[:-5], "cut in the header": data[:20], "cut in the length": data[:5], "empty": b"",
               "bytes added": data + b"junk", "not JSON": data[:8] + b"{" * n + data[8 + n:],
               "a huge length": struct.pack("<Q", 2**60) + data[8:], "a list": rehead([1]),
               "no range": rehead(dict(header, a={"dtype": "F32"})), "overlapping": rehead(overlap)}
    assert safetensors_damage(str(intact)) is None and load_file(str(intact))["b"].sum() == 3
    for what, content in damaged.items():
        path = tmp_path / f"{what}.safetensors"
        path.write_bytes(content)
        assert safetensors_damage(str(path)), what
        with pytest.raises(Exception):
            load_file(str(path))  # safetensors refuses each too: none is refused here that would load
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(data[:-5])
    with pytest.raises(ConfigError, match=rf"^--model: {model / 'model.safetensors'} is truncated \(its tensors end at "
                                          rf"byte 52 of the data, which holds 47\): it would not load$"):
        check_weights(str(model))
    (model / "model.safetensors").unlink()
    (model / "a.safetensors").write_bytes(data)
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "a.safetensors",
                                                                                   "b": "b.safetensors"}}))
    with pytest.raises(ConfigError, match=rf"^--model: {model / 'b.safetensors'} is missing: it would not load$"):
        check_weights(str(model))


@pytest.mark.engine
def test_resume_names_the_flags_that_differ_and_refuses_fixed_ones(tiny_model, checkpoint, tmp_path, refusal):
    flags = ["--model", tiny_model, "--searchers", "0", *SMALL, "--resume", str(checkpoint)]
    status, lines = refusal([*flags, "--steps", "3", "--temperature", "0.5", "--out", str(tmp_path / "b")])
    assert status == 2 and lines == [
        "tba.py: error: --resume: --temperature 0.5 (was 1.0) cannot change mid-run (the checkpoint's buffer was "
        "searched, scored and kept with the old value)"]
    status, lines = refusal([*flags, "--steps", "3", "--buffer-capacity", "50", "--out", str(tmp_path / "d")])
    assert status == 2 and len(lines) == 1 and "--buffer-capacity 50 (was 100) cannot change mid-run" in lines[0], lines
    # --buffer-keep belongs to the redteam task (refused with arith): its change is refused the same way
    import dataclasses
    import json
    from runtime.checkpoint import check_resumed_flags
    saved = json.load(open(checkpoint / "config.json"))
    same = Config(**{f.name: saved[f.name] for f in dataclasses.fields(Config)})
    check_resumed_flags(same, str(checkpoint))  # nothing differs: no refusal
    with pytest.raises(ConfigError, match=r"--buffer-keep best \(was newest\) cannot change mid-run"):
        check_resumed_flags(dataclasses.replace(same, buffer_keep="best"), str(checkpoint))
    p = run_tba([*flags, "--steps", "3", "--prompts-per-step", "2", "--recency", "0.5", "--reward-inv-temp", "2",
                 "--save-every", "1", "--out", str(tmp_path / "c")], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:]
    assert ("tba.py: resuming with flags that differ from the checkpoint's: --steps 3 (was 2), "
            "--prompts-per-step 2 (was 4), --recency 0.5 (was 0.95), --reward-inv-temp 2.0 (was 0.0), --save-every 1 (was 2)"
            ) in p.stdout.splitlines(), p.stdout[-3000:]
    with np.load(tmp_path / "c" / "checkpoint" / "buffer.npz", allow_pickle=False) as f:  # the new m, T: in use
        assert ReplayBuffer.from_state(dict(f)).recency == 0.5 and ReplayBuffer.from_state(dict(f)).reward_inv_temp == 2


# ===== the run scripts ============================================================================
@pytest.mark.engine
def test_run_tldr_recomputes_activations_for_2_8b_only():
    from test_run_scripts import dry_run
    for size, on in (("410m", False), ("1b", False), ("2.8b", True)):
        assert dry_run(script="scripts/run_tldr.sh", SIZE=size)[1].activation_checkpointing is on


@pytest.mark.engine
def test_run_gsm8k_header_examples_are_accepted():
    """The GPU splits its header suggests pass tba.py's check of B against the trainer ranks."""
    from test_run_scripts import dry_run
    header = open(os.path.join(os.path.dirname(tba.__file__), "run_gsm8k.sh")).read().split("set -euo")[0]
    examples = [line.split("#", 2)[1].strip() for line in header.splitlines() if "SEARCHERS=" in line and "bash" in line]
    assert len(examples) >= 2
    for example in examples:
        words = example.split()
        env = dict(w.split("=") for w in words if "=" in w and not w.startswith("-"))
        args = words[words.index("run_gsm8k.sh") + 1:]
        command, cfg = dry_run(*args, **env)
        trainers = int(command[2].split("=")[1])
        assert cfg.prompts_per_step % trainers == 0, example


# ===== compute_mode: NVML errors =================================================================
def test_compute_mode_is_unknown_when_nvml_does_not_know_the_device(monkeypatch):
    """nvmlDeviceGetHandleByUUID fails for MIG devices and unknown UUIDs: no traceback, mode unknown."""
    import sys
    import types

    class NVMLError(Exception):
        pass

    def unknown(uuid):
        raise NVMLError("Not Found")
    calls = []
    fake = types.SimpleNamespace(NVMLError=NVMLError, nvmlInit=lambda: calls.append("init"),
                                 nvmlShutdown=lambda: calls.append("shutdown"), nvmlDeviceGetHandleByUUID=unknown,
                                 nvmlDeviceGetComputeMode=lambda handle: 0)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid="MIG-1234"))
    assert gpu.compute_mode(0) is None
    assert calls == ["init", "shutdown"]


# ===== several ranks decide together whether the configuration holds =============================
def refusal_rank(rank, port, results):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        none = ranks.first_refusal(None)
        one = ranks.first_refusal("--model: é not found" if rank == 1 else None)  # non-ASCII survives
        both = ranks.first_refusal(f"rank {rank} refuses")
        results.put((rank, none, one, both))
    finally:
        dist.destroy_process_group()


@pytest.mark.engine
def test_a_refusal_on_one_rank_reaches_all():
    results = mp.get_context("spawn").Queue()
    mp.start_processes(refusal_rank, args=(free_port(), results), nprocs=2, start_method="spawn")
    got = sorted(results.get(timeout=10) for _ in range(2))
    assert got == [(0, None, "(rank 1) --model: é not found", "rank 0 refuses"),
                   (1, None, "--model: é not found", "rank 0 refuses")]


def test_only_rank_0_looks_into_out(tiny_model, tmp_path, monkeypatch):
    """Rank 0's write probe in --out must not make another rank refuse the run (one that looked would race
    with the probe and could find --out not empty)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / ".write-test-1").write_text("ok")
    cfg = checks.parse(Config, ["--model", tiny_model, *SMALL, "--out", str(out)])
    monkeypatch.setenv("RANK", "1")
    assert checks.check(cfg, 1)[0].out == str(out)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="exists and is not empty"):
        checks.check(checks.parse(Config, ["--model", tiny_model, *SMALL, "--out", str(out)]), 1)


def test_resume_into_another_runs_folder_is_refused(tmp_path):
    """--resume A/checkpoint --out B: B, holding another run's files, would be overwritten without a word;
    only the checkpoint's own run (the parent of its real path), or a new or empty folder, takes the run."""
    from runtime.log import check_out
    run, other = tmp_path / "a", tmp_path / "b"
    (run / "checkpoint-000004").mkdir(parents=True)
    (run / "checkpoint").symlink_to("checkpoint-000004")
    (run / "metrics.jsonl").write_text("{}\n")
    other.mkdir()
    (other / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=rf"^--out: {other} exists and is not empty, and is not the run of the "
                                          rf"checkpoint \({run}\)"):
        check_out(str(other), str(run / "checkpoint"))
    assert (other / "metrics.jsonl").read_text() == "{}\n"
    check_out(str(run), str(run / "checkpoint"))                   # its own run, by the link
    check_out(str(run), str(run / "checkpoint-000004"))            # or by the folder itself
    check_out(str(tmp_path / "new"), str(run / "checkpoint"))      # a new folder
    (tmp_path / "empty").mkdir()
    check_out(str(tmp_path / "empty"), str(run / "checkpoint"))    # an empty one
    with pytest.raises(ConfigError, match="pass --resume to continue a run"):
        check_out(str(other), None)
    (run / "final").mkdir()  # a finished run: --resume alone would be refused as finished (issue 67 item 15)
    with pytest.raises(ConfigError, match=r"\(it holds a finished run: pass a new --out, or --resume OUT/checkpoint with "
                                          r"--steps above its step\)$"):
        check_out(str(run), None)


def test_resume_beside_a_run_that_still_runs_is_refused(tmp_path):
    """Issue 67 item 1: a run's folder is locked while its process lives (runtime.log.hold): a resume beside it would
    interleave the two runs' rows and delete the other's checkpoints. The lock goes with its holder, killed or not."""
    import subprocess
    import sys
    from runtime.log import check_out
    run = tmp_path / "a"
    (run / "checkpoint-000004").mkdir(parents=True)
    (run / "checkpoint").symlink_to("checkpoint-000004")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (f"import sys, time; sys.path.insert(0, {root!r}); from runtime.log import hold; hold({str(run)!r}); "
            f"print('held', flush=True); time.sleep(120)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline() == "held\n"
        with pytest.raises(ConfigError, match=rf"^--resume: a run still runs in {run}: stop it first"):
            check_out(str(run), str(run / "checkpoint"))
    finally:
        p.kill()
        p.wait()
    check_out(str(run), str(run / "checkpoint"))  # its process killed: the folder is free
    assert sorted(os.listdir(run)) == ["checkpoint", "checkpoint-000004"]  # no file of the lock's


@pytest.mark.parametrize("steps,match", [
    ("1", "--steps: 1 is below the checkpoint's step 2: a resumed run cannot go back; pass --steps above 2"),
    ("2", "--steps: 2 is the checkpoint's step 2: the run is finished \\(its final/ is written\\); pass --steps above 2 "
            "to continue"),
])
def test_resume_with_no_steps_left_is_refused(steps, match, tiny_model, checkpoint, tmp_path):
    """--steps at or below the checkpoint's step: one line at once, not a wait of --timeout for an evaluation of
    weights that never come."""
    cfg = checks.parse(Config, ["--model", tiny_model, "--searchers", "0", *SMALL, "--resume", str(checkpoint),
                                "--steps", steps, "--out", str(tmp_path / "b")])
    with pytest.raises(ConfigError, match=f"^{match}"):
        checks.check(cfg, 1)


@pytest.mark.engine
def test_resume_of_an_edited_task_is_refused(tiny_model, checkpoint, tmp_path, monkeypatch):
    """Issue 67 item 2: a task whose training problems changed, their count not (two swapped), between a run and its
    resume: the buffer's prompt ids would index other prompts. The checkpoint keeps a hash of them."""
    import dataclasses
    import tasks
    arith = tasks.get("arith")

    def swapped(data):
        train, test = arith.load(data)
        return [train[1], train[0], *train[2:]], test
    cfg = checks.parse(Config, ["--model", tiny_model, "--searchers", "0", *SMALL, "--resume", str(checkpoint),
                                "--steps", "3", "--out", str(tmp_path / "b")])
    assert checks.check(cfg, 1)[2]["step"] == 2  # as it was: resumed
    monkeypatch.setitem(tasks.TASKS, "arith", dataclasses.replace(arith, load=swapped))
    with pytest.raises(ConfigError, match="^--resume: the arith task's training problems are not those the "
                                          "checkpoint's run searched"):
        checks.check(cfg, 1)


@pytest.mark.engine
def test_resume_with_weights_damaged_in_place_is_refused(checkpoint, tmp_path):
    """Issue 67 item 3: 4 KB of a checkpoint's weights zeroed in place (the same size: the header parses) are refused
    in one line; the checkpoint keeps its weights' SHA-256."""
    import shutil
    from runtime.checkpoint import load_checkpoint
    from test_tiny import zero_4kb
    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoint, damaged)
    assert load_checkpoint(str(damaged))["step"] == 2
    zero_4kb(damaged / "model" / "model.safetensors")
    with pytest.raises(ConfigError, match=rf"^--resume: {damaged}/model/model.safetensors is not the file its "
                                          rf"checkpoint wrote \(missing, or its SHA-256 differs: damaged\?\)$"):
        load_checkpoint(str(damaged))


def test_a_task_with_characters_the_tokenizer_lacks_or_no_held_out_problems_is_refused(tiny_model, monkeypatch, capfd):
    """Issue 67 items 7 and 10: a character the tiny tokenizer lacks (×) would reach the model as <unk>, silently; an
    empty held-out split ended in a KeyError at the first evaluation. Both are refused at start, in one line."""
    import tasks
    from tasks.task import Problem, Task
    problems = lambda sign: [Problem(f"{a} {sign} 2 =", str(2 * a)) for a in range(8)]
    cfg = checks.parse(Config, ["--model", tiny_model, "--searchers", "0", *SMALL, "--task", "times"])
    monkeypatch.setitem(tasks.TASKS, "times", Task(load=lambda data: (problems("*"), problems("*")), reward=len))
    assert checks.check(cfg, 1)[1].answers[:2] == ["0", "2"]  # in its characters: taken
    monkeypatch.setitem(tasks.TASKS, "times", Task(load=lambda data: (problems("*"), problems("×")), reward=len))
    checks.check(cfg, 1)  # said in one line (a model may do without them: GSM8K's dashes on a tiny tokenizer)
    assert (f"tba.py: warning: --task: times's prompts use characters that the tokenizer of {tiny_model} lacks ('×'): "
            f"the model reads each as <unk>") in capfd.readouterr().err
    monkeypatch.setitem(tasks.TASKS, "times", Task(load=lambda data: (problems("*"), []), reward=len))
    with pytest.raises(ConfigError, match="^--task: times's held-out split is empty"):
        checks.check(cfg, 1)


def test_a_losss_flags_that_name_no_field_or_a_general_one(tiny_model, monkeypatch):
    """Issue 67 items 8, 9 and 15: a loss's `flags` naming no field, or a string for a tuple (`("clip")`), broke every
    run with an AttributeError traceback: now only a run of that loss is refused, in one line. A general field among
    them (max_new_tokens) is read, not made the loss's own: given with another loss it is taken. An anneal of T_R
    with a loss that reads no T_R is refused itself (before: a refusal that sent the user to --reward-temp, which was
    then refused)."""
    import loss
    run = lambda *args: checks.check(checks.parse(Config, ["--model", tiny_model, "--searchers", "0", *SMALL, *args]), 1)
    monkeypatch.setitem(loss.LOSSES, "typo", loss.LOSSES["grpo"])
    for flags in (("clip", "no_such_field"), "clip"):
        monkeypatch.setattr(loss.LOSSES["grpo"], "flags", flags)
        assert run("--max-new-tokens", "5")[0].loss == "tb"
        with pytest.raises(ConfigError, match=rf"^--loss: typo's flags must be a tuple of Config fields' names "
                                              rf"\(loss.py\), got {re.escape(repr(flags))}$"):
            run("--loss", "typo")
    monkeypatch.setattr(loss.LOSSES["grpo"], "flags", ("clip", "max_new_tokens"))
    assert run("--max-new-tokens", "5", "--loss", "rloo")[0].max_new_tokens == 5
    with pytest.raises(ConfigError, match="^--clip: acts only in --loss grpo"):
        run("--clip", "0.3")
    with pytest.raises(ConfigError, match="^--reward-temp-anneal-steps: acts only in a --loss reading --reward-temp"):
        run("--loss", "rloo", "--reward-temp-anneal-steps", "10")


@pytest.mark.engine
def test_resume_with_another_task_is_refused_before_its_model_is_built(checkpoint, tmp_path, monkeypatch):
    """Issue 67 item 12: a resume with another --task built that task's tiny model (minutes) before it was refused,
    and left a hidden temporary folder behind."""
    monkeypatch.setenv("TBA_CACHE", str(tmp_path / "cache"))
    cfg = checks.parse(Config, ["--model", "tiny", "--task", "countdown", "--resume", str(checkpoint), "--steps", "3",
                                "--out", str(tmp_path / "b")])
    with pytest.raises(ConfigError, match=r"^--resume: --task countdown \(was arith\) cannot change mid-run"):
        checks.check(cfg, 1)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "b").exists()


def test_resume_messages_say_what_is_there(tmp_path):
    """--resume RUN (the run's folder, not its checkpoint) names the checkpoint inside; a missing path does not
    exist; a folder with neither is not a checkpoint folder."""
    from runtime.checkpoint import load_checkpoint
    run = tmp_path / "runs" / "a"
    (run / "checkpoint-000002").mkdir(parents=True)
    (run / "checkpoint-000002" / "trainer.pt").write_bytes(b"")
    (run / "checkpoint").symlink_to("checkpoint-000002")
    with pytest.raises(ConfigError, match=rf"^--resume: {run} is not a checkpoint folder \(its run's checkpoint is "
                                          rf"{run / 'checkpoint'}\)$"):
        load_checkpoint(str(run))
    with pytest.raises(ConfigError, match=rf"^--resume: {tmp_path / 'runs' / 'b'} does not exist$"):
        load_checkpoint(str(tmp_path / "runs" / "b"))
    with pytest.raises(ConfigError, match=rf"^--resume: {tmp_path / 'runs'} is not a checkpoint folder$"):
        load_checkpoint(str(tmp_path / "runs"))


def test_a_resume_that_changes_the_task_says_so(tmp_path):
    """--task on a resume is named before anything of the new task is resolved: with --model tiny its model is the
    task's own (built on first use), whose weights, checked first, were refused as another --model's."""
    import dataclasses
    import json
    (tmp_path / "ckpt").mkdir()
    json.dump(dataclasses.asdict(Config(given=("steps",))), open(tmp_path / "ckpt" / "config.json", "w"))
    cfg = checks.parse(Config, ["--task", "countdown", "--resume", str(tmp_path / "ckpt")])
    with pytest.raises(ConfigError, match=r"^--resume: --task countdown \(was arith\) cannot change mid-run \(the "
                                          r"checkpoint's buffer holds arith's problems"):
        checks.check(cfg, 1)


def test_resume_compares_models_by_their_folders(tmp_path):
    """A run of --model tiny resumed with --model set to the folder tiny resolved to (config.json's model_path) is
    the same model, not a change of model; another folder is refused."""
    import dataclasses
    import json
    from runtime.checkpoint import check_resumed_flags
    folder, other = tmp_path / "tiny-abc", tmp_path / "other"
    folder.mkdir()
    other.mkdir()
    (tmp_path / "link").symlink_to(folder)
    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(dataclasses.asdict(Config(model="tiny", model_path=str(folder)))))
    for name in (folder, tmp_path / "link"):
        check_resumed_flags(Config(model=str(name), model_path=str(name)), str(ckpt))
    with pytest.raises(ConfigError, match=rf"^--resume: --model {other} \(was tiny\) cannot change mid-run"):
        check_resumed_flags(Config(model=str(other), model_path=str(other)), str(ckpt))


# ===== a resume continues its run: its model, its flags, its record =================================
def test_a_model_folder_gives_the_shared_copys_fingerprints_whatever_its_names(tmp_path):
    """--model's identity (runtime.weights.identity: the shared copy's version-0 fingerprints) is found again in a
    model folder's files (file_fingerprints, cast as the trainer casts them) though the file names its tensors apart,
    holds a tied one twice and keeps a buffer and an integer tensor the copy has not; one tensor moved by 1e-3 is
    not found."""
    import types
    from safetensors.torch import save_file
    from runtime import weights
    rng = torch.Generator().manual_seed(0)
    embed, w = torch.randn(8, 4, generator=rng), torch.randn(4, 4, generator=rng)
    for dtype in (torch.float32, torch.bfloat16):  # the sync dtype: float32 on the CPU, bf16 on a GPU
        shared = types.SimpleNamespace()
        weights.allocate(shared, [("model.embed.weight", embed), ("model.w", w)],
                         {"lm_head.weight": "model.embed.weight"}, "cpu", dtype)
        model = weights.identity(shared, dtype, "float32")
        assert model["dtypes"] == ["float32", str(dtype).removeprefix("torch.")] and model["prints"].shape == (2, 3)
        folder = tmp_path / str(dtype)
        folder.mkdir()
        save_file({"embed.weight": embed.clone(), "lm_head.weight": embed.clone(), "w": w.clone(),
                   "rotary.inv_freq": torch.arange(4.0), "position_ids": torch.arange(4)}, folder / "model.safetensors")
        assert weights.covers(weights.file_fingerprints(str(folder), model["dtypes"]), model["prints"])
        save_file({"embed.weight": embed.clone(), "w": w + 1e-3}, folder / "model.safetensors")
        assert not weights.covers(weights.file_fingerprints(str(folder), model["dtypes"]), model["prints"])


def test_a_resume_takes_the_flags_it_is_not_given_from_the_checkpoint():
    """`--resume` continues its run: a flag the command line does not give is the checkpoint's where its run gave it
    (--task, --lr), left to its default where it did not (--search-samples-per-prompt follows a new K, as in the
    checkpoint's run it followed the old one); the flags given now win. A run made in code (no `given`): its values
    other than the defaults."""
    import dataclasses
    import json
    from runtime.checkpoint import resumed_flags
    saved = dataclasses.asdict(checks.parse(Config, ["--task", "countdown", "--lr", "0.001", "--steps", "20"]))
    saved = json.loads(json.dumps(dict(saved, search_samples_per_prompt=8, model_path="/m")))  # as config.json holds it
    cfg = resumed_flags(checks.parse(Config, ["--resume", "x", "--steps", "40", "--samples-per-prompt", "4"]), saved)
    assert (cfg.task, cfg.lr, cfg.steps, cfg.samples_per_prompt) == ("countdown", 0.001, 40, 4)
    assert cfg.search_samples_per_prompt is None and cfg.model_path == "" and cfg.out is None
    assert cfg.given == ("lr", "resume", "samples_per_prompt", "steps", "task")
    made_in_code = json.loads(json.dumps(dataclasses.asdict(Config(task="countdown", lr=0.01))))
    assert resumed_flags(checks.parse(Config, ["--resume", "x"]), made_in_code).lr == 0.01
    # a flag taken that cannot act beside one given now (a streaming run's --max-reuse, resumed with --lag): its
    # default, not a refusal of a flag the command line never gave
    streaming = json.loads(json.dumps(dataclasses.asdict(checks.parse(Config, ["--max-reuse", "2", "--lr", "0.1"]))))
    cfg = checks.resumed(checks.parse(Config, ["--resume", "x", "--lag", "2"]), streaming)
    assert (cfg.max_reuse, cfg.lr, cfg.lag, cfg.given) == (None, 0.1, 2, ("lag", "lr", "resume"))
    checks.check_unused(cfg)


def test_a_resumed_run_is_named_as_resume_names_it(tmp_path, monkeypatch):
    """Without --out a resume goes on in its checkpoint's run, said as --resume says it (the summary line then names
    the folder as a fresh run's names its --out); a checkpoint reached through a link elsewhere: its real run."""
    run = tmp_path / "runs" / "a"
    (run / "checkpoint-000002").mkdir(parents=True)
    (run / "checkpoint").symlink_to("checkpoint-000002")
    (tmp_path / "link").symlink_to(run / "checkpoint-000002")
    monkeypatch.chdir(tmp_path)
    assert checks.run_of("runs/a/checkpoint") == "runs/a" and checks.run_of("runs/a/checkpoint-000002/") == "runs/a"
    assert checks.run_of("link") == str(run) and checks.run_of(str(run / "checkpoint")) == str(run)


@pytest.mark.engine
def test_a_resume_loads_the_model_it_was_trained_from(tiny_model, checkpoint, tmp_path, capsys):
    """The checkpoint keeps its --model's fingerprints: a --model whose folder holds other weights (one tensor moved
    by 1e-3: another warm start behind `--model tiny`, say) is refused in one line naming both folders; the same
    weights in another folder are the same model, recorded as a change. A checkpoint saved before it kept them is
    compared by folder, as before, with a note."""
    import json
    import shutil
    from safetensors.torch import load_file, save_file
    same, other = tmp_path / "same", tmp_path / "other"
    shutil.copytree(tiny_model, same)
    shutil.copytree(tiny_model, other)
    moved = load_file(other / "model.safetensors")
    moved["model.norm.weight"] += 1e-3
    save_file(moved, other / "model.safetensors", metadata={"format": "pt"})
    resume = lambda model, ckpt=checkpoint: checks.check(checks.parse(Config, [
        "--resume", str(ckpt), "--model", str(model), "--steps", "3", "--out", str(tmp_path / "b")]), 1)[0]
    rebuilt = tmp_path / "rebuilt"  # its run's --model folder holds other weights now (a cache rebuilt): the same name
    shutil.copytree(checkpoint, rebuilt)
    saved = json.load(open(rebuilt / "config.json"))
    json.dump(dict(saved, model=str(other), model_path=str(other)), open(rebuilt / "config.json", "w"))
    with pytest.raises(ConfigError, match=rf"^--model: {other} resolves to {other}, whose weights are not those the "
                                          rf"checkpoint's run started from \(in {other} then\)"):
        resume(other, rebuilt)
    with pytest.raises(ConfigError) as e:
        resume(other)
    assert str(e.value) == (f"--model: {other} resolves to {other}, whose weights are not those the checkpoint's run "
                            f"started from (in {tiny_model} then): pi_ref's, whose log-probs its buffer holds; resume "
                            f"with those weights")
    cfg = resume(same)
    assert cfg.resumes[-1] == dict(step=2, changed=dict(steps=[2, 3], model=[tiny_model, str(same)],
                                                         model_path=[tiny_model, str(same)]))
    old = tmp_path / "old"  # saved before the fingerprints were kept
    shutil.copytree(checkpoint, old)
    state = torch.load(old / "trainer.pt", weights_only=True)
    del state["model_prints"]
    torch.save(state, old / "trainer.pt")
    capsys.readouterr()
    assert resume(tiny_model, old).model_path == tiny_model
    assert capsys.readouterr().out.splitlines() == [
        f"tba.py: note: {old} keeps no fingerprints of its --model's weights (saved before they were kept): --model "
        f"is compared by its folder alone", "tba.py: resuming with flags that differ from the checkpoint's: --steps 3 "
        "(was 2)"]
    with pytest.raises(ConfigError, match=rf"^--resume: --model {same} \(was {tiny_model}\) cannot change mid-run"):
        resume(same, old)


@pytest.mark.engine
def test_a_resume_goes_on_with_the_checkpoints_flags_and_records_what_changed(tiny_model, checkpoint, tmp_path):
    """`--resume RUN/checkpoint` continues the run as it was: its --model, B, K, length and lr are the checkpoint's,
    not the defaults; the flags given anew are named in one line and act (the new m is the buffer's). config.json
    records each resume, its step and what changed (old and new), and the checkpoint carries the record to the next
    resume. The train rows count the tokens generated over the run, on from the checkpoint's, and the batch's mean
    response length. The summary names the run as --resume named it."""
    import json
    import shutil
    shutil.copytree(checkpoint.parent, tmp_path / "run", symlinks=True)  # a resume writes into its run: a copy
    p = run_tba(["--resume", "run/checkpoint", "--steps", "3", "--recency", "0.5", "--save-every", "1"], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:]
    lines = p.stdout.strip().splitlines()
    assert ("tba.py: resuming with flags that differ from the checkpoint's: --steps 3 (was 2), --recency 0.5 (was "
            "0.95), --save-every 1 (was 2)") in lines, p.stdout[-3000:]
    assert lines[-1].endswith(" | run"), lines[-1]
    config = json.load(open(tmp_path / "run" / "config.json"))
    assert (config["model"], config["prompts_per_step"], config["samples_per_prompt"], config["max_new_tokens"],
            config["lr"], config["searchers"]) == (tiny_model, 4, 4, 6, 1e-3, 0)
    first = dict(step=2, changed=dict(steps=[2, 3], recency=[0.95, 0.5], save_every=[2, 1]))
    assert config["resumes"] == [first]
    with np.load(tmp_path / "run" / "checkpoint" / "buffer.npz", allow_pickle=False) as f:
        assert ReplayBuffer.from_state(dict(f)).recency == 0.5
    rows = [r for r in metrics(tmp_path / "run") if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["resumed"] == 2
    for a, b in zip(rows, rows[1:]):  # every round's 16 responses of 1 to 6 tokens, counted on over the resume
        assert b["samples"] - a["samples"] == 16 and 16 <= b["tokens"] - a["tokens"] <= 16 * 6
    assert all(1 <= r["response_length"] <= 6 for r in rows)
    cfg = checks.check(checks.parse(Config, ["--resume", str(tmp_path / "run" / "checkpoint"), "--steps", "5",
                                             "--out", str(tmp_path / "next")]), 1)[0]
    assert cfg.resumes == (first, dict(step=3, changed=dict(steps=[3, 5])))
