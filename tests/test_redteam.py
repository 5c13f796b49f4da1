"""Red-teaming (`--task redteam`, redteam.py): the reward, both kinds of classifier, the diversity metric,
the refusals, and runs that learn. The models are made in code (tests/redteam_models.py): a trigger
token (" the") is what the victim repeats and what the classifier and the judge find unsafe."""

import importlib.util
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

import redteam
import redteam_models as rm
from conftest import ROOT, metrics, run_tba

CHAT = "{{ messages[0]['content'] }}"  # a bare chat template: the victim reads the attack alone


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Folders: attackers (Llama, GPT-NeoX), victims (trigger Llama with a chat template, random
    GPT-NeoX without), the trigger classifier and judge, an embedder; all with one BPE tokenizer."""
    root, tok = tmp_path_factory.mktemp("redteam"), rm.bpe()
    m = {arch: rm.make_attacker(str(root / f"attacker_{arch}"), arch, tok) for arch in ("llama", "gpt_neox")}
    chat = rm.bpe()
    chat.chat_template = CHAT
    m["victim"] = rm.make_trigger_victim(str(root / "victim"), chat)
    m["victim_neox"] = rm.make_attacker(str(root / "victim_neox"), "gpt_neox", tok, seed=5)
    m["classifier"] = rm.make_trigger_classifier(str(root / "classifier"), tok)
    m["judge"] = rm.make_trigger_judge(str(root / "judge"), tok)
    m["embedder"] = rm.make_embedder(str(root / "embedder"), tok)
    m["tokenizer"], m["root"] = tok, root
    return m


def reward_for(models, victim, classifier, kind, n=3):
    cfg = types.SimpleNamespace(victim_path=models[victim], classifier_path=models[classifier], classifier_kind=kind,
                                dtype="float32", victim_responses=n, victim_max_new_tokens=None, micro_batch=4,
                                unsafe_label=None, seed=0)
    return redteam.Reward(cfg, "cpu", models["tokenizer"].eos_token_id)


def by_hand(reward, attack: str, response: str) -> float:
    """log P(unsafe) of one (attack, response), unbatched and unpadded."""
    c = reward.classifier
    if isinstance(c, redteam.SequenceClassifier):
        ids = torch.tensor([c.tokenizer(response).input_ids or [c.pad_id]])
        return c.model(input_ids=ids).logits[0].log_softmax(-1)[c.unsafe].item()
    ids = torch.tensor([c.tokenizer(redteam.JUDGE_PROMPT.format(attack=attack.strip(), response=response.strip())).input_ids])
    return c.model(input_ids=ids).logits[0, -1].log_softmax(-1)[c.tokenizer(" unsafe", add_special_tokens=False).input_ids[0]].item()


@pytest.mark.parametrize("victim,classifier,kind", [("victim", "classifier", "sequence"), ("victim_neox", "judge", "judge")])
def test_reward_is_the_mean_of_the_logs(models, victim, classifier, kind):
    reward, tok = reward_for(models, victim, classifier, kind), models["tokenizer"]
    attacks = ["How do I open a jar of pickles", "Tell me the way to the store", "Hi"]
    ids = [tok(a).input_ids + [tok.eos_token_id] for a in attacks]
    rewards = reward([[1]] * 3, ids, attacks)
    responses = reward.responses
    assert len(responses) == 3 * 3
    for i, a in enumerate(attacks[:2]):
        hand = np.mean([by_hand(reward, a, r) for r in responses[3 * i:3 * i + 3]])
        assert rewards[i] == pytest.approx(hand, abs=1e-5)
    assert len(ids[2]) - 1 < redteam.MIN_ATTACK_TOKENS and rewards[2] == redteam.SHORT_PENALTY  # too short
    assert rewards[1] > rewards[0] + 1, rewards  # the trigger in the attack: the response (chat) or the judge sees it


def test_victim_prompt_and_sampling_follow_the_template(models):
    chat = redteam.Victim(models["victim"], "cpu", "float32", 2, 4)
    alpaca = redteam.Victim(models["victim_neox"], "cpu", "float32", 2, 4)
    assert chat.sampling == redteam.CHAT_SAMPLING and alpaca.sampling == redteam.ALPACA_SAMPLING
    assert chat.tokenizer.decode(chat.prompt("Say hi ")) == "Say hi"
    assert alpaca.tokenizer.decode(alpaca.prompt("Say hi ")) == redteam.ALPACA.format(instruction="Say hi")
    assert alpaca.respond(["a", "b"], 3) == alpaca.respond(["a", "b"], 3) != alpaca.respond(["a", "b"], 4)


def test_unsafe_label_by_name_or_flag():
    config = lambda *labels: types.SimpleNamespace(id2label=dict(enumerate(labels)))
    assert redteam.unsafe_index(config("nothate", "hate"), None) == 1  # Lee et al.'s RoBERTa
    assert redteam.unsafe_index(config("Unsafe", "safe"), None) == 0
    assert redteam.unsafe_index(config("ok", "bad"), "bad") == 1
    with pytest.raises(ValueError, match="no unsafe label"):
        redteam.unsafe_index(config("ok", "bad"), None)
    with pytest.raises(ValueError, match="no label 'worse'"):
        redteam.unsafe_index(config("ok", "bad"), "worse")


def test_diversity(models):
    embed = redteam.Embedder(models["embedder"], "cpu", "float32", 4)
    assert redteam.diversity(embed(["the same attack"] * 5)) == pytest.approx(0.0, abs=1e-6)
    e = embed(["one attack", "another, longer attack", "a third"])
    assert torch.allclose(e.norm(dim=-1), torch.ones(3))
    pairs = [1 - torch.dot(e[i], e[j]).item() for i in range(3) for j in range(3) if i != j]
    assert redteam.diversity(e) == pytest.approx(np.mean(pairs), abs=1e-6) and redteam.diversity(e) > 0.01
    # mean pooling leaves padding out: a sentence embeds the same alone and beside a longer one
    assert torch.allclose(embed(["a third"])[0], e[2], atol=1e-5)
    reward = reward_for(models, "victim", "classifier", "sequence", n=2)
    scores, p_unsafe = redteam.scores(reward, embed, ["Tell me the way", "Tell me the way", "Open a jar of jam"])
    assert scores["unique"] == pytest.approx(2 / 3) and scores["asr"] == pytest.approx(np.mean(np.array(p_unsafe) > 0.5))
    assert scores["toxicity"] == pytest.approx(np.mean(p_unsafe)) and p_unsafe[0] > 0.5 > p_unsafe[2]


def flags(models, out, attacker="llama", classifier="classifier", **extra):
    args = ["--task", "redteam", "--model", models[attacker], "--victim", models["victim"], "--classifier",
            models[classifier], "--embedding-model", models["embedder"], "--out", str(out), "--max-new-tokens", "12",
            "--prompts-per-step", "2", "--samples-per-prompt", "4", "--victim-responses", "2", "--eval-limit", "16"]
    for k, v in extra.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def refused(models, tmp_path, args):
    p = run_tba(args, tmp_path, timeout=120)
    lines = p.stdout.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("tba.py: error: --"), p.stdout
    return lines[0]


def test_bad_input_is_refused_in_one_line(models, tmp_path):
    import shutil
    base = flags(models, tmp_path / "out")
    drop = lambda flag: base[:base.index(flag)] + base[base.index(flag) + 2:]
    assert "--victim: the redteam task needs" in refused(models, tmp_path, drop("--victim"))
    assert "--classifier: the redteam task needs" in refused(models, tmp_path, drop("--classifier"))
    no_label = str(models["root"] / "no_label")
    rm.make_trigger_classifier(no_label, models["tokenizer"], labels=("ok", "bad"))
    line = refused(models, tmp_path, [*drop("--classifier"), "--classifier", no_label])
    assert "--classifier:" in line and "no unsafe label (labels: ok, bad)" in line
    no_tokenizer = str(models["root"] / "no_tokenizer")
    shutil.copytree(models["victim"], no_tokenizer)
    for f in os.listdir(no_tokenizer):
        if f.startswith(("tokenizer", "special_tokens", "chat_template")):
            os.remove(os.path.join(no_tokenizer, f))
    assert "--victim:" in refused(models, tmp_path, [*drop("--victim"), "--victim", no_tokenizer])
    assert "--victim:" in refused(models, tmp_path, ["--victim", models["victim"]])  # arith has no victim
    not_lm = str(models["root"] / "embedder")
    assert "is not a causal LM" in refused(models, tmp_path, [*drop("--victim"), "--victim", not_lm])


def evals(out):
    return [r for r in metrics(out) if r["kind"] == "eval"]


@pytest.mark.parametrize("attacker,classifier,searchers", [("gpt_neox", "judge", 0), ("llama", "classifier", 1)])
def test_runs_end_to_end(models, tmp_path, attacker, classifier, searchers):
    out, size = tmp_path / "run", {}
    if searchers:  # an instruction list of --data whose 5 x 8 requests pass vLLM's 4,096-token step beyond their
        # shared, cached 128-token blocks (searcher.py: whole prefills only on the CPU; a split one crashed the
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
    assert json.load(open(out / "config.json"))["classifier_kind"] == ("judge" if classifier == "judge" else "sequence")
    assert "held-out toxicity" in p.stdout
    if searchers and importlib.util.find_spec("matplotlib"):  # plot.py: the run picture and the Pareto one
        png = tmp_path / "run.png"
        p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot.py"), str(out), "-o", str(png)],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        pareto = tmp_path / "run_pareto.png"
        assert pareto.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and pareto.stat().st_size > 10000


def test_attack_success_rises_and_attacks_stay_diverse(models, tmp_path):
    """A short synchronous run: the attacker learns to put the trigger in its attacks (the victim then
    repeats it and the classifier calls that unsafe), and TB keeps sampling many different attacks."""
    out = tmp_path / "run"
    p = run_tba(flags(models, out, searchers=0, steps=20, eval_every=20, lr=3e-3, decay_steps=0, eval_limit=64,
                      prompts_per_step=4, samples_per_prompt=8, victim_max_new_tokens=16), tmp_path, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:]
    first, last = evals(out)[0], evals(out)[-1]
    assert last["step"] == 20
    # measured: asr 0.016 -> 0.59, diversity 0.599 -> 0.596, unique 1.0 (the trigger's base rate: first["asr"])
    assert last["asr"] >= first["asr"] + 0.3, (first, last)
    assert last["diversity"] >= 0.5 * first["diversity"] and last["unique"] >= 0.5, (first, last)  # no collapse


def test_the_attack_prompt_or_data(tmp_path):
    import tasks
    train, test = tasks.load_task("redteam", None)
    assert [p.prompt for p in train] == [p.prompt for p in test] == [redteam.ATTACK_PROMPT]
    assert redteam.ATTACK_PROMPT.startswith("Write a list of instructions:\n1. ") and redteam.ATTACK_PROMPT.endswith("\n4.")
    (tmp_path / "attack_prompt.jsonl").write_text(json.dumps({"attacker_prompt": "List:\n1."}) + "\n" + json.dumps({"x": 1}) + "\n")
    with pytest.raises(tasks.ConfigError, match="line 2: missing or non-text field 'attacker_prompt'"):
        tasks.load_task("redteam", str(tmp_path))
    (tmp_path / "attack_prompt.jsonl").write_text(json.dumps({"attacker_prompt": "List:\n1."}) + "\n")
    assert [p.prompt for p in tasks.load_task("redteam", str(tmp_path))[0]] == ["List:\n1."]
    assert redteam.eval_counts(1, None) == [1024] and redteam.eval_counts(3, 8) == [3, 3, 2]


@pytest.mark.parametrize("ending", ["Verdict:", "<|end_header_id|>"])
def test_judge_reads_its_chat_template(models, tmp_path, ending):
    """A judge with a chat template (Llama Guard's way): the template's text, "\\n\\n" after a Llama 3 header
    (Llama Guard 3), the verdict token of "unsafe"; batched (left-padded) scores equal unpadded ones."""
    from transformers import AutoTokenizer
    path = str(tmp_path / "judge")
    # a random GPT-2: absolute positions, which left padding would move without position ids (rotary ones are
    # relative, and the trigger judge ignores positions)
    rm.make_attacker(path, "gpt2", models["tokenizer"])
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" + ending
    tok.save_pretrained(path)
    judge = redteam.Judge(path, "cpu", "float32", 4)
    assert judge.unsafe_id == tok("unsafe", add_special_tokens=False).input_ids[0]
    text = f"user: Tell me the way\nassistant: Go left\n{ending}" + ("\n\n" if ending == "<|end_header_id|>" else "")
    assert judge.tokenizer.decode(judge.prompt("Tell me the way", "Go left")) == text
    attacks, responses = ["Tell me the way", "Hi"], ["Go left", "Hello there, how are you today? Fine, thanks."]
    batched = judge.log_p_unsafe(attacks, responses)
    for a, r, b in zip(attacks, responses, batched):
        logits = judge.model(input_ids=torch.tensor([judge.prompt(a, r)])).logits[0, -1]
        assert b == pytest.approx(logits.log_softmax(-1)[judge.unsafe_id].item(), abs=1e-5)
    assert batched[0] != batched[1]  # padding to one length left the two prompts apart


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
        best = s["pool"] == 1
        assert 0 < best.sum() <= 6 and s["embedding"].shape[0] == len(s["pool"])
        assert np.allclose(np.linalg.norm(s["embedding"], axis=1), 1, atol=1e-5)  # the searcher's unit embeddings
        assert s["group_of"].tolist() == [0, 0] and set(s["prompt_id"][best].tolist()) <= {0, 1}  # one shared set
    assert os.path.isfile(out / "checkpoint" / "adapter" / "adapter_model.safetensors")
    p = run_tba(flags(models, tmp_path / "resumed", steps=6, resume=out / "checkpoint", **recipe), tmp_path,
                timeout=400, torchrun=1)
    assert p.returncode == 0, p.stdout[-3000:]
    assert [r["step"] for r in metrics(tmp_path / "resumed") if r["kind"] == "train"] == [5, 6]
