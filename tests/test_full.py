"""--keep-full: a searcher's engine kept full through the long tail (runtime/decoding.Full), on the real engine.

Each response is a request of its own; a finished response's slot takes the next prompt's at once; a prompt comes
back as soon as its n responses are done; new weights load with requests in flight, and each response says the first
and last weights that sampled it."""

import dataclasses

import numpy as np
import pytest

from conftest import DEVICE, SMALL, metrics

pytestmark = pytest.mark.engine


def engine_of(tiny_model, count: int, max_model_len: int = 64, **kw):
    from searcher import Engine
    from tasks.arith import splits
    from test_weight_sync import config
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompts = [tok(p.prompt).input_ids for p in splits()[0][:count]]
    cfg = dataclasses.replace(config(tiny_model, max_new_tokens=8, temperature=1.0, **kw), max_model_len=max_model_len)
    return Engine(cfg, DEVICE, 0.1, prompts, ["0"] * count)


def test_the_engine_is_kept_full_and_every_prompt_comes_back_once(tiny_model):
    """Each call brings the prompts the decoder asks for (`prompts()`) and returns as soon as a prompt's n responses
    are done, whole prompts only, earlier calls' among them; every decoding step but the drain's runs the engine's
    whole room of sequences; the drain (before an evaluation) returns the rest: each prompt's n responses exactly
    once. The same prompts in plain rounds run down to their slowest response."""
    from runtime import decoding
    n, room, count = 4, 3, 40
    engine = engine_of(tiny_model, count, keep_full=True, round_prompts=room, search_samples_per_prompt=n)
    assert isinstance(engine.decoder, decoding.Full)
    running, step = [], engine.clock.step
    engine.clock.step = lambda seconds, r: (running.append(r), step(seconds, r))
    queue, back, call = list(range(count)), [], 0
    while queue:
        ids, queue = queue[:engine.decoder.prompts()], queue[engine.decoder.prompts():]  # none while n wait
        trajectories, _ = engine.search(np.array(ids), n, (0, 1, call))
        got = [t.prompt_id for t in trajectories]
        assert got and all(got.count(p) == n for p in got), (call, got)  # whole prompts, as soon as done
        back += trajectories
        call += 1
    full = len(running)
    rest, _ = engine.search(None, n, ())  # the drain
    back += rest
    assert call > count // room, call  # prompts came back a few at a time, not a round at a time
    assert all(r == room * n for r in running[:full]), running  # every step with a slot empty refilled at once
    assert not engine.llm.llm_engine.has_unfinished_requests() and engine.decoder.open == {}
    assert sorted(t.prompt_id for t in back) == sorted(np.repeat(np.arange(count), n).tolist())  # each n times, once
    low = []
    engine.decoder = decoding.Stepped(engine.llm, engine.clock, round_prompts=room)
    engine.clock.step = lambda seconds, r: (low.append(r), step(seconds, r))
    for i in range(3):
        engine.search(np.arange(i * room, (i + 1) * room), n, (0, 2, i))
    assert min(low) < room * n, low  # a plain round runs down to its slowest response, a step below its room
    engine.close()


def test_new_weights_load_with_responses_in_flight(tiny_model):
    """Weights published between two calls load at once, responses in flight going on under them: a response in
    flight then says 0 as its first weights and 1 as its last (vLLM's labels of its tokens), one begun after says 1
    and 1; every response's token log-probs add up to its behaviour log-prob."""
    import multiprocessing as mp
    from runtime import weights
    from test_weight_sync import load, perturbed, share
    n, room = 4, 3
    engine = engine_of(tiny_model, 30, keep_full=True, round_prompts=room, search_samples_per_prompt=n)
    shared = share(load(tiny_model), mp.get_context("spawn"))
    inbox = weights.Inbox(shared, 0, None, lambda: None, 10)
    first, _ = engine.search(np.arange(engine.decoder.prompts()), n, (0, 1, 0))
    weights.write(shared, weights.gather(perturbed(tiny_model, 1)), 1, lambda: None, 10)
    assert engine.sync(inbox) and engine.version == 1 and engine.decoder.busy()  # loaded in flight
    back, call = list(first), 1
    while engine.decoder.busy() or call < 6:
        more, _ = engine.search(np.arange(call * 4, call * 4 + engine.decoder.prompts()) % 30, n, (0, 1, call))
        back += more
        call += 1
        if call >= 6:
            back += engine.search(None, n, ())[0]
            break
    spans = {(t.version, t.version_last) for t in back}
    assert (0, 1) in spans and (1, 1) in spans and spans <= {(0, 0), (0, 1), (1, 1)}, spans
    assert all(np.isclose(t.behaviour_logps.sum(), t.logp_behaviour, atol=1e-4) for t in back)
    engine.close()


def test_an_evaluation_after_weights_loaded_in_flight_is_of_those_weights(tiny_model):
    """Weights loaded in flight leave older weights' blocks in the prefix cache (only the requests after are salted);
    an evaluation after the drain reads what an engine that loaded them between rounds reads: the log-probs of the
    held-out prompts' first tokens (prompts of whole cache blocks, cached by an evaluation of the initial weights)."""
    import multiprocessing as mp
    from vllm import SamplingParams
    from runtime import weights
    from tasks.arith import splits
    from test_weight_sync import load, perturbed, share
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model)
    held = [tok("10+10=20 " * 40 + p.prompt).input_ids for p in splits()[1][:4]]  # 300 tokens: whole blocks
    shared = share(load(tiny_model), mp.get_context("spawn"))
    read = []
    for keep_full in (True, False):
        engine = engine_of(tiny_model, 30, 512, keep_full=keep_full, round_prompts=3, search_samples_per_prompt=4)
        inbox = weights.Inbox(shared, 0, None, lambda: None, 10)
        engine.evaluate(held, ["0"] * 4)  # the held-out prompts' blocks cached under the initial weights
        engine.search(np.arange(engine.decoder.prompts()), 4, (0, 1, 0))
        if keep_full:
            weights.write(shared, weights.gather(perturbed(tiny_model, 1)), 1, lambda: None, 10)
            assert engine.decoder.busy()
        engine.sync(inbox)
        if keep_full:
            engine.search(None, 4, ())
        engine.evaluate(held, ["0"] * 4)
        outs = engine.llm.generate([{"prompt_token_ids": p} for p in held],
                                   SamplingParams(max_tokens=1, temperature=0, logprobs=0), use_tqdm=False)
        read.append([o.outputs[0].cumulative_logprob for o in outs])
        engine.close()
    assert np.allclose(read[0], read[1], atol=1e-4), read


def test_a_run_with_the_engine_kept_full(tiny_model, tmp_path):
    """tba.py --keep-full: the run ends, each evaluation asked comes (searcher 0 drains its engine first), the rows
    give the staleness from the last weights that sampled each response too, never above the first's."""
    from conftest import run_tba
    out = tmp_path / "run"
    p = run_tba(["--model", tiny_model, *SMALL, "--steps", "8", "--eval-every", "2", "--keep-full", "--out", str(out)],
                tmp_path)
    assert p.returncode == 0, p.stdout[-3000:]
    rows = metrics(out)
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 9))
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [0, 2, 4, 6, 8]
    assert all(r["staleness_last"] <= r["staleness"] for r in train)
    assert train[-1]["reuse"] <= 1.0 + 1e-9

