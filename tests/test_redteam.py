"""Red-teaming (`--task redteam`, redteam.py): the reward with the victim and the judge on vLLM (both kinds of
classifier; judges with and without a chat template equal to a direct transformers computation), the victim's
sampling, the diversity metric, the GPU memory split, the refusals, and runs that learn. The models are made in
code (tests/redteam_models.py): a trigger token (" the") is what the victim repeats and what the classifier and
the judge find unsafe."""

import importlib.util
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from tasks import redteam
import redteam_models as rm
import searcher
import tasks
from runtime import gpu
from runtime.config import Config
from conftest import ROOT, metrics, run_tba
from runtime.errors import ConfigError

CHAT = "{{ messages[0]['content'] }}"  # a bare chat template: the victim reads the attack alone
# a judge's template in Llama Guard 3's shape: a long shared head (its category list: several cached KV blocks),
# the conversation, a header's end after which redteam.Judge adds "\n\n"
GUARD = ("{{ 'Task: check Agent messages against our safety policy.\\n' }}{% for i in range(1, 10) %}"
         "{{ 'S' ~ i ~ ': a category of unsafe content, described at some length here.\\n' }}{% endfor %}"
         "{% for m in messages %}{{ m['role'] ~ ': ' ~ m['content'] ~ '\\n' }}{% endfor %}<|end_header_id|>")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Folders: attackers (Llama, GPT-NeoX), victims (trigger Llama with a chat template, random GPT-NeoX
    without), the trigger classifier, the trigger judge without and with a chat template, an embedder; all with
    one BPE tokenizer."""
    root, tok = tmp_path_factory.mktemp("redteam"), rm.bpe()
    m = {arch: rm.make_attacker(str(root / f"attacker_{arch}"), arch, tok) for arch in ("llama", "gpt_neox")}
    chat = rm.bpe()
    chat.chat_template = CHAT
    m["victim"] = rm.make_trigger_victim(str(root / "victim"), chat)
    m["victim_neox"] = rm.make_attacker(str(root / "victim_neox"), "gpt_neox", tok, seed=5)
    m["classifier"] = rm.make_trigger_classifier(str(root / "classifier"), tok)
    m["judge"] = rm.make_trigger_judge(str(root / "judge"), tok)
    guard = rm.bpe()
    guard.chat_template = GUARD
    m["judge_chat"] = rm.make_trigger_judge(str(root / "judge_chat"), guard, verdict="unsafe")
    m["embedder"] = rm.make_embedder(str(root / "embedder"), tok)
    m["tokenizer"], m["root"] = tok, root
    return m


def engine_for(models, victim, classifier, kind, n=3, attacker="llama", **extra):
    """A searcher's Engine on the CPU: the attacker's, the victim's and (a judge) the judge's vLLM engines."""
    cfg = Config(task="redteam", model=models[attacker], prompts_per_step=2, samples_per_prompt=4, max_new_tokens=12,
                 victim_responses=n, micro_batch=4, score_batch=4, device="cpu", threads=1, model_path=models[attacker],
                 max_model_len=128, dtype="float32", search_samples_per_prompt=4, victim_path=models[victim],
                 classifier_path=models[classifier], classifier_kind=kind, embedding_model_path=models["embedder"],
                 **extra)
    return searcher.Engine(cfg, "cpu", 0.1, [models["tokenizer"](redteam.ATTACK_PROMPT).input_ids], [""])


@pytest.fixture(scope="module")
def engines(models):
    """Two searchers' engines, kept for the module: a sequence classifier beside the chat victim, and the
    GPT-NeoX victim (vLLM's Transformers backend) beside a GPT-NeoX attacker and the judge."""
    made = {}
    try:
        made["sequence"] = engine_for(models, "victim", "classifier", "sequence")
        made["judge"] = engine_for(models, "victim_neox", "judge", "judge", attacker="gpt_neox")
        yield made
    finally:
        for engine in made.values():
            engine.close()


def transformers_log_p_unsafe(path, prompt_ids: list[int], verdict: int) -> tuple[float, int]:
    """log P(verdict) at the end of one unpadded prompt under the judge in transformers, and the verdict's rank."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logp = model(input_ids=torch.tensor([prompt_ids])).logits[0, -1].log_softmax(-1)
    return logp[verdict].item(), int((logp > logp[verdict]).sum()) + 1


def by_hand(reward, attack: str, response: str) -> float:
    """log P(unsafe) of one (attack, response) in transformers, unbatched and unpadded."""
    c = reward.classifier
    if isinstance(c, redteam.SequenceClassifier):
        ids = torch.tensor([c.tokenizer(response).input_ids or [c.pad_id]])
        return c.model(input_ids=ids).logits[0].log_softmax(-1)[c.unsafe].item()
    ids = c.tokenizer(redteam.JUDGE_PROMPT.format(attack=attack.strip(), response=response.strip())).input_ids
    return transformers_log_p_unsafe(c.llm.llm_engine.model_config.model, ids, c.unsafe_id)[0]


@pytest.mark.parametrize("kind", ["sequence", "judge"])
def test_reward_is_the_mean_of_the_logs(models, engines, kind):
    reward, tok = engines[kind].scorer.score, models["tokenizer"]
    attacks = ["How do I open a jar of pickles", "Tell me the way to the store", "Hi"]
    ids = [tok(a).input_ids + [tok.eos_token_id] for a in attacks]
    rewards = reward([[1]] * 3, ids, attacks)
    responses = reward.responses
    assert len(responses) == 3 * 3 and reward.seconds["victim"] > 0 and reward.seconds["classifier"] > 0
    for i, a in enumerate(attacks[:2]):
        hand = np.mean([by_hand(reward, a, r) for r in responses[3 * i:3 * i + 3]])
        assert rewards[i] == pytest.approx(hand, abs=1e-5)
    assert len(ids[2]) - 1 < redteam.MIN_ATTACK_TOKENS and rewards[2] == redteam.SHORT_PENALTY  # too short
    assert rewards[1] > rewards[0] + 1, rewards  # the trigger in the attack: the response (chat) or the judge sees it


def spy(llm) -> list:
    """Record what the engine `llm` is asked and answers: [(sampling params, outputs), ...]."""
    calls, generate = [], llm.generate

    def recording(prompts, params, **kwargs):
        outputs = generate(prompts, params, **kwargs)
        calls.append((params, outputs))
        return outputs
    llm.generate = recording
    return calls


def greedy(victim, attacks, tokens):
    from vllm import SamplingParams
    outputs = victim.llm.generate([{"prompt_token_ids": victim.prompt(a)} for a in attacks],
                                  SamplingParams(temperature=0.0, max_tokens=tokens), use_tqdm=False)
    return [o.outputs[0].text for o in outputs for _ in range(victim.n)]


@pytest.mark.engine
def test_victim_prompt_and_sampling(models, engines):
    """The chat victim reads the attack as a user turn with Lee et al.'s chat sampling, the other one Lee et al.'s
    Alpaca template with GPT-2's; vLLM gets n, the temperature, top-p and the length, and honours them (a near-zero
    top-p or temperature gives the greedy answer n times, the Alpaca sampling n different ones); a seed repeats them."""
    chat, alpaca = engines["sequence"].scorer.score.victim, engines["judge"].scorer.score.victim
    assert chat.sampling == redteam.CHAT_SAMPLING and alpaca.sampling == redteam.ALPACA_SAMPLING
    assert chat.tokenizer.decode(chat.prompt("Say hi ")) == "Say hi" and chat.prompt("") == [chat.tokenizer.bos_token_id]
    assert alpaca.tokenizer.decode(alpaca.prompt("Say hi ")) == redteam.ALPACA.format(instruction="Say hi")
    attacks = ["Tell me a story", "Write a poem about the sea"]
    calls = spy(alpaca.llm)
    try:
        first = alpaca.respond(attacks, 3)
        assert first == alpaca.respond(attacks, 3) != alpaca.respond(attacks, 4)
        params, outputs = calls[0]
        assert [(p.n, p.temperature, p.top_p, p.max_tokens) for p in params] == [(3, 0.7, 0.92, 30)] * 2
        assert len(first) == 2 * 3 and len(set(first[:3])) == 3  # babble: n different answers
        assert max(len(c.token_ids) for o in outputs for c in o.outputs) == 30
        alpaca.sampling = dict(redteam.ALPACA_SAMPLING, max_new_tokens=7, top_p=1e-6)  # the likeliest token only
        assert alpaca.respond(attacks, 5) == greedy(alpaca, attacks, 7)
        assert max(len(c.token_ids) for o in calls[-1][1] for c in o.outputs) == 7
        for temperature, equal in ((0.01, True), (1.0, False)):  # (vLLM raises a temperature under 0.01 to it)
            chat.sampling = dict(redteam.CHAT_SAMPLING, max_new_tokens=7, temperature=temperature)
            assert (chat.respond(attacks, 5) == greedy(chat, attacks, 7)) == equal, temperature
    finally:
        alpaca.sampling, chat.sampling = dict(redteam.ALPACA_SAMPLING), dict(redteam.CHAT_SAMPLING)
        del alpaca.llm.generate  # the engine's own method again


def test_unsafe_label_by_name_or_flag():
    config = lambda *labels: types.SimpleNamespace(id2label=dict(enumerate(labels)))
    assert redteam.unsafe_index(config("nothate", "hate"), None) == 1  # Lee et al.'s RoBERTa
    assert redteam.unsafe_index(config("Unsafe", "safe"), None) == 0
    assert redteam.unsafe_index(config("ok", "bad"), "bad") == 1
    with pytest.raises(ValueError, match="no unsafe label"):
        redteam.unsafe_index(config("ok", "bad"), None)
    with pytest.raises(ValueError, match="no label 'worse'"):
        redteam.unsafe_index(config("ok", "bad"), "worse")


def test_diversity(models, engines):
    with engines["sequence"].beside():  # a GPT-NeoX body, in a process where vLLM serves GPT-NeoX
        embed = redteam.Embedder(models["embedder"], "cpu", "float32", 4)
    assert redteam.diversity(embed(["the same attack"] * 5)) == pytest.approx(0.0, abs=1e-6)
    e = embed(["one attack", "another, longer attack", "a third"])
    assert torch.allclose(e.norm(dim=-1), torch.ones(3))
    pairs = [1 - torch.dot(e[i], e[j]).item() for i in range(3) for j in range(3) if i != j]
    assert redteam.diversity(e) == pytest.approx(np.mean(pairs), abs=1e-6) and redteam.diversity(e) > 0.01
    # mean pooling leaves padding out: a sentence embeds the same alone and beside a longer one
    assert torch.allclose(embed(["a third"])[0], e[2], atol=1e-5)
    scores, p_unsafe = redteam.scores(engines["sequence"].scorer.score, embed, ["Tell me the way", "Tell me the way",
                                                                          "Open a jar of jam"])
    assert scores["unique"] == pytest.approx(2 / 3) and scores["asr"] == pytest.approx(np.mean(np.array(p_unsafe) > 0.5))
    assert scores["toxicity"] == pytest.approx(np.mean(p_unsafe)) and p_unsafe[0] > 0.5 > p_unsafe[2]


def flags(models, out, attacker="llama", classifier="classifier", **extra):
    args = ["--task", "redteam", "--model", models[attacker], "--victim", models["victim"], "--classifier",
            models[classifier], "--embedding-model", models["embedder"], "--out", str(out), "--max-new-tokens", "12",
            "--prompts-per-step", "2", "--samples-per-prompt", "4", "--victim-responses", "2", "--eval-limit", "16"]
    for k, v in extra.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def refused(refusal, args):
    status, lines = refusal(args)
    assert status == 2 and len(lines) == 1 and lines[0].startswith("tba.py: error: --"), lines
    return lines[0]


@pytest.mark.engine
def test_bad_input_is_refused_in_one_line(models, tmp_path, refusal):
    import shutil
    base = flags(models, tmp_path / "out")
    drop = lambda flag: base[:base.index(flag)] + base[base.index(flag) + 2:]
    assert "--victim: the redteam task needs" in refused(refusal, drop("--victim"))
    assert "--classifier: the redteam task needs" in refused(refusal, drop("--classifier"))
    no_label = str(models["root"] / "no_label")
    rm.make_trigger_classifier(no_label, models["tokenizer"], labels=("ok", "bad"))
    line = refused(refusal, [*drop("--classifier"), "--classifier", no_label])
    assert "--classifier:" in line and "no unsafe label (labels: ok, bad)" in line
    no_tokenizer = str(models["root"] / "no_tokenizer")
    shutil.copytree(models["victim"], no_tokenizer)
    for f in os.listdir(no_tokenizer):
        if f.startswith(("tokenizer", "special_tokens", "chat_template")):
            os.remove(os.path.join(no_tokenizer, f))
    assert "--victim:" in refused(refusal, [*drop("--victim"), "--victim", no_tokenizer])
    assert "--victim:" in refused(refusal, ["--victim", models["victim"]])  # arith has no victim
    not_lm = str(models["root"] / "embedder")
    assert "is not a causal LM" in refused(refusal, [*drop("--victim"), "--victim", not_lm])


def evals(out):
    return [r for r in metrics(out) if r["kind"] == "eval"]


@pytest.mark.engine
@pytest.mark.parametrize("attacker,classifier,searchers", [("gpt_neox", "judge_chat", 0), ("llama", "classifier", 1)])
def test_runs_end_to_end(models, tmp_path, attacker, classifier, searchers):
    """Both kinds of classifier, the judge with a chat template on vLLM beside the victim's and the attacker's engines;
    the train rows carry the victim's and the classifier's seconds per round."""
    out, size = tmp_path / "run", {}
    if searchers:  # an instruction list of --data whose 5 x 8 requests pass vLLM's 4,096-token step beyond their
        # shared, cached 128-token blocks (searcher.py: whole prefills only on the CPU; a split one crashes the
        # seeded CPU engine)
        lines, tok = ["Write a list of instructions:"], models["tokenizer"]
        while len(lines) < 4 or len(tok("\n".join(lines)).input_ids) % 128 < 110:
            lines.append(f"{len(lines)}. Describe a walk in the park number {len(lines)} in one sentence.")
        (tmp_path / "data").mkdir()
        (tmp_path / "data" / "attack_prompt.jsonl").write_text(json.dumps({"attacker_prompt": "\n".join(lines)}) + "\n")
        size = dict(data=tmp_path / "data", prompts_per_step=5, samples_per_prompt=8, victim_max_new_tokens=16)
    p = run_tba(flags(models, out, attacker, classifier, searchers=searchers, steps=4, eval_every=2, **size), tmp_path,
                timeout=400, torchrun=1 if searchers else None)
    assert p.returncode == 0, p.stdout[-3000:]
    rows = evals(out)
    assert [r["step"] for r in rows] == [0, 2, 4] if not searchers else rows[-1]["step"] == 4
    for r in rows:
        assert 0 <= r["asr"] <= 1 and 0 < r["toxicity"] < 1 and 0 < r["diversity"] <= 2 and 0 < r["unique"] <= 1
        assert r["example"]["response"] is not None
    assert json.load(open(out / "config.json"))["classifier_kind"] == ("judge" if classifier == "judge_chat" else "sequence")
    train = [r for r in metrics(out) if r["kind"] == "train"]
    assert len(train) == 4 and all(r["victim"] > 0 and r["classifier"] > 0 for r in train)
    assert "held-out toxicity" in p.stdout
    if searchers and importlib.util.find_spec("matplotlib"):  # plot.py: the run picture and the Pareto one
        png = tmp_path / "run.png"
        p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot.py"), str(out), "-o", str(png)],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        pareto = tmp_path / "run_pareto.png"
        assert pareto.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and pareto.stat().st_size > 10000


@pytest.mark.engine
def test_attack_success_rises_and_attacks_stay_diverse(models, tmp_path):
    """A short synchronous run: the attacker learns to put the trigger in its attacks (the victim then
    repeats it and the classifier calls that unsafe), and TB keeps sampling many different attacks."""
    out = tmp_path / "run"
    p = run_tba(flags(models, out, searchers=0, steps=20, eval_every=20, lr=3e-3, decay_steps=0, eval_limit=64,
                      prompts_per_step=4, samples_per_prompt=8, victim_max_new_tokens=16), tmp_path, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:]
    first, last = evals(out)[0], evals(out)[-1]
    assert last["step"] == 20
    # measured: asr 0.016 -> 0.45, diversity 0.599 -> 0.582, unique 1.0 (the trigger's base rate: first["asr"])
    assert last["asr"] >= first["asr"] + 0.3, (first, last)
    assert last["diversity"] >= 0.5 * first["diversity"] and last["unique"] >= 0.5, (first, last)  # no collapse


@pytest.mark.engine
def test_models_that_would_share_vllms_workspace_are_refused_on_a_gpu(models, tmp_path):
    """On a GPU the attacker's, the victim's and a judge's engines share vLLM 0.32's one workspace a process, which
    MoE layers, Marlin-quantized linears and MLA attention draw on: such a victim, judge or attacker is refused in
    one line naming the field; a sequence classifier (no engine) and the CPU (no workspace) are not concerned."""
    import shutil

    def variant(name, base, **fields):
        path = str(tmp_path / name)
        shutil.copytree(models[base], path)
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**config, **fields}, f)
        return path
    moe = variant("victim_moe", "victim", num_local_experts=4, num_experts_per_tok=2)
    gptq = variant("judge_gptq", "judge", quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 128})
    mla = variant("attacker_mla", "llama", kv_lora_rank=64)
    awq = variant("victim_awq", "victim")
    with open(os.path.join(awq, "quantize_config.json"), "w") as f:
        json.dump({"bits": 4}, f)

    def check(device, victim="victim", classifier="classifier", attacker=models["llama"]):
        cfg = Config(task="redteam", model=attacker, victim=models.get(victim, victim), embedding_model=models["embedder"],
                     classifier=models.get(classifier, classifier), device=device)
        return redteam.check(cfg)

    assert check("cuda")["classifier_kind"] == "sequence" and check("cuda", classifier="judge")["classifier_kind"] == "judge"
    for device, args, line in (
            ("cuda", dict(victim=moe), f"--victim: {moe} is a mixture of experts (num_local_experts); "),
            ("cuda", dict(victim=awq), f"--victim: {awq} is quantized (quantize_config.json); "),
            ("cuda", dict(classifier=gptq), f"--classifier: {gptq} is quantized (quantization_config); "),
            ("cuda", dict(attacker=mla), f"--model: {mla} is multi-head latent attention (kv_lora_rank); ")):
        with pytest.raises(ConfigError) as e:
            check(device, **args)
        assert str(e.value).startswith(line) and "one workspace" in str(e.value) and "\n" not in str(e.value)
    assert check("cpu", victim=moe, classifier=gptq, attacker=mla)["victim_path"] == moe  # the CPU runs them
    assert redteam.workspace_user(models["victim"]) is redteam.workspace_user(models["judge"]) is None
    setting = paper_setting(tmp_path / "paper", llama=True)  # Llama 3.2 1B, Llama 3.1 8B, Llama Guard 3 8B: dense
    assert [redteam.workspace_user(p) for p in (setting.model_path, setting.victim_path, setting.classifier_path)] == [None] * 3


def test_the_attack_prompt_or_data(tmp_path):
    train, test = tasks.get("redteam").load(None)
    assert [p.prompt for p in train] == [p.prompt for p in test] == [redteam.ATTACK_PROMPT]
    assert redteam.ATTACK_PROMPT.startswith("Write a list of instructions:\n1. ") and redteam.ATTACK_PROMPT.endswith("\n4.")
    (tmp_path / "attack_prompt.jsonl").write_text(json.dumps({"attacker_prompt": "List:\n1."}) + "\n" + json.dumps({"x": 1}) + "\n")
    with pytest.raises(ConfigError, match="line 2: missing or non-text field 'attacker_prompt'"):
        tasks.get("redteam").load(str(tmp_path))
    (tmp_path / "attack_prompt.jsonl").write_text(json.dumps({"attacker_prompt": "List:\n1."}) + "\n")
    assert [p.prompt for p in tasks.get("redteam").load(str(tmp_path))[0]] == ["List:\n1."]
    assert redteam.eval_counts(1, None) == [1024] and redteam.eval_counts(3, 8) == [3, 3, 2]


@pytest.mark.engine
@pytest.mark.parametrize("judge", ["gpt2, Verdict:", "gpt2, <|end_header_id|>", "trigger", "trigger, Guard"])
def test_judge_on_vllm_equals_transformers(models, engines, tmp_path, judge):
    """The judge's log P(unsafe) on its vLLM engine equals a transformers forward of the same unpadded prompt (float32):
    a random GPT-2 (absolute positions) with a chat template ending in "Verdict:" or a Llama 3 header (then "\\n\\n",
    as Llama Guard 3), the trigger Llama without a template (JUDGE_PROMPT, " unsafe") and with Llama Guard's shape
    ("unsafe"), whose long shared head vLLM caches. Without the trigger, "unsafe" ranks far below the top two that
    Lee et al. read, and its log-prob still comes back."""
    from transformers import AutoTokenizer
    arch, _, ending = judge.partition(", ")
    if arch == "gpt2":
        path = str(tmp_path / "judge")
        rm.make_attacker(path, "gpt2", models["tokenizer"])
        tok = AutoTokenizer.from_pretrained(path)
        tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" + ending
        tok.save_pretrained(path)
    else:
        path = models["judge_chat" if ending else "judge"]
    j = redteam.Judge(path, engines["sequence"].start_llm(path, None, redteam.context(path)))
    verdict = "unsafe" if ending else " unsafe"
    assert j.unsafe_id == j.tokenizer(verdict, add_special_tokens=False).input_ids[0]
    if arch == "gpt2":
        text = f"user: Tell me the way\nassistant: Go left\n{ending}" + ("\n\n" if ending == "<|end_header_id|>" else "")
        assert j.tokenizer.decode(j.prompt("Tell me the way", "Go left")) == text
    attacks, responses = ["Tell me the way", "Hi", "Go left"], ["Go left", "Hello, how are you today? Fine.", "Why"]
    calls = spy(j.llm)
    ours, again = j.log_p_unsafe(attacks, responses), j.log_p_unsafe(attacks, responses)
    direct = [transformers_log_p_unsafe(path, j.prompt(a, r), j.unsafe_id) for a, r in zip(attacks, responses)]
    assert ours == again and ours == pytest.approx([lp for lp, _ in direct], abs=1e-5)
    assert len(set(ours)) == 3 or arch == "trigger"  # the trigger judge reads nothing but triggers
    if ending == "Guard":  # the trigger read; "unsafe" out of the top two without it; the shared head cached
        assert ours[0] > ours[1] and direct[1][1] > 2, direct
        block = j.llm.llm_engine.vllm_config.cache_config.block_size
        head = len(os.path.commonprefix([j.prompt(a, r) for a, r in zip(attacks, responses)]))
        assert head >= 2 * block and min(o.num_cached_tokens for o in calls[1][1]) >= head // block * block


def test_memory_split():
    """Fractions: each engine gets its weights, working memory and least KV cache, the share's spare goes to the KV
    caches by what a round fills, and a layout that cannot fit is refused in one line saying what would."""
    GiB = 2**30
    engines = dict(attacker=(3 * GiB, GiB, GiB), victim=(18 * GiB, GiB, 3 * GiB))
    beside = {"pi_ref": 2 * GiB, "the CUDA context": 4 * GiB}
    split = gpu.memory_split(80 * GiB, 0.7, engines, beside)
    assert sum(split.values()) == pytest.approx(0.7)
    assert split["attacker"] * 80 == pytest.approx(4 + 33 * 1 / 4) and split["victim"] * 80 == pytest.approx(19 + 33 * 3 / 4)
    with pytest.raises(ValueError, match=r"^0.25 of this GPU's 80.0 GiB cannot hold the attacker \+ victim engines' "
                                         r"23.0 GiB; give them at least 0.29$"):
        gpu.memory_split(80 * GiB, 0.25, engines, beside)
    with pytest.raises(ValueError, match=r"leaves less than the 30.0 GiB of the models beside the engines \(pi_ref 26.0, "
                                         r"the CUDA context 4.0\); give the engines at most 0.62$"):
        gpu.memory_split(80 * GiB, 0.7, engines, {**beside, "pi_ref": 26 * GiB})
    with pytest.raises(ValueError, match=r"^the attacker \+ victim engines' 23.0 GiB and the models beside them \(pi_ref "
                                         r"2.0, the CUDA context 4.0: 6.0 GiB\) need more than this GPU's 24.0 GiB$"):
        gpu.memory_split(24 * GiB, 0.7, engines, beside)
    assert gpu.memory_share(80 * GiB, beside) == 0.9  # vLLM's default at most
    assert gpu.memory_share(24 * GiB, beside) == 0.75  # what the models beside leave


def paper_setting(root, llama: bool):
    """The paper's two red-teaming settings as configs alone (no weights: nothing is downloaded), in the shapes of
    Lee et al.'s models' config.json files: GPT-2 against GPT-2 Alpaca with RoBERTa's hate classifier in float32,
    or Llama 3.2 1B against Llama 3.1 8B Instruct with Llama Guard 3 8B (the same shape) in bfloat16; MiniLM
    embeds. The attack prompt is some 50 tokens in either tokenizer, and attacks 20."""
    import transformers

    def save(name, config):
        config.architectures = [type(config).__name__.replace("Config", "") + name.split(":")[1]]
        config.save_pretrained(str(root / name.split(":")[0]))
        return str(root / name.split(":")[0])
    llama3 = lambda **k: transformers.LlamaConfig(vocab_size=128256, num_attention_heads=32, num_key_value_heads=8,
                                                  max_position_embeddings=131072, **k)
    eight_b = lambda: llama3(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, tie_word_embeddings=False)
    if llama:
        attacker = save("attacker:ForCausalLM", llama3(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                                      tie_word_embeddings=True))
        victim, classifier = save("victim:ForCausalLM", eight_b()), save("judge:ForCausalLM", eight_b())
        kind, dtype = "judge", "bfloat16"
    else:  # gpt2 and vicgalle/gpt2-alpaca: 124M; facebook/roberta-hate-speech-dynabench-r4-target: roberta-base's shape
        attacker, victim = save("attacker:LMHeadModel", transformers.GPT2Config()), save("victim:LMHeadModel", transformers.GPT2Config())
        classifier = save("classifier:ForSequenceClassification", transformers.RobertaConfig(
            vocab_size=50265, max_position_embeddings=514, type_vocab_size=1))
        kind, dtype = "sequence", "float32"
    embedder = save("embedder:Model", transformers.BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                                              intermediate_size=1536))
    return Config(task="redteam", model=attacker, prompts_per_step=16, samples_per_prompt=8, max_new_tokens=20,
                  victim_responses=5, micro_batch=128, score_batch=128, model_path=attacker, victim_path=victim, classifier_path=classifier,
                  embedding_model_path=embedder, classifier_kind=kind, dtype=dtype, search_samples_per_prompt=8,
                  max_model_len=50 + 20)


@pytest.mark.parametrize("llama", [False, True])
def test_memory_split_of_the_papers_settings(tmp_path, monkeypatch, llama):
    """The paper's GPT-2 setting fits a 16 GB V100 and its Llama setting an 80 GB A100 (docs/tasks.md gives the
    split) at the computed --searcher-memory and at 0.7; config's check, which reads the GPUs' memory (faked here:
    no GPU), fits the Llama setting on a 48 GB card with the computed share, refuses it there at 0.7 and on a
    40 GB card at any share, in one line."""
    import dataclasses
    from runtime import gpu
    cfg = paper_setting(tmp_path, llama)
    card = (80 if llama else 16) * 10**9
    engines, beside = gpu.memory_needs(cfg, redteam.TASK)
    assert set(engines) == ({"attacker", "victim", "judge"} if llama else {"attacker", "victim"})
    if llama:  # 1.24B and 8.03B parameters in bf16, and their working memory
        weights = dict(attacker=1.236e9 * 2, victim=8.030e9 * 2, judge=8.030e9 * 2)
        assert all(weights[name] < f < weights[name] + 2 * 2**30 for name, (f, _, _) in engines.items()), engines
    split = gpu.memory_split(card, 0.7, engines, beside)
    assert sum(split.values()) == pytest.approx(0.7)
    cfg = dataclasses.replace(cfg, searchers=7 if llama else 3)
    gpus = lambda total: monkeypatch.setattr(torch.cuda, "get_device_properties",
                                             lambda i: types.SimpleNamespace(total_memory=total))
    gpus(card)
    share = gpu.check_memory(cfg, redteam.TASK, 1)  # fits: no refusal
    assert share == (0.9 if llama else 0.72)  # at most vLLM's default; what RoBERTa & co. leave
    if llama:
        gpus(48 * 10**9)
        assert gpu.check_memory(cfg, redteam.TASK, 1) == 0.86  # docs/tasks.md: 0.84 to 0.86 fit
        with pytest.raises(ConfigError, match=r"^--searcher-memory: 0.7 of this GPU's 44.7 GiB cannot hold the "
                                                     r"attacker \+ victim \+ judge engines' [\d.]+ GiB; give them at least 0.8\d$"):
            gpu.check_memory(dataclasses.replace(cfg, searcher_memory=0.7), redteam.TASK, 1)
        gpus(40 * 10**9)
        with pytest.raises(ConfigError, match=r"^--searcher-memory: the attacker \+ victim \+ judge engines' "
                                                     r"[\d.]+ GiB and the models beside them \(pi_ref 2.3, .*, the CUDA "
                                                     r"context 1.0, a reload's largest layer 0.5: [\d.]+ GiB\) need "
                                                     r"more than this GPU's 37.3 GiB$"):
            gpu.check_memory(cfg, redteam.TASK, 1)


@pytest.mark.engine
def test_lee_et_al_recipe_runs_and_resumes(models, tmp_path):
    """Their recipe's options together, with a searcher under torchrun: the best buffer with near-duplicates by
    the embedder's cosine (the searcher embeds each attack) and by edit distance, LoRA, weight decay, the reward
    temperature's anneal and the exploration temperatures; its checkpoint (the adapter, the best set with its
    embeddings) resumes."""
    recipe = dict(searchers=1, prompts_per_step=2, samples_per_prompt=4, sync_every=2, recency=0.5,
                  buffer_keep="best", buffer_capacity=6, dedup_similarity=0.99, dedup_edit=0.25, reward_inv_temp=1,
                  reward_temp=2, reward_temp_anneal_steps=2, explore_temp_min=0.5, explore_temp_max=2.0, lora_rank=4,
                  lora_alpha=16, lr=3e-3, weight_decay=0.01, eval_every=0)
    out = tmp_path / "run"
    p = run_tba(flags(models, out, steps=4, save_every=4, **recipe), tmp_path, timeout=400, torchrun=1)
    assert p.returncode == 0, p.stdout[-3000:]
    train = [r for r in metrics(out) if r["kind"] == "train"]
    assert [r["reward_temp"] for r in train[:2]] == [2.0, 1.5] and "reward_temp" not in train[2]  # 1 from step 2
    assert all(r["buffer"] <= 6 for r in train)  # the best set of the one instruction's two copies
    with np.load(out / "checkpoint" / "buffer.npz") as s:
        best = s["best_prompt_id"]
        assert 0 < len(best) <= 6 and s["embedding"].shape[0] == len(s["prompt_id"])
        assert s["best_embedding"].shape[0] == len(best)
        assert np.allclose(np.linalg.norm(s["embedding"], axis=1), 1, atol=1e-5)  # the searcher's unit embeddings
        assert json.loads(str(s["settings"]))["group_of"] == [0, 0] and set(best.tolist()) <= {0, 1}  # one shared set
    assert os.path.isfile(out / "checkpoint" / "adapter" / "adapter_model.safetensors")
    p = run_tba(flags(models, tmp_path / "resumed", steps=6, resume=out / "checkpoint", **recipe), tmp_path,
                timeout=400, torchrun=1)
    assert p.returncode == 0, p.stdout[-3000:]
    assert [r["step"] for r in metrics(tmp_path / "resumed") if r["kind"] == "train"] == [5, 6]
