"""GPU settings a spawned process would fail on, a searcher GPU's memory (`check_memory`), --evaluator after's
engine beside the trainer and the host's RAM: refused in one line, or computed, by runtime.checks before any process
starts (docs/gpu.md gives the figures)."""

import math
import os

import torch

from runtime.errors import ConfigError


def check_gpus(cfg, local: int) -> str:
    """GPU settings that would fail inside a spawned process, refused here in one line. `local`: the trainer
    ranks on this node (LOCAL_WORLD_SIZE), whose GPUs they and its searchers use; every node checks its own.
    Returns the dtype (`--dtype auto`: bf16 where every GPU used has it, else float16)."""
    gpus = torch.cuda.device_count()
    used = range(local + cfg.searchers)
    if len(used) > gpus:
        raise ConfigError(f"--searchers: {cfg.searchers} searcher(s) + {local} trainer rank(s) on this node need "
                          f"{len(used)} GPUs on it, {gpus} visible")
    # vLLM refuses bf16 below compute capability 8.0 (vllm/platforms/cuda.py:636-654, checking GPU 0
    # only); torch.cuda.is_bf16_supported() says True there (emulation) and checks one device
    oldest = min((torch.cuda.get_device_capability(i), i) for i in used)
    dtype = ("bfloat16" if oldest[0] >= (8, 0) else "float16") if cfg.dtype == "auto" else cfg.dtype
    if dtype == "bfloat16" and oldest[0] < (8, 0):
        raise ConfigError(f"--dtype: bfloat16 needs compute capability 8.0 or newer; GPU {oldest[1]} has "
                          f"{'.'.join(map(str, oldest[0]))} (use --dtype float16)")
    if cfg.searchers and compute_mode(0) == 3:  # NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
        raise ConfigError("--searchers: GPU 0 is in EXCLUSIVE_PROCESS compute mode, but the searchers open the "
                          "shared weights there beside the trainer; set it to DEFAULT (nvidia-smi -i 0 -c DEFAULT)")
    return dtype


def compute_mode(index: int) -> int | None:
    """NVML compute mode of CUDA device `index` (as torch numbers it), or None without NVML. vLLM ships
    nvidia-ml-py as vllm.third_party.pynvml (vllm/utils/import_utils.py:24-52); NVML numbers GPUs
    physically, so the device is found by its UUID."""
    try:
        import pynvml
    except ImportError:
        from vllm.third_party import pynvml
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        uuid = uuid if uuid.startswith(("GPU-", "MIG-")) else "GPU-" + uuid
        return pynvml.nvmlDeviceGetComputeMode(pynvml.nvmlDeviceGetHandleByUUID(uuid))
    except pynvml.NVMLError:  # a MIG device or a UUID NVML does not know: the mode is unknown, as without NVML
        return None
    finally:
        pynvml.nvmlShutdown()


def check_memory(cfg, task, local: int) -> float:
    """The vLLM engines of a searcher (of the trainer, with --searchers 0) and the models it loads beside them fit the
    smallest of this node's searcher GPUs (`memory_split`), --evaluator after's engine the trainer's GPU, the
    trainer's host state its RAM: else a refusal in one line. Returns the engines' share: the flag's, or its default."""
    flag = "searcher-memory" if cfg.searchers else "trainer-memory"
    gpus = range(local, local + cfg.searchers) if cfg.searchers else range(local)
    card = min(torch.cuda.get_device_properties(i).total_memory for i in gpus)
    engines, beside = memory_needs(cfg, task)  # searcher 0's, which evaluates: the most
    share = getattr(cfg, flag.replace("-", "_"))
    share = memory_share(card, beside) if share is None else share
    try:
        memory_split(card, share, engines, beside)
    except ValueError as e:
        raise ConfigError(f"--{flag}: {e}") from None
    check_evaluator(cfg, task, local)
    check_host(cfg, local)
    return share


# --- a searcher GPU's memory: vLLM's share, and its split between the engines of one process ----------
KINDS = {"causal": "AutoModelForCausalLM", "sequence": "AutoModelForSequenceClassification", "base": "AutoModel"}


def text_config(path: str):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(path).get_text_config()


def model_bytes(path: str, dtype: str, kind: str = "causal") -> int:
    """Bytes of the weights of the model at `path` in `dtype` (`weight_shapes`)."""
    size = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    return sum(math.prod(shape) for shape in weight_shapes(path, kind)) * size


def kv_bytes_per_token(path: str, dtype: str) -> int:
    """Bytes of KV cache a token takes in a vLLM engine of the model at `path`: keys and values of every layer."""
    c = text_config(path)
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * torch.empty(0, dtype=getattr(torch, dtype)).element_size()


# A GPU engine's step budget, passed to every vLLM engine on a GPU (runtime/vllm_env.llm_options) and assumed
# by engine_needs, so that the estimate describes the engine that starts. Left to vLLM it would follow visible
# GPU 0 (vllm/engine/arg_utils.py:2913-2914, vllm/platforms/cuda.py:788-804): 8,192 tokens and 256 sequences
# on an A100 or a smaller card, 16,384 and 1,024 on other cards of 70 GiB or more, H100 and H200
# (vllm/engine/arg_utils.py:2923-2951); values given are taken as they are, neither doubled nor clipped
# (vllm/engine/arg_utils.py:3112-3170). Its profile runs a step of that many tokens over that many sequences
# (vllm/v1/worker/gpu_model_runner.py:516-517, 5604-5607, 6193-6195).
BATCH_TOKENS = 8192
BATCH_SEQS = 256


def batch_tokens(max_model_len: int) -> int:
    """The tokens a step of an engine whose longest sequence is `max_model_len`: BATCH_TOKENS, or a whole
    sequence if longer (vLLM refuses less where a prefill is not chunked: vllm/config/scheduler.py:314-326)."""
    return max(BATCH_TOKENS, max_model_len)


def engine_needs(path: str, dtype: str, longest: int, length: int, seqs: int) -> tuple[int, int, int]:
    """A vLLM engine of the model at `path` whose longest sequence is `longest`: (its weights and the working
    memory vLLM measures, the least KV cache, the KV cache a round can fill). The working memory, for its step
    budget (`batch_tokens`, BATCH_SEQS): a step's activations, the sampler's float32 logits and log-probs, and
    512 MiB of CUDA graphs and workspaces; the least KV cache, one whole sequence (vLLM starts no engine with
    less: vllm/v1/core/kv_cache_utils.py:1104-1136); a round's, min(`seqs`, BATCH_SEQS) of `length`."""
    c, d = text_config(path), torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    ffn = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * c.hidden_size
    work = batch_tokens(longest) * (4 * c.hidden_size + 2 * ffn) * d + 3 * BATCH_SEQS * c.vocab_size * 4 + 2**29
    token = kv_bytes_per_token(path, dtype)
    return model_bytes(path, dtype) + work, token * longest, token * min(seqs, BATCH_SEQS) * length


def memory_needs(cfg, task, evaluates: bool = True) -> tuple[dict[str, tuple[int, int, int]], dict[str, int]]:
    """memory_split's inputs for a searcher of this run (`evaluates`: the one that evaluates, the largest), in
    --dtype: the policy's vLLM engine (`engine_needs`), and beside the engines, by name: pi_ref and its log-prob pass,
    the reward model, the task's own (its `memory`), with --searchers 0 the trainer's state and the shared copy, the
    CUDA context and a reload's largest layer (`reload_bytes`)."""
    d = torch.empty(0, dtype=getattr(torch, cfg.dtype)).element_size()
    seqs = cfg.prompts_per_step * cfg.search_samples_per_prompt
    engines = {"policy": engine_needs(cfg.model_path, cfg.dtype, cfg.max_model_len, cfg.max_model_len, seqs)}
    beside = {"pi_ref": model_bytes(cfg.model_path, cfg.dtype),
              "its logits": cfg.score_batch * cfg.max_model_len * text_config(cfg.model_path).vocab_size * d,
              "a float32 chunk": 2**28}
    if cfg.reward_model_path:
        beside["the reward model"] = model_bytes(cfg.reward_model_path, cfg.dtype, "sequence")
    task.memory(cfg, evaluates, engines, beside)
    if not cfg.searchers:  # the trainer's own process runs the engine (runtime/fleet.LocalFleet), on its one GPU
        params, trained = trainer_parameters(cfg)
        beside["the trainer's weights, gradients and AdamW state"] = trainer_bytes(params, trained, cfg.trainer_dtype)
        beside["the shared copy"] = model_bytes(cfg.model_path, cfg.dtype) * (2 if cfg.ref_reset_every else 1)
    beside["the CUDA context"] = 2**30
    beside["a reload's largest layer"] = reload_bytes(cfg.model_path, cfg.dtype)
    return engines, beside


def reload_bytes(path: str, dtype: str) -> int:
    """What vLLM 0.32's reload of new weights allocates beside the engine: it rebuilds each layer on the
    device (as vLLM fuses them: embeddings, LM head, q k v, gate and up), loads it, copies it into the
    engine's tensors and lets it go (vllm/model_executor/model_loader/reload/layerwise.py:344-401,
    materialize_layer in meta.py:145-153): the largest layer (Qwen2.5-7B's embeddings: 1.09 GB)."""
    c, d = text_config(path), torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    h = c.hidden_size
    ffn = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * h
    head = getattr(c, "head_dim", None) or h // c.num_attention_heads
    qkv = (c.num_attention_heads + 2 * (getattr(c, "num_key_value_heads", None) or c.num_attention_heads)) * head
    return max(c.vocab_size * h, qkv * h, 2 * ffn * h) * d


def trainer_bytes(params: int, trained: int, trainer_dtype: str, gradients: bool = True) -> int:
    """The trainer's own bytes on one rank (nothing sharded) for `params` parameters of which `trained` learn (all,
    or LoRA's adapter): the weights and gradients in --trainer-dtype (FSDP2 casts the float32 reduction back:
    torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:696), AdamW's moments in float32 (runtime/policy.AdamW);
    `gradients` False: before a backward pass makes them. A pass's activations are not in it (tools/memory.py)."""
    w = torch.empty(0, dtype=getattr(torch, trainer_dtype)).element_size()
    return w * params + ((w if gradients else 0) + 8) * trained


def trainer_parameters(cfg) -> tuple[int, int]:
    """(the trainer's parameters, those that learn) for this run's model, counted on the meta device."""
    import transformers
    from runtime import lora
    config = transformers.AutoConfig.from_pretrained(cfg.model_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
        if cfg.lora_rank:
            model = lora.wrap(model, cfg.lora_rank, cfg.lora_alpha, cfg.seed)
    params = sum(p.numel() for p in model.parameters())
    return params, sum(p.numel() for p in model.parameters() if p.requires_grad)


def memory_share(card: int, beside: dict[str, int]) -> float:
    """--searcher-memory's default: all of a GPU of `card` bytes that the models beside the engines leave
    (rounded down to 0.01), at most vLLM's own default of 0.9. vLLM takes its share when it starts and refuses
    to start with less free (vllm/v1/worker/utils.py:716-772); the searcher loads the rest after it."""
    return min(0.9, math.floor(100 * (1 - sum(beside.values()) / card)) / 100)


def memory_split(card: int, share: float, engines: dict[str, tuple[int, int, int]],
                 beside: dict[str, int]) -> dict[str, float]:
    """Each engine's gpu_memory_utilization on a GPU of `card` bytes whose `share` (--searcher-memory) holds
    this process's vLLM engines (memory_needs gives `engines` and `beside`). engines[name] = (bytes besides
    the KV cache, the least KV cache, the KV cache a round can fill): each gets its first two, and the share's
    spare goes to the KV caches in proportion to the third. `beside` (the models loaded after the engines)
    must fit in 1 - share. In vLLM 0.32 an engine's fraction is a budget of its own: its KV cache is what its
    weights, activations and CUDA graphs leave of it, and the engines started before it count as another
    process (vllm/v1/worker/utils.py:716-770, vllm/v1/worker/gpu_worker.py:713-744,
    vllm/utils/mem_utils.py:242-245). Raises ValueError, one line naming what does not fit."""
    gib = lambda b: f"{b / 2**30:.1f} GiB"
    them = f"the {' + '.join(engines)} engine" + ("s'" if len(engines) > 1 else "'s")
    fixed, rest = sum(f + least for f, least, _ in engines.values()), sum(beside.values())
    listed = ", ".join(f"{what} {b / 2**30:.1f}" for what, b in beside.items())
    if fixed + rest > card:
        raise ValueError(f"{them} {gib(fixed)} and the models beside {'them' if len(engines) > 1 else 'it'} "
                         f"({listed}: {gib(rest)}) need more than this GPU's {gib(card)}")
    if fixed > share * card:
        raise ValueError(f"{share} of this GPU's {gib(card)} cannot hold {them} {gib(fixed)}; give "
                         f"{'them' if len(engines) > 1 else 'it'} at least {math.ceil(100 * fixed / card) / 100}")
    if rest > (1 - share) * card:
        raise ValueError(f"{share} of this GPU's {gib(card)} leaves less than the {gib(rest)} of the models beside "
                         f"the engines ({listed}); give the engines at most {math.floor(100 * (1 - rest / card)) / 100}")
    spare, wanted = share * card - fixed, sum(w for *_, w in engines.values())
    return {name: (f + least + spare * w / wanted) / card for name, (f, least, w) in engines.items()}


# --- --evaluator after's engine on the trainer's GPU; the host's RAM -----------------------------------
def evaluator_needs(cfg, task) -> tuple[dict[str, tuple[int, int, int]], dict[str, int]]:
    """memory_split's inputs for --evaluator after's engine, in the trainer's process on its GPU: what the engine
    counts itself (`memory_needs` of the searcher that evaluates, pi_ref among them) and, beside it, the trainer's
    state (`trainer_bytes`), the shared copy (two with TBA′'s pi_ref), --behaviour-logprobs trainer's copy and 0.5 GiB
    for each searcher's CUDA context on this GPU (CUDA IPC). A pass's activations are not counted (tools/memory.py)."""
    engines, beside = memory_needs(cfg, task, evaluates=True)
    params, trained = trainer_parameters(cfg)
    copy = model_bytes(cfg.model_path, cfg.dtype)
    beside["the trainer's weights, gradients and AdamW state"] = trainer_bytes(params, trained, cfg.trainer_dtype)
    beside["the shared copy"] = copy * (2 if cfg.ref_reset_every else 1)
    if cfg.behaviour_logprobs == "trainer":
        beside["--behaviour-logprobs trainer's copy"] = copy
    beside["the searchers' CUDA contexts"] = cfg.searchers * 2**29
    return engines, beside


def check_evaluator(cfg, task, local: int):
    """--evaluator after (one trainer rank): its vLLM engine takes --trainer-memory of the trainer's GPU when
    it starts, before the trainer loads its model (runtime/fleet.Fleet.beside); the trainer must fit in the
    rest, or a refusal in one line naming both flags and the figures (memory_split's)."""
    if cfg.evaluator != "after":
        return
    card = min(torch.cuda.get_device_properties(i).total_memory for i in range(local))
    engines, beside = evaluator_needs(cfg, task)
    share = memory_share(card, beside) if cfg.trainer_memory is None else cfg.trainer_memory
    try:
        memory_split(card, share, engines, beside)
    except ValueError as e:
        raise ConfigError(f"--evaluator: after runs a vLLM engine in --trainer-memory {share} of the trainer's GPU, "
                          f"beside the trainer: {e} (or evaluate with --evaluator searcher)") from None


def pinned_block(sizes) -> int:
    """Bytes of ONE pinned host block holding tensors of `sizes` bytes, each at an offset aligned to 64 bytes:
    a slot of --lag's history (runtime/weights.flat_slot), exact on any torch. The slot is plain host memory
    page-locked in place (cudaHostRegister), not torch's caching host allocator's, which rounds a block up to
    a power of two (ATen/core/CachingHostAllocator.h:302-309) and, with that rounding turned off, could hand a
    freed smaller block of the same power-of-two bucket to a larger request (get_free_block, :621-633)."""
    return max(1, sum(-(-s // 64) * 64 for s in sizes))


def snapshots(steps: int, eval_every: int) -> int:
    """The most weight snapshots --evaluator after holds at once (runtime/evaluations.Asked.request keeps one per
    evaluation, `kept` drops them once evaluated): the initial evaluation's (tba.train's first) and one every
    --eval-every steps below --steps, evaluated before the final one is taken (Trainer.finish)."""
    return 1 + ((steps - 1) // eval_every if eval_every else 0)


def shard_rows(rows: int, world: int, rank: int) -> int:
    """Rows of dim 0 that FSDP2 gives `rank` of `world`, ceil(rows / world) each, the last ones fewer or none:
    torch.chunk's cut (torch/distributed/fsdp/_fully_shard/_fsdp_common.py:134-140)."""
    each = -(-rows // world)
    return max(0, min(each, rows - rank * each))


def weight_shapes(path: str, kind: str = "causal") -> list[tuple[int, ...]]:
    """The shapes of the distinct weights of the model at `path` (a tied tensor once), counted on the meta device (no
    weights read); `kind`: causal (an LM), sequence (a classifier) or base (an encoder)."""
    import transformers
    with torch.device("meta"):
        model = getattr(transformers, KINDS[kind]).from_config(transformers.AutoConfig.from_pretrained(path))
    return [tuple(p.shape) for p in model.parameters()]


def host_ram() -> int:
    """The host's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_needs(cfg, local: int, world: int | None = None) -> dict[str, int]:
    """What this node's trainer processes keep in the host's RAM for the whole run, by name: --lag L's history on the
    node's leader (runtime/weights.Outbox: L + 1 pinned slots of the weights in --dtype, `pinned_block`),
    --behaviour-logprobs trainer's on every rank (runtime/policy.LaggedCopy: L + 1 pinned slots of its FSDP2 shards in
    --dtype), --evaluator after's snapshots (pageable, in --dtype: `snapshots`). `world`: all the trainer ranks
    (torchrun's WORLD_SIZE); the node's ranks hold about the same shards as ranks 0 to `local` - 1."""
    if cfg.lag is None and cfg.evaluator != "after":
        return {}  # nothing kept: no model built
    shapes, d = weight_shapes(cfg.model_path), torch.empty(0, dtype=getattr(torch, cfg.dtype)).element_size()
    sizes, need = [math.prod(s) * d for s in shapes], {}
    if cfg.lag is not None:
        need[f"--lag {cfg.lag}'s history ({cfg.lag + 1} pinned copies)"] = (cfg.lag + 1) * pinned_block(sizes)
        if cfg.behaviour_logprobs == "trainer":
            world = world or int(os.environ.get("WORLD_SIZE", local))
            shards = [[shard_rows(s[0], world, r) * math.prod(s[1:]) * d for s in shapes] for r in range(local)]
            need["--behaviour-logprobs trainer's history"] = (cfg.lag + 1) * sum(pinned_block(x) for x in shards)
    if cfg.evaluator == "after":
        n = snapshots(cfg.steps, cfg.eval_every)
        need[f"--evaluator after's {n} snapshots"] = n * sum(sizes)
    return need


def check_host(cfg, local: int):
    """What the trainer keeps on the host (`host_needs`) fits its RAM, or a refusal in one line naming the
    flag to change (--eval-every where --evaluator after keeps snapshots, else --lag) and the figures."""
    need = host_needs(cfg, local)
    total, ram = sum(need.values()), host_ram()
    if total <= ram:
        return
    listed = ", ".join(f"{what} {b / 1e9:.1f}" for what, b in need.items())
    flag, fix = ((f"eval-every {cfg.eval_every}", "evaluate less often (a larger --eval-every) or by a searcher "
                  "(--evaluator searcher)") if cfg.evaluator == "after" else (f"lag {cfg.lag}", "a smaller --lag"))
    raise ConfigError(f"--{flag}: the trainer would keep in this host's RAM {listed}: {total / 1e9:.1f} GB, more than "
                      f"its {ram / 1e9:.1f} GB; {fix}")
