"""Bad input is refused before anything is spawned: one line naming the flag, exit status 2."""

import json
import os
import subprocess
import sys

import pytest

import tasks
from runtime import checks
import loss
import tba
from runtime import policy
from runtime.config import Config
from conftest import DATA, ROOT, env
from runtime.errors import ConfigError
from runtime.hub import resolve_model


def refuse(args, tmp_path, monkeypatch, capfd, match):
    """tba.main(args) refused: one line on stderr, status 2, nothing written. Captured at the file descriptors (capfd),
    as a command line's: with capsys, sys.stderr has no file descriptor, torch's @record warns that it cannot enable
    the fault handler, and without pytest's warnings plugin (-p no:warnings) that warning lands on stderr."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TBA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as e:
        tba.main(args)
    err = capfd.readouterr().err.strip()
    assert e.value.code == 2
    assert "\n" not in err and err.startswith("tba.py: error: ") and match in err, err
    assert not (tmp_path / "runs").exists()  # nothing was started or written


@pytest.mark.engine
@pytest.mark.parametrize("args,match", [
    (["--recency", "1.5"], "--recency"),
    (["--recency", "-0.1"], "--recency"),
    (["--samples-per-prompt", "1"], "--samples-per-prompt"),
    (["--sync-every", "0"], "--sync-every"),
    (["--task", "chess"], "--task"),
    (["--search-samples-per-prompt", "4"], "--search-samples-per-prompt: must be at least K = 8, got 4"),
    (["--search-samples-per-prompt", "0"], "--search-samples-per-prompt: must be at least K = 8, got 0"),  # 0 is not "same as K"
    (["--prompts-per-step", "0"], "--prompts-per-step"),
    (["--beta", "0"], "--beta"),
    (["--temperature", "0"], "--temperature"),
    (["--max-new-tokens", "1020"], "--max-new-tokens"),  # beyond the test model's 1024-token context
    (["--resume", "/nonexistent/ckpt"], "--resume"),
    (["--prompts-per-step", "100000"], "but the task has 7700 training problems"),  # at once, not after a wait
    (["--initial-buffer", "770001"], "--initial-buffer"),  # more than 100 per prompt x 7,700 prompts
    (["--loss", "ppo"], "--loss: unknown loss 'ppo'"),
    (["--clip", "0"], "--clip"),
    (["--lag", "-1"], "--lag"),
    (["--ref-reset-every", "-5"], "--ref-reset-every"),
    (["--dtype", "bfloat16"], "--dtype"),  # on the CPU
    (["--dtype", "int8"], "--dtype"),
    (["--log-every", "0"], "--log-every"),
    (["--eval-limit", "0"], "--eval-limit"),
    (["--out", "/proc/x"], "--out: cannot write to /proc/x"),
    (["--max-reuse", "-1"], "--max-reuse: must be 0 (no cap) or more"),
    (["--searchers", "0", "--max-reuse", "1"], "--max-reuse: acts only in the streaming trainer's replay"),
    (["--keep-full", "--lag", "1"], "--keep-full: acts only in streaming with searchers"),
    (["--keep-full", "--searchers", "0"], "--keep-full: acts only in streaming with searchers"),
    (["--round-prompts", "0"], "--round-prompts: must be at least 1"),
    (["--searchers", "0", "--round-prompts", "4"], "--round-prompts: sizes a searcher's round"),
    # Lee et al.'s red-teaming recipe
    (["--buffer-keep", "oldest"], "--buffer-keep: unknown 'oldest'"),
    (["--dedup-edit", "0.25"], "--dedup-edit: merges near-duplicates in the best buffer"),
    (["--buffer-keep", "best", "--dedup-edit", "1.5"], "--dedup-edit: must be in [0, 1]"),
    (["--buffer-keep", "best", "--dedup-similarity", "0.4"], "--dedup-similarity: compares --embedding-model"),
    (["--lora-rank", "-1"], "--lora-rank: must be 0"),
    (["--lora-rank", "4", "--lora-alpha", "0"], "--lora-alpha: must be positive"),
    (["--lora-rank", "129"], "--lora-rank: 129 is above the width of peft's targets (q_proj, v_proj) of "),  # 128 wide
    # flags that would change nothing, or leave another unused
    (["--lora-alpha", "32"], "--lora-alpha: scales a LoRA adapter: pass --lora-rank too"),
    (["--beta-anneal-steps", "100"], "--beta-anneal-steps: anneals beta from --beta to --beta-final, which is --beta"),
    (["--beta-final", "0.05", "--beta-anneal-steps", "100"], "--beta-anneal-steps: anneals beta"),  # = --beta
    (["--beta-stop-step", "10"], "--beta-stop-step: sets beta to --beta-final, which is --beta (0.05) here"),
    (["--beta-final", "0.01"], "--beta-final: without --beta-anneal-steps or --beta-stop-step beta would be 0.01 "
                               "from step 0 and --beta 0.05 unused"),
    (["--reward-temp-anneal-steps", "10"], "--reward-temp-anneal-steps: anneals T_R from --reward-temp to 1, and "
                                           "--reward-temp is 1"),
    (["--gamma-anneal-steps", "10"], "--gamma-anneal-steps: anneals gamma from 1 to --gamma-final, and --gamma-final is 1"),
    (["--weight-decay", "-0.01"], "--weight-decay"),
    (["--reward-temp", "0"], "--reward-temp: must be positive"),
    (["--reward-temp", "2", "--loss", "rloo"], "--reward-temp: acts only in --loss tb;"),
    (["--gamma-final", "-1"], "--gamma-final"),
    (["--explore-temp-min", "0.5"], "--explore-temp-min: the exploration temperatures need"),
    (["--explore-temp-min", "2", "--explore-temp-max", "0.5"], "--explore-temp-min"),
    # issue 67 item 15: lines that named another fault (a lost trainer rank, --loss) or came after 53 lines of usage
    (["--timeout", "1e10"], "--timeout: must be in (0, 1e6] s, got 10000000000.0"),
    (["--beta", "1e-320"], "--beta: must be at least 1e-15 (r / beta squared overflows)"),
    (["--ste", "5"], "tba.py: error: unrecognized arguments: --ste 5 (--help lists the flags)"),
])
def test_bad_flags(args, match, tiny_model, tmp_path, monkeypatch, capfd):
    refuse(["--model", tiny_model, *args], tmp_path, monkeypatch, capfd, match)


def test_help_says_each_default_once():
    """A field's help that names its default itself gets no "(default: ...)" appended (checks.parser): each flag's
    help says "default" at most once. Read from the parser's own help strings, not --help's wrapped lines."""
    helps = {a.option_strings[0]: a.help for a in checks.parser(Config)._actions if a.option_strings[0] != "-h"}
    assert len(helps) > 60 and all(helps.values())
    assert {flag: h for flag, h in helps.items() if h.count("default") > 1} == {}
    assert helps["--steps"].endswith("(default: 200)") and helps["--max-reuse"].count("default") == 1


@pytest.mark.engine
def test_bad_models(tmp_path, monkeypatch, capfd):
    refuse(["--model", str(tmp_path / "missing")], tmp_path, monkeypatch, capfd, "--model")
    refuse(["--model", "./missing"], tmp_path, monkeypatch, capfd, "does not exist")
    (tmp_path / "empty").mkdir()
    refuse(["--model", str(tmp_path / "empty")], tmp_path, monkeypatch, capfd, "no config.json")
    refuse(["--model", "nobody/no-such-model-xyz"], tmp_path, monkeypatch, capfd, "Hugging Face hub")
    refuse(["--model", "rho-math-1b"], tmp_path, monkeypatch, capfd, "'realtreetune/rho-1b-sft-GSM8K'")  # the alias


@pytest.mark.engine
def test_a_file_is_not_a_model_folder(tmp_path, monkeypatch, capfd):
    (tmp_path / "notes.txt").write_text("not a model")
    refuse(["--model", str(tmp_path / "notes.txt")], tmp_path, monkeypatch, capfd,
           f"--model: {tmp_path / 'notes.txt'} is a file, not a model folder")
    monkeypatch.chdir(tmp_path)
    os.makedirs("some")
    (tmp_path / "some" / "file.txt").write_text("x")  # relative, and shaped like a hub id: still the file
    with pytest.raises(ConfigError, match="^--model: some/file.txt is a file, not a model folder"):
        resolve_model("some/file.txt")


@pytest.mark.engine
def test_model_without_weights(tiny_model, tmp_path, monkeypatch, capfd):
    """A config and a tokenizer but no weights: one line before anything starts (every process started, then
    two tracebacks); the same check as a checkpoint's model/."""
    import shutil
    folder = tmp_path / "no-weights"
    shutil.copytree(tiny_model, folder)
    os.remove(folder / "model.safetensors")
    refuse(["--model", str(folder)], tmp_path, monkeypatch, capfd,
           f"--model: {folder} holds no weights (none of model.safetensors, model.safetensors.index.json, "
           f"pytorch_model.bin, pytorch_model.bin.index.json)")


@pytest.mark.engine
def test_an_unnamespaced_hub_id_resolves_from_the_cache(tmp_path):
    """`gpt2` is a hub id (the hub takes ids without a namespace): found in the local Hugging Face cache, offline,
    laid out as the hub lays it out (models--gpt2/snapshots/HASH/..., refs/main); `distilgpt2`, not cached, is a
    hub id that could not be fetched; `./gpt2` cannot be a hub id, and does not exist."""
    import models
    cache, commit = tmp_path / "hub", "0123456789abcdef0123456789abcdef01234567"
    snapshot = cache / "models--gpt2" / "snapshots" / commit
    models.make_model(str(snapshot), hidden=16, layers=1, heads=2)
    (cache / "models--gpt2" / "refs").mkdir()
    (cache / "models--gpt2" / "refs" / "main").write_text(commit)
    code = ("import sys; from runtime.hub import resolve_model; from runtime.errors import ConfigError\n"
            "for name in sys.argv[1:]:\n"
            "    try: print(resolve_model(name))\n"
            "    except ConfigError as e: print(e)")
    p = subprocess.run([sys.executable, "-c", code, "gpt2", "distilgpt2", "./gpt2"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1",
                                                        HF_HUB_CACHE=str(cache), HF_HOME=str(tmp_path / "home")))
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [
        str(snapshot),
        "--model: 'distilgpt2' is not a local folder and could not be fetched from the Hugging Face hub "
        "(LocalEntryNotFoundError)",
        "--model: './gpt2' does not exist (not 'tiny', an alias, a folder or a hub id)"], p.stdout


@pytest.mark.engine
def test_model_without_tokenizer(tiny_model, tmp_path, monkeypatch, capfd):
    """config.json and weights only: one line naming --model and what is missing (transformers' own
    error is about sentencepiece and tiktoken, with exit 1)."""
    import shutil
    folder = tmp_path / "weights-only"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(tiny_model, name), folder / name)
    refuse(["--model", str(folder)], tmp_path, monkeypatch, capfd, "has no tokenizer")


@pytest.mark.engine
def test_unwritable_out_folder(tiny_model, tmp_path, monkeypatch, capfd):
    (tmp_path / "file").write_text("not a folder")
    refuse(["--model", tiny_model, "--out", str(tmp_path / "file" / "run")], tmp_path, monkeypatch, capfd,
           "--out: cannot write to")
    assert (tmp_path / "file").read_text() == "not a folder"


@pytest.mark.engine
@pytest.mark.parametrize("nodes,world,local,args,match", [
    ("2", "3", "1", [], "--nproc-per-node: every node must run the same number of trainer ranks; this node runs 1"),
    ("2", "3", "2", [], "this node runs 2, but the 2 nodes run 3 in all"),
    ("2", "2", "1", ["--searchers", "0"], "--searchers: 0 (the trainer searching itself) runs in one process on one"),
])
def test_bad_multi_node_launches_are_refused(nodes, world, local, args, match, tiny_model, tmp_path, monkeypatch,
                                             capfd):
    """torchrun --nnodes sets GROUP_WORLD_SIZE (nodes), WORLD_SIZE (all trainer ranks) and
    LOCAL_WORLD_SIZE (this node's): uneven nodes and the synchronous baseline are refused at once."""
    monkeypatch.setenv("GROUP_WORLD_SIZE", nodes)
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    refuse(["--model", tiny_model, *args], tmp_path, monkeypatch, capfd, match)


def test_a_node_needs_gpus_for_its_own_ranks_and_searchers(tiny_model, monkeypatch):
    """Over several nodes the GPU split is per node: this node's trainer ranks plus its searchers."""
    monkeypatch.setattr("torch.cuda.device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = Config(model=tiny_model, searchers=3, prompts_per_step=4)
    with pytest.raises(ConfigError, match="--searchers: 3 searcher.* 2 trainer rank.* on this node need 5 GPUs on it, 4 visible"):
        checks.check(cfg, world=4)  # 4 ranks in all over two nodes; 2 + 3 on this one


@pytest.mark.engine
def test_tokenizer_without_eos(tiny_model, tmp_path, monkeypatch, capfd):
    import shutil
    folder = tmp_path / "noeos"
    shutil.copytree(tiny_model, folder)
    with open(folder / "tokenizer_config.json") as f:
        config = json.load(f)
    config["eos_token"] = None
    with open(folder / "tokenizer_config.json", "w") as f:
        json.dump(config, f)
    refuse(["--model", str(folder)], tmp_path, monkeypatch, capfd, "no EOS token")


def test_more_searchers_than_gpus(tiny_model, monkeypatch):
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    cfg = Config(model=tiny_model, searchers=2)
    with pytest.raises(ConfigError, match="--searchers: 2 searcher"):
        checks.check(cfg, world=1)


def test_synchronous_mode_needs_one_trainer_process(tiny_model):
    with pytest.raises(ConfigError, match="--searchers"):
        checks.check(Config(model=tiny_model, searchers=0, prompts_per_step=4), world=2)


def test_bad_data_files(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    good = open(os.path.join(DATA, "train.jsonl")).read().splitlines()[:3]
    (d / "test.jsonl").write_text("\n".join(good) + "\n")
    (d / "train.jsonl").write_text("\n".join(good[:2] + ["{not json"]) + "\n")
    with pytest.raises(ConfigError, match=r"train\.jsonl line 3: not valid JSON"):
        tasks.get("gsm8k").load(str(d))
    (d / "train.jsonl").write_text(good[0] + "\n" + json.dumps({"question": "q?"}) + "\n")
    with pytest.raises(ConfigError, match=r"line 2: missing or non-text field 'answer'"):
        tasks.get("gsm8k").load(str(d))
    (d / "train.jsonl").write_text(json.dumps({"question": "q?", "answer": "no marker"}) + "\n")
    with pytest.raises(ConfigError, match=r"line 1: .*####"):
        tasks.get("gsm8k").load(str(d))
    (d / "train.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="holds no problems"):
        tasks.get("gsm8k").load(str(d))
    with pytest.raises(ConfigError, match="--data"):
        tasks.get("gsm8k").load(str(tmp_path / "nowhere"))


def test_data_that_is_not_utf8_is_refused(tmp_path):
    """A Latin-1 file (or any bytes that are not UTF-8): one line naming the file and the first bad byte, not a
    UnicodeDecodeError traceback."""
    d = tmp_path / "data"
    d.mkdir()
    good = open(os.path.join(DATA, "train.jsonl")).read().splitlines()[:2]
    (d / "test.jsonl").write_text("\n".join(good) + "\n")
    (d / "train.jsonl").write_bytes((good[0] + "\n").encode() + json.dumps({"question": "caf\u00e9?", "answer": "#### 1"},
                                                                          ensure_ascii=False).encode("latin-1"))
    at = len(good[0]) + 1 + len('{"question": "caf')
    with pytest.raises(ConfigError, match=rf"^--data: {d / 'train.jsonl'} is not UTF-8 text \(byte {at}: b'\\xe9'\)$"):
        tasks.get("gsm8k").load(str(d))


def test_gsm8k_without_data_names_the_flag(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="--data"):
        tasks.get("gsm8k").load(None)


def test_gsm8k_prompt_format():
    train, test = tasks.get("gsm8k").load(DATA)
    first = json.loads(open(os.path.join(DATA, "train.jsonl")).readline())
    assert train[0].prompt == f"[MATH TASK] Problem:\n{first['question']}\n\nSolution:\n"
    assert train[0].answer == first["answer"] and len(test) > 0


def test_loss_is_saved_with_the_run(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("TBA_CACHE", str(tmp_path / "cache"))
    cfg, *_ = checks.check(checks.parse(Config, ["--model", tiny_model, "--loss", "grpo", "--clip", "0.3",
                                   "--out", str(tmp_path / "run")]), world=1)
    assert not (tmp_path / "run").exists()  # checked, then removed: the run makes it
    from runtime.log import Log
    Log(cfg, 0, 0.0).close()
    saved = json.load(open(tmp_path / "run" / "config.json"))
    assert (saved["loss"], saved["clip"], saved["score"]) == ("grpo", 0.3, "accuracy")


def test_reuse_cap_and_round_defaults(tiny_model, tmp_path, monkeypatch):
    """--max-reuse defaults to checks.MAX_REUSE with searchers and to no cap without; a round is B / N prompts,
    rounded up, so that the N searchers' rounds make one batch."""
    monkeypatch.setenv("TBA_CACHE", str(tmp_path / "cache"))
    check = lambda *args: checks.check(checks.parse(Config, ["--model", tiny_model, "--out", str(tmp_path / "run"), *args]),
                                       world=1)[0]
    cfg = check()
    assert (cfg.max_reuse, cfg.round_prompts) == (checks.MAX_REUSE, cfg.prompts_per_step) and checks.MAX_REUSE > 0
    assert check("--searchers", "0").max_reuse == 0
    assert (check("--searchers", "4").round_prompts, check("--searchers", "3", "--prompts-per-step", "7").round_prompts) == (8, 3)
    cfg = check("--max-reuse", "0", "--round-prompts", "8")
    assert (cfg.max_reuse, cfg.round_prompts) == (0, 8)


@pytest.mark.engine
def test_torchrun_report_names_the_error(tiny_model, tmp_path):
    """Under torchrun, the refusal is the worker's one line, and torchrun's failure report names it
    (through the error file) instead of 'error_file: <N/A>'; torchrun itself exits with 1."""
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
                        os.path.join(ROOT, "tba.py"), "--model", tiny_model, "--recency", "2"],
                       cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert p.stderr.count("tba.py: error: --recency: must be in [0, 1], got 2.0") == 2  # the line, the report
    assert "traceback : tba.py: error: --recency" in p.stderr and "<N/A>" not in p.stderr


@pytest.mark.engine
def test_command_line_exit_status_and_one_line(tiny_model, tmp_path):
    """The same refusal seen from a shell: `python tba.py ...` prints one line and exits with 2."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tba.py"), "--model", tiny_model, "--recency", "2"],
                       cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["tba.py: error: --recency: must be in [0, 1], got 2.0"]


def test_lee_et_al_schedules():
    """T_R 2 -> 1 over 500 steps, gamma 1 -> 1.2 over 2,000 (trainers/gfn_trainer.py:253-264); their GPT-2 learning
    rate: warmup 100, then linear to 0 at 8 x 5,000 scheduler steps, i.e. still 0.88 x 1e-4 at step 5,000."""
    cfg = Config(steps=5000, reward_temp=2.0, reward_temp_anneal_steps=500, gamma_final=1.2,
                        gamma_anneal_steps=2000, lr=1e-4, warmup_steps=100, decay_steps=39900, lr_decay="linear")
    assert [loss.reward_temp_at(cfg, s) for s in (0, 250, 500, 4999)] == pytest.approx([2.0, 1.5, 1.0, 1.0])
    assert [loss.gamma_at(cfg, s) for s in (0, 1000, 2000, 4999)] == pytest.approx([1.0, 1.1, 1.2, 1.2])
    assert policy.lr_at(cfg, 99) == pytest.approx(1e-4) and policy.lr_at(cfg, 100) == pytest.approx(1e-4)
    assert policy.lr_at(cfg, 4999) == pytest.approx(1e-4 * (40000 - 5000) / 39900, rel=1e-3)  # 0.877e-4
    off = Config()
    assert loss.reward_temp_at(off, 7) == loss.gamma_at(off, 7) == 1.0
    held = Config(reward_temp=2.0, gamma_final=1.2)  # no anneal lengths: --reward-temp and --gamma-final throughout
    assert [loss.reward_temp_at(held, s) for s in (0, 500, 4999)] == [2.0, 2.0, 2.0]
    assert [loss.gamma_at(held, s) for s in (0, 4999)] == [1.2, 1.2]


def test_a_refusal_leaves_a_callers_process_group(tmp_path, monkeypatch, capfd):
    """tba.main called in a process that already has a one-rank group (a vLLM engine's, as in the tests' own
    processes): a refusal of one rank destroys no group it did not make."""
    import torch.distributed as dist
    made = not dist.is_initialized()  # else an earlier engine test of this worker left its group
    if made:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        refuse(["--model", str(tmp_path / "none")], tmp_path, monkeypatch, capfd, "--model")
        assert dist.is_initialized()
    finally:
        if made:
            dist.destroy_process_group()


STRING_FLAGS = [f.name for f in __import__("dataclasses").fields(Config)
                if str in (__import__("typing").get_args(f.type) or (f.type,)) and not f.metadata.get("derived")]


@pytest.mark.parametrize("flag", STRING_FLAGS)
def test_an_empty_value_is_no_value(flag, refusal, tiny_model):
    """One rule for every flag of text (a path, a name, a choice): "" is refused in one line. Before, --resume ""
    (an unset $CKPT) started a fresh run in a new folder, and --out, --calibration, --wandb "" were taken as not
    given."""
    name = "--" + flag.replace("_", "-")
    status, lines = refusal([*(["--model", tiny_model, "--searchers", "0"] if flag != "model" else []), name, ""])
    assert status == 2 and lines == [f"tba.py: error: {name}: empty (an unset shell variable?): give a value, or leave "
                                     f"the flag out"], lines


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_a_seed_that_numpy_and_vllm_do_not_take_is_refused(seed, refusal):
    """--seed goes to vLLM's engine, which seeds numpy with it (0 to 2**32 - 1), and to numpy's SeedSequence lists
    (no negative numbers). Before, -1 and 2**32 killed the searcher inside vLLM's engine start."""
    status, lines = refusal(["--seed", seed])
    assert status == 2 and lines == [f"tba.py: error: --seed: must be in [0, 2**32 - 1] (numpy's and vLLM's seeds), "
                                     f"got {seed}"], lines


def test_the_largest_seed_is_taken(tiny_model, tmp_path):
    import numpy as np
    import torch
    cfg = checks.check(checks.parse(Config, ["--model", tiny_model, "--seed", str(2**32 - 1), "--searchers", "0",
                                             "--out", str(tmp_path / "run")]), 1)[0]
    np.random.seed(cfg.seed)  # what vLLM's set_random_seed does with it
    np.random.default_rng([cfg.seed, 1, 2])
    torch.manual_seed(cfg.seed)


def test_a_tasks_defaults_are_checked(refusal, monkeypatch):
    """A task's `defaults` (tasks/task.py): a key that is not a flag (a typo, a derived value) or a value of another
    type is refused in one line naming the task and the key; a value refused by the flag's own check says it came
    from the task's defaults; the command line's own value is refused as ever. Before: a TypeError from
    dataclasses.replace, a TypeError in the checks, and `--recency: must be in [0, 1]` with no --recency given."""
    from tasks.task import Task
    for defaults, line in (({"max_new_token": 12}, "--task: foo's defaults name 'max_new_token', which is not a flag "
                                                   "(tba.py --help lists them, with - for _)"),
                           ({"model_path": "x"}, "--task: foo's defaults name 'model_path', which is not a flag "
                                                 "(tba.py --help lists them, with - for _)"),
                           ({"max_new_tokens": "12"}, "--max-new-tokens: must be a whole number, got '12' (task foo's "
                                                      "default)"),
                           ({"eval_limit": 1.5}, "--eval-limit: must be a whole number or None, got 1.5 (task foo's "
                                                 "default)"),
                           ({"activation_checkpointing": 1}, "--activation-checkpointing: must be true or false, got 1 (task foo's "
                                                   "default)"),
                           ({"recency": 2}, "--recency: must be in [0, 1], got 2.0 (task foo's default)"),
                           ({"duplicates": "once"}, "--duplicates: unknown 'once' (choose from count, collapse) (task "
                                                    "foo's default)")):
        monkeypatch.setitem(tasks.TASKS, "foo", Task(load=lambda data: ([], []), defaults=defaults))
        status, lines = refusal(["--task", "foo"])
        assert status == 2 and lines == [f"tba.py: error: {line}"], lines
    monkeypatch.setitem(tasks.TASKS, "foo", Task(load=lambda data: ([], []), defaults={"recency": 0.5}))
    status, lines = refusal(["--task", "foo", "--recency", "2"])  # the line's own value: no word of the task
    assert status == 2 and lines == ["tba.py: error: --recency: must be in [0, 1], got 2.0"], lines
    cfg, filled = checks.task_defaults(checks.parse(Config, ["--task", "foo", "--lr", "1"]))
    assert (cfg.recency, filled) == (0.5, ("recency",))
    monkeypatch.setitem(tasks.TASKS, "foo", Task(load=lambda data: ([], []), defaults={"recency": 1}))
    assert checks.task_defaults(checks.parse(Config, ["--task", "foo", "--recency", "0.2"])) == (
        checks.parse(Config, ["--task", "foo", "--recency", "0.2"]), ())  # given: the line's; an int for a float
    assert checks.task_defaults(checks.parse(Config, ["--task", "foo"]))[0].recency == 1.0
