"""The authors' settings, reproduced: their beta and learning-rate schedules at every update (the
expected values come from their formulas, written out here, not from tba.py), the GSM8K run's bf16
trainer (bf16 weights, float32 AdamW moments) with a checkpoint and an exact resume, and the TL;DR
evaluation."""

import pytest
import torch

import loss
from runtime import policy
from runtime.config import Config


from conftest import SMALL, metrics, run_tba
from test_run_scripts import dry_run


def authors_beta(u: int, start: float, final: float, stop: int, target: int) -> float:
    """src/tba_trainer_tldr.py:576-580 (and src/tba_trainer_gsm8k.py:659-660) at update u = 1, 2, ..."""
    if u < stop:
        return final * (u - 1) / target + start * (1 - (u - 1) / target)
    return final


@pytest.mark.engine
@pytest.mark.parametrize("setting,stop,target,steps", [("table3", 32, 128, 256), ("table1", 78, 312, 625)])
def test_tldr_beta_is_the_authors_at_every_update(setting, stop, target, steps):
    _, cfg = dry_run(script="scripts/run_tldr.sh", SETTING=setting)
    assert cfg.steps == steps
    for u in range(1, steps + 1):  # tba.py takes update u at step index u - 1 (the row's "step" is u)
        assert loss.beta_at(cfg, u - 1) == pytest.approx(authors_beta(u, 1.0, 0.05, stop, target), rel=1e-12), u
    assert loss.beta_at(cfg, stop - 2) > 0.5 and loss.beta_at(cfg, stop - 1) == 0.05  # the jump, at update `stop`


@pytest.mark.engine
def test_gsm8k_beta_is_the_authors_at_every_update():
    _, cfg = dry_run()
    for u in range(1, cfg.steps + 1):  # kl_coef_decay_stop_iter = kl_coef_decay_target_iter = 500
        assert loss.beta_at(cfg, u - 1) == pytest.approx(authors_beta(u, 0.014, 0.004, 500, 500), rel=1e-12), u


@pytest.mark.engine
def test_tldr_linear_learning_rate_at_every_update():
    """transformers' get_linear_schedule_with_warmup, no warmup: lr (N - s) / N after s scheduler steps;
    tba.py's update u is taken after u - 1 of them (the authors' loop steps the scheduler once more,
    first: their update u gets lr (N - u) / N, our update u + 1; run_tldr.sh says so)."""
    _, cfg = dry_run(script="scripts/run_tldr.sh")
    N = 256
    for u in range(1, N + 1):
        expected = 3e-6 * max(0.0, (N - (u - 1)) / N)
        assert policy.lr_at(cfg, u - 1) == pytest.approx(expected, rel=1e-12, abs=1e-24), u
    assert policy.lr_at(cfg, 0) == 3e-6 and policy.lr_at(cfg, N - 1) == pytest.approx(3e-6 / N)


def test_linear_decay_after_warmup_and_stable_phases():
    cfg = Config(steps=40, lr=2e-4, warmup_steps=5, stable_steps=10, decay_steps=20, lr_decay="linear")
    for s in range(60):
        if s < 5:
            expected = 2e-4 * (s + 1) / 5
        elif s < 15:
            expected = 2e-4
        else:
            expected = 2e-4 * max(0.0, 1 - (s - 15) / 20)
        assert policy.lr_at(cfg, s) == pytest.approx(expected, rel=1e-12, abs=1e-24), s


@pytest.mark.parametrize("args,match", [
    (["--trainer-dtype", "float16"], "--trainer-dtype: unknown 'float16' (choose from float32, bfloat16)"),
    (["--lr-decay", "step"], "--lr-decay: unknown 'step' (choose from cosine, linear)"),
    (["--beta-stop-step", "-1"], "--beta-stop-step: must be 0 or more"),
    (["--eval-temperature", "-0.5"], "--eval-temperature: must be 0 (greedy) or more"),
])
def test_new_flags_refuse_bad_values(args, match, tmp_path, monkeypatch, capfd):
    from test_config import refuse
    refuse(args, tmp_path, monkeypatch, capfd, match)




@pytest.mark.engine
def test_bf16_trainer_checkpoint_and_exact_resume(tiny_model, tmp_path):
    """--trainer-dtype bfloat16 (synchronous, fixed seed): the weights are bf16 in the checkpoint and AdamW's
    moments float32 (policy.AdamW), and 4 steps straight equal 2 steps, a checkpoint, then a resume to 4 (the same
    bf16 weights, bit for bit: the resumed moments are the saved float32 ones, not torch's bf16 cast of them). The resumed run
    evaluates at its start, loading the weights into its engine directly (weights.every_name, tied names
    included); at seed 1 a stale tied LM head there samples other responses at step 3 and the losses part."""
    from safetensors.torch import load_file
    common = ["--model", tiny_model, "--searchers", "0", "--seed", "1", "--sync-every", "2", "--eval-every", "0",
              "--trainer-dtype", "bfloat16", *SMALL]
    a = run_tba([*common, "--steps", "4", "--out", str(tmp_path / "a")], tmp_path)
    assert a.returncode == 0, a.stdout[-3000:]
    b1 = run_tba([*common, "--steps", "2", "--save-every", "2", "--out", str(tmp_path / "b")], tmp_path)
    assert b1.returncode == 0, b1.stdout[-3000:]
    state = torch.load(tmp_path / "b" / "checkpoint" / "trainer.pt", weights_only=True)
    moments = [v for s in state["optimizer"]["state"].values() for k, v in s.items() if k.startswith("exp_avg")]
    assert moments and {m.dtype for m in moments} == {torch.float32}
    saved = load_file(tmp_path / "b" / "checkpoint" / "model" / "model.safetensors")
    assert {t.dtype for t in saved.values() if t.is_floating_point()} == {torch.bfloat16}
    b2 = run_tba([*common, "--steps", "4", "--resume", str(tmp_path / "b" / "checkpoint"),
                  "--out", str(tmp_path / "b2")], tmp_path)
    assert b2.returncode == 0, b2.stdout[-3000:]
    rows_a = [r for r in metrics(tmp_path / "a") if r["kind"] == "train"]
    rows_b = [r for r in metrics(tmp_path / "b2") if r["kind"] == "train"]
    assert [r["step"] for r in rows_b] == [3, 4]
    for ra, rb in zip(rows_a[2:], rows_b):
        assert (ra["lr"], ra["beta"], ra["reward"], ra["loss"]) == (rb["lr"], rb["beta"], rb["reward"], rb["loss"])
    wa = load_file(tmp_path / "a" / "final" / "model.safetensors")
    wb = load_file(tmp_path / "b2" / "final" / "model.safetensors")
    start = load_file(f"{tiny_model}/model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert all(wa[k].dtype == torch.bfloat16 for k in wa if wa[k].is_floating_point())
    assert max((wa[k].float() - start[k].float()).abs().max().item() for k in wa) > 1e-3  # it trained


# --- the TL;DR evaluation (the authors' eval_tldr/) on the tiny GPT-NeoX fixtures -----------------
def direct_kl_nll(policy, ref, prompt, response):
    """Per sequence, unbatched: sum over the distributions that drew the response of KL(ref || policy)
    over the whole vocabulary (torch's kl_div, as the authors' KLDivLoss(log_target=True)), and the
    response's NLL under ref."""
    import torch.nn.functional as F
    ids = torch.tensor([prompt + response], device=policy.device)
    with torch.no_grad():
        logp = F.log_softmax(policy(input_ids=ids).logits[0].float(), -1)   # (T, V)
        logp_ref = F.log_softmax(ref(input_ids=ids).logits[0].float(), -1)  # (T, V)
    rows = range(len(prompt) - 1, len(prompt) + len(response) - 1)         # row t predicts token t + 1
    kl = sum(F.kl_div(logp[t], logp_ref[t], log_target=True, reduction="sum").item() for t in rows)
    nll = -sum(logp_ref[t, tok].item() for t, tok in zip(rows, response))
    return kl, nll


@pytest.mark.engine
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("arch", ["gpt_neox", "llama"])
def test_full_vocabulary_kl_and_nll(arch, device, request):
    """searcher.response_kl_nll, batched with padding and chunked, against one sequence at a time; on a GPU too
    (tests/gpu_lease.sh), in float32 (the GPU's kernels: a looser bound)."""
    from tasks.tldr import response_kl_nll
    from test_weight_sync import perturbed
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = request.getfixturevalue("tiny_neox" if arch == "gpt_neox" else "tiny_model")
    tok = AutoTokenizer.from_pretrained(path)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    policy = perturbed(path, 1).to(device).eval()
    pairs = [(tok("POST: my boss wants weekends\n\nTL;DR:").input_ids, tok(" boss wants").input_ids + [tok.eos_token_id]),
             (tok("12+34=").input_ids, tok("46 and more words here").input_ids)]  # lengths differ: padding
    kl, nll = response_kl_nll(ref, ref, pairs, 2, device)
    assert list(kl) == pytest.approx([0.0, 0.0], abs=1e-6)  # a model against itself
    rel = 1e-4 if device == "cpu" else 1e-3
    for micro_batch, chunk in ((2, 2**28), (1, 1)):  # one pass, and one sequence a pass, one position a chunk
        kl, nll = response_kl_nll(policy, ref, pairs, micro_batch, device, chunk_bytes=chunk)
        for (prompt, response), k, n in zip(pairs, kl, nll):
            expected_kl, expected_nll = direct_kl_nll(policy, ref, prompt, response)
            assert k > 1e-3 and k == pytest.approx(expected_kl, rel=rel)
            assert n == pytest.approx(expected_nll, rel=rel / 10)


def test_judge_reads_where_transformers_pooling_does(tiny_rm):
    """pooling=True: the last token that is not padding; with pad = EOS (a tokenizer without a pad
    token, as Pythia's) a response ending in EOS is read at the token before, i.e. scores as the
    sequence without its EOS; equal to transformers' own forward with that pad_token_id."""
    from rewards import RewardModel, last_token
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    assert (last_token([5, 6, 2, 2], 2), last_token([5, 6, 7], 2), last_token([2, 2], 2), last_token([5, 2], None)) == (1, 2, 0, 1)
    tok = AutoTokenizer.from_pretrained(tiny_rm)
    eos = tok.eos_token_id
    rm = RewardModel(tiny_rm, "cpu", "float32", tok, non_eos_penalty=False, batch=3)
    rm.pad = eos  # as the authors' load_and_eval.py where the tokenizer has no pad token
    body = [tok("POST: my boss wants weekends\n\nTL;DR: boss wants weekends").input_ids, tok("12+34= 46").input_ids]
    with_eos = [b + [eos] for b in body]
    pooled = rm.score(with_eos + body, pooling=True)
    assert pooled[:2] == pytest.approx(rm.score(body), abs=1e-5)  # read before the EOS
    assert pooled[2:] == pytest.approx(rm.score(body), abs=1e-5)  # no EOS: the last token
    assert rm.score(with_eos) != pytest.approx(pooled[:2], abs=1e-4)  # reading at the EOS differs: a real check
    model = AutoModelForSequenceClassification.from_pretrained(tiny_rm, dtype=torch.float32).eval()
    model.config.pad_token_id = eos
    with torch.no_grad():
        own = [model(input_ids=torch.tensor([s])).logits[0, 0].item() for s in with_eos]
    assert pooled[:2] == pytest.approx(own, abs=1e-5)


def evaluation_rows(tiny_neox, tiny_rm, report):
    """Engine.evaluate on the tiny GPT-NeoX policy (vLLM's Transformers backend) with a GPT-NeoX judge,
    at temperature 0.01: at the initial weights the KL is 0; after other weights are loaded, every row
    equals a direct computation on the same responses (regenerated with the same seed). Runs in a
    spawned process: vLLM's Transformers backend rewrites the GPT-NeoX class of the process it runs in
    (searcher.py), which would break later tests that load GPT-NeoX models in the pytest process."""
    try:
        evaluation_rows_checks(tiny_neox, tiny_rm)
        report.put({"ok": True})
    except BaseException:
        import traceback
        report.put({"error": traceback.format_exc()})


def evaluation_rows_checks(tiny_neox, tiny_rm):
    import numpy as np
    from runtime import weights
    from searcher import Engine
    from test_weight_sync import config, perturbed
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_neox)
    cfg = config(tiny_neox, task="tldr", eval_temperature=0.01, seed=7, max_new_tokens=10, score="win_rate",
                 reward_model_path=tiny_rm, eval_reward_model_path=tiny_rm)
    texts = ["POST: my boss wants weekends\n\nTL;DR:", "POST: the cat ate my homework again\n\nTL;DR:",
             "POST: 12+34 is what\n\nTL;DR:", "POST: moving to a new city soon\n\nTL;DR:"]
    prompts = [tok(t).input_ids for t in texts]
    answers = [" boss wants weekends", " cat ate homework", " it is 46", " moving soon"]
    engine = Engine(cfg, "cpu", 0.1, prompts, answers)
    try:
        scores, _ = engine.evaluate(prompts, answers)
        assert scores["kl_ref_theta_per_token"] == pytest.approx(0.0, abs=1e-6)  # the policy is pi_ref
        with engine.beside():
            policy = perturbed(tiny_neox, 1).eval()
        engine.load(list(weights.gather(policy)), 2)
        scores, _ = engine.evaluate(prompts, answers)
        responses, _ = engine.respond(prompts)  # the same seeded samples (a seed a problem, from its prompt)
        with engine.beside():  # GPT-NeoX beside vLLM's Transformers backend: see searcher.py
            ref = AutoModelForCausalLM.from_pretrained(tiny_neox, dtype=torch.float32).eval()
            judge = AutoModelForSequenceClassification.from_pretrained(tiny_rm, dtype=torch.float32).eval()
    finally:
        engine.close()
    kl, nll = zip(*[direct_kl_nll(policy, ref, p, r) for p, r in zip(prompts, responses)])
    n = np.array([len(r) for r in responses])
    assert scores["kl_ref_theta_per_token"] == pytest.approx(np.mean(np.array(kl) / n), rel=1e-4)
    assert scores["kl_ref_theta_per_token"] > 1e-3
    assert scores["ppl_sft"] == pytest.approx(np.mean(np.exp(np.array(nll) / n)), rel=1e-4)
    lengths = n + np.array([len(p) - 1 for p in prompts])  # the authors' normaliser: the whole sequence
    assert scores["ppl_sft_authors"] == pytest.approx(np.mean(np.exp(np.array(nll) / lengths)), rel=1e-4)
    assert 1 < scores["ppl_sft_authors"] < scores["ppl_sft"]
    # win rate: transformers' own pooling (pad_token_id as the judge's tokenizer has it) of the judge
    eos = tok.eos_token_id
    judge.config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else eos
    with torch.no_grad():
        gold = lambda s: judge(input_ids=torch.tensor([s])).logits[0, 0].item()
        ours = [gold(p + r) for p, r in zip(prompts, responses)]
        theirs = [gold(p + tok(a).input_ids + [eos]) for p, a in zip(prompts, answers)]
    assert scores["win_rate"] == np.mean(np.greater(ours, theirs))


@pytest.mark.engine
def test_tldr_evaluation_rows(tiny_neox, tiny_rm):
    """See evaluation_rows."""
    import multiprocessing
    from conftest import get_report
    ctx = multiprocessing.get_context("spawn")
    report = ctx.Queue()
    p = ctx.Process(target=evaluation_rows, args=(tiny_neox, tiny_rm, report))
    p.start()
    try:
        assert get_report(report, [p], timeout=600) == {"ok": True}
    finally:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
