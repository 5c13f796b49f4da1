"""Weight sync: after new weights are published, vLLM in a searcher computes the same log-probs
as the trainer for the same weights (float32, within 1e-4), and no stale prefix cache survives."""

import dataclasses
import queue as queue_module
import time

import pytest

from conftest import DEVICE
import torch
import torch.multiprocessing as mp

import searcher
from runtime.config import Config
from loss import sequence_logprobs
from rewards import arith_reward
from runtime import weights
from loss import collate
from searcher import Engine
from runtime.processes import Channels
from tasks.task import Data


def config(model, **kw):
    return Config(**{**dict(model=model, prompts_per_step=3, samples_per_prompt=4, temperature=0.7, max_new_tokens=6,
                            device=DEVICE.split(":")[0], threads=1, model_path=model, max_model_len=512, dtype="float32",
                            search_samples_per_prompt=4, round_prompts=3, score_batch=256), **kw})


def share(model, ctx, with_ref=False):
    """The trainer's side of the weight path for `model` (one process, CPU shared memory)."""
    shared = weights.create(ctx)
    weights.allocate(shared, weights.gather(model), weights.aliases(model), "cpu", torch.float32, with_ref)
    return shared


def perturbed(model_path, seed):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def vllm_logprob(engine, prompt: list[int], response: list[int]) -> float:
    """vLLM's summed log-prob of a fixed response (raw logits: temperature 1), from its prompt log-probs."""
    from vllm import SamplingParams
    out = engine.llm.generate([{"prompt_token_ids": prompt + list(response)}],
                              SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return sum(out.prompt_logprobs[len(prompt) + i][tok].logprob for i, tok in enumerate(response))


def trainer_logprobs(model, pairs, temperature):
    with torch.no_grad():
        return sequence_logprobs(model, *collate(pairs, 0, "cpu"), temperature).tolist()


@pytest.mark.engine
@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_engine_matches_trainer_after_sync(arch, request):
    """Llama (character tokens, vLLM's native code) and GPT-NeoX (BPE tokens, vLLM's Transformers
    backend, pi_ref built beside it: Engine.beside)."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    tiny_model = request.getfixturevalue("tiny_model" if arch == "llama" else "tiny_neox")
    cfg = config(tiny_model)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt = tok("12+34=46\n" * 40 + "47+85=").input_ids  # long: whole KV blocks get cached
    response = tok("132").input_ids + [tok.eos_token_id]
    model = perturbed(tiny_model, 0)
    shared = share(model, mp.get_context("spawn"))
    engine = Engine(cfg, DEVICE, 0.1, [prompt], ["132"])
    sample = SamplingParams(temperature=1.0, seed=0, max_tokens=8, ignore_eos=True, logprobs=0)
    before = engine.llm.generate([{"prompt_token_ids": prompt}], sample, use_tqdm=False)[0].outputs[0]
    for version, seed in ((2, 1), (4, 2)):
        with engine.beside():  # the trainer's side, in this process beside the engine
            model = perturbed(tiny_model, seed)
        weights.write(shared, weights.gather(model), version, lambda: None, 10)
        inbox = weights.Inbox(shared, 0, None, lambda: None, 10)
        assert engine.sync(inbox) and engine.version == version
        assert not engine.sync(inbox)  # no version move, no reload
        # a fixed response: vLLM's prompt log-probs (raw logits) vs the trainer's at temperature 1
        assert abs(vllm_logprob(engine, prompt, response) - trainer_logprobs(model, [(prompt, response)], 1.0)[0]) < 1e-4
        # the cached prompt prefix was dropped: sampled tokens' log-probs follow the new weights
        after = engine.llm.generate([{"prompt_token_ids": prompt}], sample, use_tqdm=False)[0].outputs[0]
        expected = trainer_logprobs(model, [(prompt, list(after.token_ids))], 1.0)[0]
        assert abs(after.cumulative_logprob - expected) < 1e-4
        assert abs(after.cumulative_logprob - before.cumulative_logprob) > 1e-3
    # pi_ref in the same process (the patched class, for GPT-NeoX) gives the trainer's log-probs
    with engine.beside():
        initial = load(tiny_model)
    assert abs(engine.logprobs(engine.pi_ref(), [(prompt, response)], 0.7)[0]
               - trainer_logprobs(initial, [(prompt, response)], 0.7)[0]) < 1e-4
    engine.close()


@pytest.mark.engine
@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_engine_loads_a_model_directly_with_its_tied_names(arch, request):
    """The synchronous trainer's evaluation loads its current weights into its engine directly
    (weights.every_name): vLLM then computes the trainer's log-probs, LM head included. The tiny Llama
    ties its LM head to the embeddings: given the embeddings' name alone, vLLM keeps the old head (-12.26
    against the trainer's -10.93 for a fixed response), and a resumed synchronous run would search its
    first steps with a mixed policy; the GPT-NeoX has no tied name."""
    from transformers import AutoTokenizer
    tiny_model = request.getfixturevalue("tiny_model" if arch == "llama" else "tiny_neox")
    cfg = config(tiny_model)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt, response = tok("47+85=").input_ids, tok("132").input_ids + [tok.eos_token_id]
    engine = Engine(cfg, DEVICE, 0.1, [prompt], ["132"])
    try:
        for version, seed in ((2, 1), (4, 2)):
            with engine.beside():
                model = perturbed(tiny_model, seed)
            engine.load(weights.every_name(model, torch.float32), version)
            assert abs(vllm_logprob(engine, prompt, response) - trainer_logprobs(model, [(prompt, response)], 1.0)[0]) < 1e-4
        assert sorted(weights.aliases(model)) == (["lm_head.weight"] if arch == "llama" else [])
    finally:
        engine.close()


def load(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.mark.engine
def test_reference_reset_reaches_the_searcher(tiny_model):
    """TBA′: after the trainer publishes the weights of step 6 as pi_ref too, the searcher's
    logp_ref of a fixed response is the trainer's log-prob under those weights (float32, 1e-4), and
    its trajectories say which reference scored them."""
    from transformers import AutoTokenizer
    cfg = config(tiny_model)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt, response = tok("47+85=").input_ids, tok("132").input_ids + [tok.eos_token_id]
    shared = share(load(tiny_model), mp.get_context("spawn"), with_ref=True)
    engine = Engine(cfg, DEVICE, 0.1, [prompt], ["132"])
    before = engine.logprobs(engine.pi_ref(), [(prompt, response)], 0.7)[0]
    model = perturbed(tiny_model, 5)
    weights.write(shared, weights.gather(model), 6, lambda: None, 10, to=("policy", "pi_ref"))
    assert engine.sync(weights.Inbox(shared, 0, None, lambda: None, 10))
    assert (engine.version, engine.pi_ref_version) == (6, 6)
    after = engine.logprobs(engine.pi_ref(), [(prompt, response)], 0.7)[0]
    assert abs(after - trainer_logprobs(model, [(prompt, response)], 0.7)[0]) < 1e-4
    assert abs(after - before) > 1e-3
    trajectories, _ = engine.search([0], 4, (0, 0, 0))
    assert {t.pi_ref_version for t in trajectories} == {6}
    for t in trajectories:
        assert abs(t.logp_ref - trainer_logprobs(model, [(prompt, t.response.tolist())], 0.7)[0]) < 1e-4
    engine.close()


@pytest.mark.engine
def test_searcher_process_after_sync(tiny_model):
    """The real searcher process: trajectories sampled after a sync carry vLLM's log-probs at the
    sampling temperature, equal to the trainer's for the published weights, and pi_ref's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    cfg = config(tiny_model)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompts = [tok(f"{a}+{b}=").input_ids for a, b in ((12, 34), (56, 78), (90, 11), (25, 25))]
    answers = ["46", "134", "101", "50"]
    ctx = mp.get_context("spawn")
    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    shared = share(ref, ctx)
    queue, stop = ctx.Queue(maxsize=4), ctx.Event()
    channels = Channels(queue, stop, None, None)
    proc = ctx.Process(target=searcher.run, daemon=True,
                       args=(0, cfg, shared, channels, Data(prompts, answers, prompts, answers), "cpu"))
    proc.start()
    try:
        model = perturbed(tiny_model, 3)
        weights.write(shared, weights.gather(model), 2, lambda: None, 10)
        deadline, fresh = time.time() + 120, []
        while not fresh:
            assert time.time() < deadline and proc.is_alive()
            try:
                msg = queue.get(timeout=1)
            except queue_module.Empty:
                continue
            fresh = [t for t in msg["trajectories"] if t.version == 2]
        pairs = [(prompts[t.prompt_id], t.response.tolist()) for t in fresh]
        for t, lp, lp_ref in zip(fresh, trainer_logprobs(model, pairs, 0.7), trainer_logprobs(ref, pairs, 0.7)):
            assert abs(t.logp_behaviour - lp) < 1e-4
            assert abs(t.logp_ref - lp_ref) < 1e-4
            assert t.reward == arith_reward(tok.decode(t.response, skip_special_tokens=True), answers[t.prompt_id])
        assert len(fresh) == 3 * 4
    finally:
        stop.set()
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


@pytest.mark.engine
@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "gpt2", "qwen2"])
def test_each_version_is_verified_in_the_engine_and_a_wrong_tensor_named(arch, request, tmp_path):
    """The weights an engine holds, read back from it after each load (vLLM fuses Llama's and Qwen2's q, k, v and
    gate/up, transposes GPT-2's Conv1D, serves GPT-NeoX through its Transformers backend under other names, repacks
    CPU linear weights; Llama ties its head), match the fingerprints the trainer published with them, every name
    checked; a published name that maps to no parameter of the engine fails the check (it would pass unchecked); one
    shared tensor changed after its fingerprint stops the load, naming the version and the tensor."""
    import models
    from runtime.errors import WrongWeights
    if arch == "llama":
        path = request.getfixturevalue("tiny_model")
    elif arch == "gpt_neox":
        path = request.getfixturevalue("tiny_neox")
    else:
        path = str(tmp_path / arch)
        models.make_model(path, hidden=64, layers=2, heads=2, max_len=512, arch=arch, tokenizer=models.make_bpe_tokenizer())
    cfg = config(path)
    engine = Engine(cfg, DEVICE, 0.1, [[5, 6, 7]], ["1"])
    try:
        with engine.beside():  # (GPT-NeoX's classes, rewritten by vLLM in this process)
            shared = share(load(path), mp.get_context("spawn"))
        inbox = weights.Inbox(shared, 0, None, lambda: None, 10)
        for version, seed in ((2, 1), (3, 2)):
            with engine.beside():
                model = perturbed(path, seed)
            weights.write(shared, weights.gather(model), version, lambda: None, 10)
            assert engine.sync(inbox) and engine.verified == version
        names, prints = shared.prints  # every name published maps to a parameter; one mapped to none fails
        engine.verify(names, prints)
        with pytest.raises(WrongWeights, match=r"the weights of step 3 could not all be checked: 1 of the \d+ tensors "
                                               r"published map to no parameter of vLLM's engine \(model\.extra\.weight\)"):
            engine.verify([*names, "model.extra.weight"], torch.cat([prints, torch.ones(1, 3, dtype=prints.dtype)]))
        with engine.beside():
            model = perturbed(path, 3)
        weights.write(shared, weights.gather(model), 4, lambda: None, 10)
        name = [n for n in shared.prints[0] if n.endswith("weight") and shared.tensors[n].dim() == 2][2]
        with torch.no_grad():
            shared.tensors[name][0, 0] += 1e-3  # after the fingerprint: what the engine loads is not what was sent
        with pytest.raises(WrongWeights, match=rf"the weights of step 4 did not arrive intact: .*{name.rsplit('.', 2)[-2]}"):
            engine.sync(inbox)
        assert engine.verified == 3
    finally:
        engine.close()
