"""The memory plan's counting without measuring anything: --lag's pinned slots as runtime/weights.flat_slot allocates
them (one registered block, exact; before, one block a tensor from torch's pinned allocator), the models' shapes
against transformers', the plan's terms (FSDP2's buffers, the end of the backward pass, --behaviour-logprobs trainer's
copy and history, --evaluator after's engine and snapshots), the refusals of --evaluator after on the trainer's GPU
and of what the trainer keeps in the host's RAM (the card and the RAM faked), and tools/memory.py's bad arguments
refused in one line before anything is measured."""

import dataclasses
import math
import types

import pytest
import torch

import memory  # tools/memory.py (conftest puts tools/ on the path)
from runtime import gpu
from runtime import weights
from runtime.config import Config
from runtime.errors import ConfigError

QWEN_P = 7_615_616_512  # Qwen2.5-7B's parameters, as transformers builds it from the published config
RHO_P = 1_100_048_384   # rho-math-1b's (TinyLlama's shape, untied)
FITS = {False: (94 * 1024, 176 * 1024), True: (4 * 1024, 176 * 1024)}  # bytes a token (a layer), at rho's shape


def qwen_sizes(nbytes: int = 2) -> list[int]:
    return [math.prod(s) * nbytes for s in memory.decoder_shapes(memory.QWEN_7B)]


# ===== pinned host blocks ==========================================================================================
def test_a_qwen_slot_is_exact_and_a_block_a_tensor_was_1_9x():
    """One flat slot of Qwen2.5-7B's bf16 weights (15.2 GB): exact, its tensors' 64-byte alignment aside (registered
    host memory: no power of two on any torch); one pinned block a tensor, as before, about 1.9x."""
    sizes = qwen_sizes()
    slot = gpu.pinned_block(sizes)
    assert sum(sizes) == 2 * QWEN_P and 15.2e9 < slot < 15.24e9
    assert slot - sum(sizes) < 64 * len(sizes)  # each tensor's offset aligned to 64 bytes
    assert 1.85 < memory.pinned_tensors(sizes) / sum(sizes) < 1.95
    assert memory.pinned_tensors([18944 * 3584 * 2]) == 2**28  # an MLP matrix: 136 MB in a 256 MiB block
    assert gpu.pinned_block([1, 1]) == 128 and gpu.pinned_block([64, 64]) == 128 and gpu.pinned_block([]) == 1
    assert [memory.pow2_ceil(n) for n in (0, 1, 3, 2**34, 2**34 + 1)] == [0, 1, 4, 2**34, 2**35]


def test_the_count_is_the_block_flat_slot_allocates():
    """pinned_block counts the block runtime/weights.flat_slot allocates (not pinned here: the same block, which pinning
    registers in place)."""
    shapes = {"a": ((3, 5), torch.bfloat16), "b": ((7,), torch.float32), "c": ((2, 2, 2), torch.bfloat16)}
    views = weights.flat_slot(shapes, pin=False)
    block = {v.untyped_storage().nbytes() for v in views.values()}
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in shapes.values()]
    assert block == {gpu.pinned_block(sizes)} == {3 * 64}  # 30, 28 and 16 bytes, each rounded to 64


# ===== the models' shapes ==========================================================================================
def test_the_plan_s_shapes_are_transformers_ones(tmp_path):
    """decoder_shapes gives the distinct weights transformers builds for Qwen2.5-7B's and rho-math-1b's configs (meta
    device), which runtime/gpu.weight_shapes reads from a config folder; FSDP2's units split them as counted."""
    from transformers import LlamaConfig, Qwen2Config
    q, r = memory.QWEN_7B, memory.RHO
    qwen = Qwen2Config(hidden_size=q["hidden"], intermediate_size=q["ffn"], num_attention_heads=q["heads"],
                       num_key_value_heads=q["kv_heads"], num_hidden_layers=q["layers"], vocab_size=q["vocab"],
                       tie_word_embeddings=False)
    rho = LlamaConfig(hidden_size=r["hidden"], intermediate_size=r["ffn"], num_attention_heads=r["heads"],
                      num_key_value_heads=r["kv_heads"], num_hidden_layers=r["layers"], vocab_size=r["vocab"],
                      tie_word_embeddings=False)
    for config, c, P in ((qwen, q, QWEN_P), (rho, r, RHO_P)):
        config.save_pretrained(tmp_path / str(P))
        assert gpu.weight_shapes(str(tmp_path / str(P))) == memory.decoder_shapes(c)
        assert memory.numel(memory.decoder_shapes(c)) == P
        assert memory.root_numel(c) + c["layers"] * memory.block_numel(c) == P
    assert memory.root_numel(q) == 2 * 152064 * 3584 + 3584
    assert [gpu.shard_rows(10, 4, r) for r in range(4)] == [3, 3, 3, 1]  # torch.chunk's cut
    assert [gpu.shard_rows(2, 4, r) for r in range(4)] == [1, 1, 0, 0]
    assert sum(memory.shard_sizes(q, 4, 0, 1)) * 4 == QWEN_P  # Qwen's dims divide by 4: even shards


# ===== the plan's terms ============================================================================================
def test_the_end_of_the_backward_pass():
    """The root unit's reduce-scatter, last: its bf16 gradients beside the float32 input (6 bytes a parameter) on 4
    ranks; on one rank the float32 input and output (8), the first pass's output being the gradient itself (4)."""
    q, root = memory.QWEN_7B, memory.root_numel(memory.QWEN_7B)
    assert memory.end_of_backward(q, 4) == 6 * root  # 6.5 GB
    assert memory.end_of_backward(q, 1) == 8 * root
    assert memory.end_of_backward(q, 1, accumulating=False) == 4 * root
    assert memory.end_of_backward(q, 1, weights=2) == 4 * root + root * (4 + 2)  # bf16 weights: the cast beside


def test_the_loss_s_backward():
    """The logits' bf16 gradient and a chunk's zero-padded to their size (4 bytes a logit), and three float32 chunks:
    16 bytes a logit where one chunk holds every position (tools/memory.py's measured shape), three 268 MB chunks
    beside Qwen's 4,096 x 152,064 logits."""
    assert memory.loss_backward(4, 328, 32000) == 16 * 4 * 328 * 32000
    positions = 2**28 // (4 * 152064)
    assert positions == 441 and memory.loss_backward(1, 4096, 152064) == 4 * 4096 * 152064 + 12 * positions * 152064
    x = memory.qwen_moments(FITS, 32000, memory.RHO)
    assert x["the loss's backward"] == x["kept"] + memory.loss_backward(1, 4096, 152064) + 2 * memory.root_numel(
        memory.QWEN_7B)


def test_the_qwen_plan_counts_each_term():
    """Rank 0 holds the shared copy (and TBA′'s pi_ref copy) and the searchers' contexts, the others not; the
    trainer's shard is a quarter of 16 bytes a parameter; --behaviour-logprobs trainer adds its copy's bf16 shard
    (3.8 GB; float32 before: 7.6 GB); the pass is the largest of a gradient pass, the statistics pass and the end of
    the backward pass."""
    plans = {(loss, rank, b): memory.qwen_plan(FITS, 32000, memory.RHO, loss, rank, b)
             for loss in ("tb", "drgrpo") for rank in (0, 1) for b in (False, True)}
    tb0 = plans["tb", 0, False]
    assert tb0["weights, gradients and AdamW shard"] == 16 * QWEN_P // 4
    assert tb0["shared copy"] == tb0["pi_ref's shared copy"] == 2 * QWEN_P
    assert "pi_ref's shared copy" not in plans["drgrpo", 0, False]
    assert "shared copy" not in plans["tb", 1, False] and plans["tb", 1, False] == plans["drgrpo", 1, False]
    for key, plan in plans.items():
        copy = plan.get("the behaviour copy's bf16 shard")
        assert (copy == 2 * QWEN_P / 4) if key[2] else copy is None
        assert sum(1 for k in plan if k.endswith("(the largest)")) == 1
    pass_ = next(v for k, v in tb0.items() if k.endswith("(the largest)"))
    assert pass_ >= memory.end_of_backward(memory.QWEN_7B, 4)
    assert pass_ >= sum(memory.fsdp_pass(memory.QWEN_7B).values())
    assert sum(plans["tb", 0, True].values()) - sum(tb0.values()) == pytest.approx(3.81e9, rel=1e-3)


def test_rank_0_under_tba_prime_is_told_the_setting_that_leaves_its_headroom():
    """A trainer GPU holds the plan, the allocator's reserve beyond it and NCCL's buffers: run_math.sh's rank 0 under
    TBA′ comes to about 84 of an 80 GB card's 84.5 GB usable, under the 5 GB the plan keeps free, and its line and
    run_math.sh's first lines (with its 4 trainer GPUs, unless the setting is on) name the setting that leaves them;
    Dr. GRPO's rank 0 and the other ranks keep more, and no setting is named."""
    import os
    import re
    import subprocess
    from conftest import ROOT
    plan = lambda loss, rank: memory.qwen_plan(FITS, 32000, memory.RHO, loss, rank)
    tb0 = plan("tb", 0)
    assert round(memory.on_card(tb0) / 1e9) == 84 and memory.USABLE - memory.on_card(tb0) < memory.HEADROOM
    assert memory.USABLE - memory.on_card(tb0, memory.EXPANDABLE) >= memory.HEADROOM
    for loss, rank in (("tb", 1), ("drgrpo", 0), ("drgrpo", 1)):
        assert memory.USABLE - memory.on_card(plan(loss, rank)) >= memory.HEADROOM
        assert "expandable_segments" not in memory.qwen_line(FITS, 32000, memory.RHO, loss, rank)
    line = memory.qwen_line(FITS, 32000, memory.RHO, "tb", 0)
    assert "about 84 of the 84.5 GB usable, 0.9 free, under the 5 GB kept: PYTORCH_CUDA_ALLOC_CONF=" \
           "expandable_segments:True leaves 7 if" in line
    said = lambda **environ: [x for x in subprocess.run(
        ["bash", os.path.join(ROOT, "run_math.sh"), "--dry-run"], capture_output=True, text=True, timeout=30,
        env=dict(os.environ, **environ)).stdout.splitlines() if x.startswith("run_math.sh:")]
    (note,) = said(PYTORCH_CUDA_ALLOC_CONF="")
    figures = re.search(r"about (\d+) GB of an 80 GB card's ([\d.]+) usable .* the (\d+) GB kept free: "
                        r"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True leaves about (\d+)$", note).groups()
    assert figures == (f"{memory.on_card(tb0) / 1e9:.0f}", f"{memory.USABLE / 1e9:.1f}", f"{memory.HEADROOM / 1e9:.0f}",
                       f"{(memory.USABLE - memory.on_card(tb0, memory.EXPANDABLE)) / 1e9:.0f}")
    assert said(LOSS="drgrpo", PYTORCH_CUDA_ALLOC_CONF="") == [] == said(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    assert said(TRAINERS="2", PYTORCH_CUDA_ALLOC_CONF="") == []  # another plan: its figures are not these


def test_a_reload_s_largest_layer_is_counted_on_the_searcher_s_gpu(tmp_path):
    """vLLM 0.32 rebuilds each layer of its model on the device at a reload, one at a time: the largest, as vLLM
    fuses them, is counted beside the engine: Qwen2.5-7B's embeddings (1.09 GB in bf16); with a small vocabulary the
    fused gate and up projections."""
    from transformers import Qwen2Config
    q = memory.QWEN_7B
    for vocab, largest in ((q["vocab"], q["vocab"] * q["hidden"]), (1000, 2 * q["ffn"] * q["hidden"])):
        Qwen2Config(hidden_size=q["hidden"], intermediate_size=q["ffn"], num_attention_heads=q["heads"],
                    num_key_value_heads=q["kv_heads"], num_hidden_layers=2, vocab_size=vocab,
                    tie_word_embeddings=False).save_pretrained(tmp_path / str(vocab))
        assert gpu.reload_bytes(str(tmp_path / str(vocab)), "bfloat16") == 2 * largest
    assert gpu.reload_bytes(str(tmp_path / str(q["vocab"])), "bfloat16") == pytest.approx(1.09e9, rel=1e-3)
    cfg = Config(model_path=str(tmp_path / str(q["vocab"])), dtype="bfloat16", max_model_len=640, score_batch=1,
                 search_samples_per_prompt=4, searchers=1)
    import tasks
    assert gpu.memory_needs(cfg, tasks.get("gsm8k"))[1]["a reload's largest layer"] == 2 * q["vocab"] * q["hidden"]


def test_the_host_plan_counts_the_rings_as_allocated():
    """Rank 0's --lag ring: L + 1 exact slots (45.7 GB at L = 2, 167.5 at L = 10); --behaviour-logprobs trainer's ring
    on every rank: L + 1 slots of its bf16 shards (3.8 GB each); before, one block a tensor: 86.9 GB at L = 2."""
    for lag in (2, 10):
        plan = memory.host_plan(lag)
        assert plan["--lag's history"] == (lag + 1) * gpu.pinned_block(qwen_sizes())
        mine = memory.host_plan(lag, rank=1, behaviour=True)
        assert "--lag's history" not in mine and not any(k.startswith("a checkpoint") for k in mine)
        assert mine["--behaviour-logprobs trainer's history"] == (lag + 1) * gpu.pinned_block(
            memory.shard_sizes(memory.QWEN_7B, 4, 1, 2))
        assert mine["--behaviour-logprobs trainer's history"] == pytest.approx((lag + 1) * 2 * QWEN_P / 4, rel=1e-4)
    assert [round(memory.host_plan(lag)["--lag's history"] / 1e9, 1) for lag in (2, 10)] == [45.7, 167.5]
    assert "a checkpoint: pi_ref's" not in memory.host_plan(2, loss="drgrpo")
    assert round(3 * memory.pinned_tensors(qwen_sizes()) / 1e9, 1) == 86.9


def test_the_rho_plan_counts_the_evaluator():
    """rho-math-1b at the GSM8K settings: --evaluator after's engine takes 0.2 of an 80 GB card, and it keeps 7
    snapshots on the host (the initial one and steps 100-600; the final one after they are evaluated)."""
    plan = memory.rho_plan(FITS, 32000, memory.RHO, recompute=True)
    assert plan["--evaluator after's engine"] == 16e9
    assert plan["--evaluator after's snapshots (host)"] == 7 * 2 * RHO_P
    assert plan["weights, gradients and AdamW"] == 16 * RHO_P  # the gradients accumulate over the step's passes
    line = memory.rho_line(FITS, 32000, memory.RHO, True)
    assert "--evaluator after: its engine 16.0 more" in line and "7 snapshots on the host, 15.4 GB" in line
    assert [gpu.snapshots(s, e) for s, e in ((700, 100), (420, 5), (10, 0), (5, 5), (6, 5))] == [7, 84, 1, 1, 2]


# ===== the refusals on a GPU (CUDA queries and the RAM faked) ======================================================
def rho_config(tmp_path, **changes) -> Config:
    """run_gsm8k.sh's trainer with --evaluator after (one rank, 3 searchers), float32 weights, rho-math-1b's shape."""
    from transformers import LlamaConfig
    r = memory.RHO
    path = tmp_path / "rho"
    LlamaConfig(hidden_size=r["hidden"], intermediate_size=r["ffn"], num_attention_heads=r["heads"],
                num_key_value_heads=r["kv_heads"], num_hidden_layers=r["layers"], vocab_size=r["vocab"],
                tie_word_embeddings=False, max_position_embeddings=2048).save_pretrained(path)
    cfg = Config(task="gsm8k", dtype="bfloat16", model_path=str(path), max_model_len=750, prompts_per_step=7,
                 search_samples_per_prompt=24, micro_batch=20, score_batch=20, searchers=3, trainer_memory=0.2,
                 trainer_dtype="float32", ref_reset_every=0, evaluator="after", steps=700, eval_every=100)
    return dataclasses.replace(cfg, **changes)


def card(monkeypatch, gb: float):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=int(gb * 1e9)))


def test_the_evaluator_s_engine_must_fit_beside_the_trainer(tmp_path, monkeypatch):
    """--evaluator after on rho-math-1b: held on a 40 GB card (0.2 for the engine, the trainer's 16.4 GiB beside),
    refused on a 24 GB card in one line naming --evaluator, --trainer-memory and the figures, through check_memory
    (where runtime.checks calls it); --behaviour-logprobs trainer's copy counted beside it; --evaluator searcher: no
    engine on the trainer's GPU, nothing refused."""
    import tasks
    gsm8k = tasks.get("gsm8k")
    monkeypatch.setattr(gpu, "host_ram", lambda: 2**40)
    cfg = rho_config(tmp_path)
    beside = gpu.evaluator_needs(cfg, gsm8k)[1]
    assert beside["the trainer's weights, gradients and AdamW state"] == 16 * RHO_P
    assert beside["the shared copy"] == 2 * RHO_P and beside["the searchers' CUDA contexts"] == 3 * 2**29
    assert "--behaviour-logprobs trainer's copy" not in beside
    lagged = dataclasses.replace(cfg, lag=2, behaviour_logprobs="trainer", loss="drgrpo")
    assert gpu.evaluator_needs(lagged, gsm8k)[1]["--behaviour-logprobs trainer's copy"] == 2 * RHO_P
    card(monkeypatch, 40)
    gpu.check_evaluator(cfg, gsm8k, 1)
    assert gpu.check_memory(cfg, gsm8k, 1) > 0  # the searchers' GPUs and the trainer's: held
    card(monkeypatch, 24)
    with pytest.raises(ConfigError, match=r"^--evaluator: after runs a vLLM engine in --trainer-memory 0\.2 of the "
                                          r"trainer's GPU, beside the trainer: .*the trainer's weights, gradients and "
                                          r"AdamW state 16\.4, the shared copy 2\.0, .*GiB.*\(or evaluate with "
                                          r"--evaluator searcher\)$") as e:
        gpu.check_memory(cfg, gsm8k, 1)
    assert "\n" not in str(e.value)
    gpu.check_evaluator(dataclasses.replace(cfg, evaluator="searcher"), gsm8k, 1)


def test_what_the_trainer_keeps_on_the_host_must_fit_its_ram(tmp_path, monkeypatch):
    """--evaluator after's snapshots (84 of rho-math-1b's 2.2 GB at --eval-every 5 over 420 steps: 185 GB) refused on
    a 128 GB host naming --eval-every, held on 1 TB; --lag 10's 11 pinned slots refused on a 16 GB host naming
    --lag; --behaviour-logprobs trainer's ring counted on each of the node's ranks."""
    cfg = rho_config(tmp_path, steps=420, eval_every=5)
    need = gpu.host_needs(cfg, 1)
    assert need == {"--evaluator after's 84 snapshots": 84 * 2 * RHO_P}
    monkeypatch.setattr(gpu, "host_ram", lambda: 128 * 10**9)
    with pytest.raises(ConfigError, match=r"^--eval-every 5: the trainer would keep in this host's RAM --evaluator "
                                          r"after's 84 snapshots 184\.8: 184\.8 GB, more than its 128\.0 GB; evaluate "
                                          r"less often"):
        gpu.check_host(cfg, 1)
    monkeypatch.setattr(gpu, "host_ram", lambda: 10**12)
    gpu.check_host(cfg, 1)
    lagged = dataclasses.replace(cfg, evaluator="searcher", lag=10)
    assert gpu.host_needs(lagged, 1) == {"--lag 10's history (11 pinned copies)": 11 * gpu.pinned_block(
        [math.prod(s) * 2 for s in memory.decoder_shapes(memory.RHO)])}
    monkeypatch.setattr(gpu, "host_ram", lambda: 16 * 10**9)
    with pytest.raises(ConfigError, match=r"^--lag 10: the trainer would keep in this host's RAM --lag 10's history "
                                          r"\(11 pinned copies\) 24\.2: 24\.2 GB, more than its 16\.0 GB; "
                                          r"a smaller --lag$"):
        gpu.check_host(lagged, 1)
    four = gpu.host_needs(dataclasses.replace(lagged, behaviour_logprobs="trainer", loss="drgrpo"), 4, world=4)
    assert four["--behaviour-logprobs trainer's history"] == pytest.approx(11 * 2 * RHO_P, rel=1e-4)


# ===== tools/memory.py's arguments =================================================================================
@pytest.mark.parametrize("argv, says", [
    (["--K", "0"], "--K 0: at least 2"),
    (["--K", "1"], "--K 1: at least 2"),
    (["--layers", "2", "2", "3"], "--layers 2 2 3: three increasing depths"),
    (["--layers", "0", "1", "2"], "--layers 0 1 2: three increasing depths"),
    (["--layers", "1", "3", "2"], "--layers 1 3 2: three increasing depths"),
    (["--layers", "1", "2"], "argument --layers: expected 3 arguments"),
    (["--prompt", "0"], "--prompt 0: at least 1 token"),
    (["--response", "3"], "--response 3: at least 4 tokens"),
    (["--prompt", "2000", "--response", "100"], "--prompt + --response: 2100 tokens"),
    (["--vocab", "999"], "--vocab 999: at least 1000"),
    (["--narrow", "3"], "--narrow 3: must divide"),
    (["--narrow", "0"], "--narrow 0: must divide"),
    (["--K", "x"], "argument --K: invalid int value"),
])
def test_bad_arguments_are_refused_before_measuring(argv, says, monkeypatch, capsys):
    """Each refused in one line, exit status 2, before anything is measured (`--K 0` and `--layers 2 2 3` ended in a
    ZeroDivisionError, the second after 50 s of measuring)."""
    def measured(*a, **k):
        raise AssertionError("measured before refusing")
    monkeypatch.setattr(memory, "init", measured)
    monkeypatch.setattr(memory, "measure", measured)
    with pytest.raises(SystemExit) as e:
        memory.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"memory.py: {says}") and err.count("\n") == 1, err
