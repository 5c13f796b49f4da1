"""The paper's settings: run_gsm8k.sh and run_tldr.sh (dry runs) and the schedules they rely on."""

import dataclasses
import math
import os
import shlex
import subprocess

import pytest

from runtime import checks
import loss
from runtime import policy
from runtime.config import Config
from conftest import ROOT


def dry_run(*args, script="run_gsm8k.sh", **environ):
    p = subprocess.run(["bash", os.path.join(ROOT, script), "--dry-run", *args], capture_output=True,
                       text=True, timeout=30, env=dict(os.environ, **environ))
    assert p.returncode == 0, p.stderr
    command = shlex.split(p.stdout.strip().splitlines()[-1])
    return command, checks.parse(Config, command[command.index("tba.py") + 1:])


@pytest.mark.engine
def test_run_gsm8k_dry_run_has_the_papers_settings(tmp_path):
    command, cfg = dry_run()
    assert command[:3] == ["torchrun", "--standalone", "--nproc_per_node=1"]
    assert (cfg.model, cfg.task, cfg.searchers, cfg.steps) == ("rho-math-1b", "gsm8k", 3, 700)
    assert (cfg.prompts_per_step, cfg.samples_per_prompt, cfg.search_samples_per_prompt) == (7, 20, 24)
    assert (cfg.sync_every, cfg.recency, cfg.reward_inv_temp) == (2, 0.95, 0.0)
    assert (cfg.beta, cfg.beta_final, cfg.beta_anneal_steps, cfg.beta_stop_step) == (0.014, 0.004, 500, 500)
    assert (cfg.lr, cfg.warmup_steps, cfg.stable_steps, cfg.decay_steps, cfg.lr_decay) == (1e-5, 50, 350, 600, "cosine")
    assert (cfg.temperature, cfg.max_new_tokens, cfg.dtype) == (0.7, 512, "bfloat16")
    assert (cfg.grad_clip, cfg.trainer_dtype) == (0.0, "bfloat16")  # the authors: no clip, bf16 weights and AdamW
    assert cfg.initial_buffer == 500  # the authors' initial_buffer_samples (src/tba_trainer_gsm8k.py:74)
    # their barrier's bound: k B K / (N x round) = 2 x 7 x 20 / (3 x 3 x 24), for the split given
    assert (cfg.round_prompts, cfg.max_reuse) == (3, 1.3)
    assert dry_run(SEARCHERS="7")[1].max_reuse == 0.556


@pytest.mark.engine
def test_run_tldr_dry_run_has_the_authors_settings():
    command, cfg = dry_run(script="scripts/run_tldr.sh")
    assert command[:3] == ["torchrun", "--standalone", "--nproc_per_node=1"]
    assert (cfg.model, cfg.reward_model, cfg.task) == ("mnoukhov/pythia410m-sft-tldr", "mnoukhov/pythia410m-rm-tldr6.9b", "tldr")
    assert (cfg.searchers, cfg.steps, cfg.prompts_per_step, cfg.samples_per_prompt) == (3, 256, 8, 20)
    assert cfg.steps * cfg.prompts_per_step * cfg.samples_per_prompt == 40960  # the authors' episodes
    assert (cfg.search_samples_per_prompt, cfg.sync_every, cfg.recency, cfg.reward_inv_temp) == (20, 10, 0.5, 1.0)
    assert (cfg.beta, cfg.beta_final, cfg.lr, cfg.temperature, cfg.max_new_tokens) == (1.0, 0.05, 3e-6, 0.7, 128)
    assert (cfg.initial_buffer, cfg.non_eos_penalty, cfg.grad_clip) == (10000, True, 0.0)
    assert (cfg.beta_anneal_steps, cfg.beta_stop_step, cfg.lr_decay, cfg.decay_steps, cfg.warmup_steps) == (128, 32, "linear", 256, 0)
    assert (cfg.eval_temperature, cfg.eval_limit, cfg.eval_every) == (0.01, None, 64)  # the whole validation split
    assert cfg.eval_reward_model == "cleanrl/EleutherAI_pythia-6.9b-deduped__reward__tldr"  # the gold judge
    assert cfg.trainer_dtype == "float32"  # theirs: fp16 mixed precision, fp32 master weights
    assert (cfg.round_prompts, cfg.max_reuse) == (2, 13.3)  # their barrier's bound: 10 x 8 x 20 / (3 x 2 x 20)
    command, cfg = dry_run(script="scripts/run_tldr.sh", SETTING="table1", GOLD="/gold")
    assert (cfg.steps, cfg.searchers, cfg.beta_stop_step, cfg.beta_anneal_steps, cfg.decay_steps) == (625, 2, 78, 312, 625)
    assert cfg.steps * cfg.prompts_per_step * cfg.samples_per_prompt == 100000 and cfg.eval_reward_model == "/gold"
    assert cfg.max_reuse == 20  # 2 searchers: 1,600 / (2 x 2 x 20)
    command, cfg = dry_run("--seed", "3", script="scripts/run_tldr.sh", SIZE="2.8b")
    assert (cfg.model, cfg.seed, cfg.searcher_memory) == ("mnoukhov/pythia2.8b-sft-tldr", 3, None)  # computed
    assert (cfg.round_prompts, cfg.max_reuse) == (1, 26.7)  # 10 x 8 x 20 / (3 x 1 x 20)
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "run_tldr.sh"), "--dry-run"], capture_output=True, text=True,
                       timeout=30, env=dict(os.environ, SIZE="3b"))
    assert p.returncode == 2 and p.stderr.strip() == "run_tldr.sh: SIZE must be 410m, 1b or 2.8b, got 3b"
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "run_tldr.sh"), "--dry-run"], capture_output=True, text=True,
                       timeout=30, env=dict(os.environ, SETTING="table2"))
    assert p.returncode == 2 and p.stderr.strip() == "run_tldr.sh: SETTING must be table3 or table1, got table2"


@pytest.mark.engine
def test_run_gsm8k_passes_arguments_through_and_splits_gpus():
    command, cfg = dry_run("--out", "/some/run", "--data", "/some/gsm8k", TRAINERS="2", SEARCHERS="6")
    assert "--nproc_per_node=2" in command
    assert (cfg.out, cfg.data, cfg.searchers) == ("/some/run", "/some/gsm8k", 6)


def test_schedules():
    cfg = Config(steps=700, beta=0.014, beta_final=0.004, beta_anneal_steps=500, lr=1e-5,
                     warmup_steps=50, stable_steps=350, decay_steps=600)
    assert loss.beta_at(cfg, 0) == pytest.approx(0.014)
    assert loss.beta_at(cfg, 250) == pytest.approx(0.009)
    assert loss.beta_at(cfg, 500) == loss.beta_at(cfg, 699) == pytest.approx(0.004)
    assert policy.lr_at(cfg, 0) == pytest.approx(1e-5 / 50)  # linear warmup
    assert policy.lr_at(cfg, 49) == policy.lr_at(cfg, 50) == policy.lr_at(cfg, 399) == pytest.approx(1e-5)
    assert policy.lr_at(cfg, 700) == pytest.approx(1e-5 * 0.5 * (1 + math.cos(math.pi * 300 / 600)))  # cosine decay
    assert policy.lr_at(cfg, 1000) == pytest.approx(0.0, abs=1e-20)
    constant = Config(steps=10, lr=3e-4, beta=0.05, beta_final=0.05, decay_steps=0)
    assert {policy.lr_at(constant, s) for s in range(10)} == {3e-4}
    assert {loss.beta_at(constant, s) for s in range(10)} == {constant.beta}


@pytest.mark.engine
def test_run_redteam_dry_run_has_the_papers_settings():
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "run_redteam.sh"), "--dry-run"], capture_output=True, text=True,
                       timeout=30, env={k: v for k, v in os.environ.items() if k != "ATTACKER"})
    assert p.returncode == 2 and "tools/sft_attacker.py" in p.stderr  # the SFT attacker is required
    command, cfg = dry_run(script="scripts/run_redteam.sh", ATTACKER="save/gpt2-sft")
    assert command[:3] == ["torchrun", "--standalone", "--nproc_per_node=1"]
    assert (cfg.model, cfg.task, cfg.victim) == ("save/gpt2-sft", "redteam", "vicgalle/gpt2-alpaca")
    assert cfg.classifier == "facebook/roberta-hate-speech-dynabench-r4-target"
    assert cfg.embedding_model == "sentence-transformers/all-MiniLM-L6-v2"
    assert (cfg.steps, cfg.sync_every, cfg.beta, cfg.lr) == (5000, 10, 0.05, 1e-4)  # paper: k, beta, steps; Lee et al.: lr
    assert cfg.prompts_per_step * cfg.samples_per_prompt == 128  # attacks a step
    assert (cfg.victim_responses, cfg.max_new_tokens, cfg.temperature) == (5, 20, 1.0)
    assert (cfg.eval_limit, cfg.searchers) == (1024, 3)
    # Lee et al.'s recipe: their buffer, LoRA, AdamW, schedule, reward temperature and exploration
    assert (cfg.buffer_keep, cfg.buffer_capacity, cfg.dedup_edit, cfg.reward_inv_temp) == ("best", 1000, 0.25, 1.0)
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.weight_decay) == (32, 16, 0.01)
    assert (cfg.reward_temp, cfg.reward_temp_anneal_steps, cfg.gamma_final) == (2.0, 500, 1.0)
    assert (cfg.explore_temp_min, cfg.explore_temp_max) == (0.5, 2.0)
    assert policy.lr_at(cfg, 4999) == pytest.approx(0.877e-4, rel=1e-3) and policy.lr_at(cfg, 0) == pytest.approx(1e-6)
    command, cfg = dry_run("--seed", "7", script="scripts/run_redteam.sh", ATTACKER="/some/attacker", SEARCHERS="2")
    assert (cfg.model, cfg.seed, cfg.searchers) == ("/some/attacker", 7, 2)


@pytest.mark.engine
def test_run_redteam_llama_dry_run_has_the_papers_settings():
    """The paper's Llama run: Llama 3.2 1B against Llama 3.1 8B Instruct, Llama Guard 3 8B judging, bf16, on 1 + 7
    GPUs, with Lee et al.'s Llama settings; models by hub id or local folder."""
    command, cfg = dry_run(script="scripts/run_redteam_llama.sh")
    assert command[:3] == ["torchrun", "--standalone", "--nproc_per_node=1"] and cfg.searchers == 7
    assert (cfg.model, cfg.victim, cfg.classifier) == ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.1-8B-Instruct",
                                                       "meta-llama/Llama-Guard-3-8B")
    assert (cfg.task, cfg.embedding_model, cfg.dtype) == ("redteam", "sentence-transformers/all-MiniLM-L6-v2", "bfloat16")
    assert (cfg.victim_responses, cfg.victim_max_new_tokens, cfg.buffer_capacity) == (5, 64, 5000)  # configs/llama.json
    assert (cfg.steps, cfg.sync_every, cfg.beta, cfg.lr, cfg.max_new_tokens) == (5000, 10, 0.05, 1e-4, 20)
    assert cfg.prompts_per_step * cfg.samples_per_prompt == 128 and cfg.searcher_memory is None  # computed: docs/tasks.md
    # Lee et al.'s recipe, as run_redteam.sh, with their Llama buffer and gamma
    assert (cfg.buffer_keep, cfg.dedup_similarity, cfg.gamma_final, cfg.gamma_anneal_steps) == ("best", 0.4, 1.2, 2000)
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.weight_decay, cfg.reward_temp) == (32, 16, 0.01, 2)
    command, cfg = dry_run("--seed", "7", script="scripts/run_redteam_llama.sh", ATTACKER="/a", VICTIM="/v", JUDGE="/j",
                           EMBEDDER="/e", TRAINERS="2", SEARCHERS="6")
    assert (cfg.model, cfg.victim, cfg.classifier, cfg.embedding_model) == ("/a", "/v", "/j", "/e")
    assert (cfg.seed, cfg.searchers, command[2]) == (7, 6, "--nproc_per_node=2")


@pytest.mark.engine
@pytest.mark.parametrize("script,environ", [("run_gsm8k.sh", {}), ("scripts/run_tldr.sh", {}),
                                            ("scripts/run_tldr.sh", {"SETTING": "table1"}),
                                            ("scripts/run_redteam.sh", {"ATTACKER": "save/gpt2-sft"}),
                                            ("scripts/run_redteam_llama.sh", {})])
def test_run_scripts_pass_the_checks_of_unused_flags(script, environ):
    """Every schedule of the paper's runs has both its length and its end, and LoRA's alpha its rank (the checks
    that need the models themselves run on the GPU node)."""
    checks.check_unused(dry_run(script=script, **environ)[1])


# run_math.sh: issue 37's settings (the paper's Sec. 6), the same whatever LOSS, LAG, IS, NORM and EVAL choose
MATH_COMMON = dict(model="Qwen/Qwen2.5-7B", task="math", searchers=4, steps=420, prompts_per_step=32,
                   samples_per_prompt=16, search_samples_per_prompt=16, lr=1e-6, warmup_steps=0, decay_steps=0,
                   weight_decay=0.01, adam_betas="0.9,0.99", grad_clip=1.0, temperature=1.0, context=4096,
                   max_new_tokens=4096, micro_batch=1, activation_checkpointing=True, dtype="bfloat16",
                   trainer_dtype="float32", eval_every=5, eval_limit=None, is_cap=8.0, max_reuse=None,
                   initial_buffer=0, sync_every=1, save_every=100)
MATH_TB = dict(loss="tbprime", ref_reset_every=50, beta=0.005, beta_final=None, beta_anneal_steps=0)
MATH_DRGRPO = dict(loss="drgrpo", ref_reset_every=0)


@pytest.mark.engine
@pytest.mark.parametrize("environ,expected", [
    ({}, dict(MATH_TB, lag=2, importance_weights=True, eval_temperature=1.0, norm="sequence")),  # the authors'
    ({"NORM": "response"}, dict(MATH_TB, lag=2, norm="response")),
    ({"LAG": "10", "IS": "off"}, dict(MATH_TB, lag=10, importance_weights=False, eval_temperature=1.0)),
    ({"EVAL": "greedy", "IS": "on"}, dict(MATH_TB, lag=2, importance_weights=True, eval_temperature=0.0)),
    ({"LOSS": "drgrpo"}, dict(MATH_DRGRPO, lag=2, norm="sequence", eval_temperature=1.0)),
    ({"LOSS": "drgrpo", "NORM": "budget", "LAG": "10", "EVAL": "greedy"},
     dict(MATH_DRGRPO, lag=10, norm="budget", eval_temperature=0.0)),
])
def test_run_math_dry_run_has_the_issues_settings(environ, expected):
    command, cfg = dry_run(script="run_math.sh", **environ)
    assert command[:3] == ["torchrun", "--standalone", "--nproc_per_node=4"]  # 4 trainer + 4 searcher GPUs
    for name, value in {**MATH_COMMON, **expected}.items():
        assert getattr(cfg, name) == value, (name, getattr(cfg, name), value)
    assert {policy.lr_at(cfg, s) for s in range(cfg.steps)} == {1e-6}  # constant: no warmup, no decay
    # each searcher's round is B / 4 = 8 prompts (the default), so 4 rounds make each step's batch: --lag accepts it
    assert cfg.round_prompts is None and checks.check_lag(dataclasses.replace(cfg, round_prompts=8), 4) is None


@pytest.mark.engine
@pytest.mark.parametrize("environ,message", [
    ({"LOSS": "grpo"}, "LOSS must be tb or drgrpo, got grpo"),
    ({"LAG": "3"}, "LAG must be 2 or 10 (the paper's lags), got 3"),
    ({"IS": "maybe"}, "IS must be on or off, got maybe"),
    ({"LOSS": "drgrpo", "IS": "off"}, "IS is TBA′'s (LOSS=tb), got IS=off with LOSS=drgrpo"),
    ({"NORM": "sum"}, "NORM must be response, sequence or budget, got sum"),
    ({"TRAINERS": "3"}, "TRAINERS must divide B = 32, got 3"),
    ({"EVAL": "best"}, "EVAL must be sampled or greedy, got best"),
])
def test_run_math_refuses_unknown_choices(environ, message):
    """(TRAINERS and SEARCHERS that are no numbers are refused for every script by scripts/launch.sh: below.)"""
    p = subprocess.run(["bash", os.path.join(ROOT, "run_math.sh"), "--dry-run"], capture_output=True, text=True,
                       timeout=30, env=dict(os.environ, **environ))
    assert p.returncode == 2 and p.stderr.strip() == f"run_math.sh: {message}" and not p.stdout


@pytest.mark.engine
def test_run_math_passes_arguments_through_and_splits_gpus():
    command, cfg = dry_run("--data", "/some/math", "--resume", "/some/ckpt", script="run_math.sh", TRAINERS="2",
                           SEARCHERS="6")
    assert (command[2], cfg.data, cfg.resume, cfg.searchers) == ("--nproc_per_node=2", "/some/math", "/some/ckpt", 6)


@pytest.mark.engine
@pytest.mark.parametrize("script", ["run_gsm8k.sh", "run_math.sh", "scripts/run_tldr.sh"])
@pytest.mark.parametrize("environ", [{"TRAINERS": "abc"}, {"SEARCHERS": "0"}, {"TRAINERS": "1.5"}])
def test_a_gpu_split_that_is_no_number_is_refused_at_the_dry_run(script, environ):
    p = subprocess.run(["bash", os.path.join(ROOT, script), "--dry-run"], capture_output=True, text=True, timeout=30,
                       env=dict(os.environ, **environ))
    name, value = next(iter(environ.items()))
    assert p.returncode == 2 and not p.stdout, p.stdout
    assert p.stderr.strip() == f"{os.path.basename(script)}: {name} must be a number of GPUs, at least 1, got '{value}'"


def refused(script, *args, cwd=None, **environ):
    """A dry run of `script` with `args` that the launcher refuses: its one line (status 2, no command printed)."""
    p = subprocess.run(["bash", script, "--dry-run", *args], capture_output=True, text=True, timeout=30, cwd=cwd,
                       env=dict(os.environ, **environ))
    assert p.returncode == 2 and not p.stdout, (p.returncode, p.stdout)
    return p.stderr.strip()


@pytest.mark.parametrize("script,args,environ,instead", [
    ("run_math.sh", ["--lag", "5"], {}, "use LAG instead (LAG=5 bash {path})"),  # LAG=5 is refused: --lag 5 too
    ("run_math.sh", ["--data", "/d", "--lag=10"], {}, "use LAG instead (LAG=10 bash {path})"),
    ("run_math.sh", ["--searchers", "2"], {}, "use SEARCHERS instead (SEARCHERS=2 bash {path})"),
    ("run_math.sh", ["--steps", "5"], {}, "edit its settings instead of passing an extra argument"),
    ("run_math.sh", ["--no-importance-weights"], {}, "edit its settings instead of passing an extra argument"),
    ("run_gsm8k.sh", ["--prompts-per-step=8"], {}, "use PROMPTS instead (PROMPTS=8 bash {path})"),
    ("scripts/run_tldr.sh", ["--model", "m"], {}, "use SIZE instead (see the script's header)"),
    ("scripts/run_tldr.sh", ["--no-activation-checkpointing"], {"SIZE": "2.8b"},
     "edit its settings instead of passing an extra argument"),
    ("scripts/run_redteam.sh", ["--model", "/b"], {"ATTACKER": "/a"}, "use ATTACKER instead (ATTACKER=/b bash {path})"),
    ("scripts/run_redteam_llama.sh", ["--victim", "/v"], {}, "use VICTIM instead (VICTIM=/v bash {path})"),
])
def test_an_extra_argument_the_script_sets_is_refused(script, args, environ, instead):
    """tba.py takes the last of a flag given twice: an extra argument the script sets itself would run past the
    script's own checks (run_math.sh: LAG=5 refused, --lag 5 run at lag 5). One rule of scripts/launch.sh refuses
    it for every script, in one line naming the flag, the script's value and what to change instead."""
    path = os.path.join(ROOT, script)
    flag = [a for a in args if a.startswith("--")][-1].split("=")[0]  # the refused one: the last flag given
    line = refused(path, *args, **environ)
    own = "--" + flag.removeprefix("--").removeprefix("no-")
    assert line.startswith(f"{os.path.basename(script)}: {flag}: the script sets {own} itself ({own}"), line
    assert line.endswith(instead.format(path=path) + ("" if instead.startswith("edit") else ", not an extra argument"))


def test_what_the_script_does_not_set_passes_through():
    """Flags the script leaves alone reach tba.py; the variable is found run from the script's own folder too (the
    scripts cd before they launch)."""
    command, cfg = dry_run("--data", "/d", "--out", "/o", "--resume", "/r", "--seed=4", script="run_math.sh")
    assert (cfg.data, cfg.out, cfg.resume, cfg.seed, cfg.lag) == ("/d", "/o", "/r", 4, 2)
    line = refused("run_tldr.sh", "--searchers", "2", cwd=os.path.join(ROOT, "scripts"))
    assert line == ("run_tldr.sh: --searchers: the script sets --searchers itself (--searchers 3); use SEARCHERS "
                    "instead (SEARCHERS=2 bash run_tldr.sh), not an extra argument")
