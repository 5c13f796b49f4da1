"""Checkpoints: tensors and plain data only, written whole or not at all (`write_folder`), so that a crash or a
full disk never leaves a broken one. OUT/checkpoint-STEP/ holds model/ (Hugging Face format; with LoRA the merged
model, and adapter/), trainer.pt (read back with torch.load(weights_only=True)), buffer.npz (NumPy without pickle)
and config.json; OUT/checkpoint links to the newest complete one (`atomic_checkpoint`). A --resume takes the flags
its command line does not give from the checkpoint (`resumed_flags`); `check_resumed_flags` and `check_model`
refuse what its data depend on (docs/output.md gives a checkpoint's files)."""

import dataclasses
import glob
import json
import os
import re
import shutil
import sys
import time

import numpy as np
import torch

from runtime import lora
from runtime.hub import check_weights, digest, safetensors_damage
from runtime.errors import ConfigError


def full_state_dict(model) -> dict:
    """All ranks call; rank 0 gets the full weights on the CPU (Hugging Face names): for checkpoints."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_checkpoint(t, stopping: bool = False) -> bool | str:
    """OUT/checkpoint-STEP of trainer `t` (every rank: its gathers are collective; docs/output.md: what it
    holds), unless the link already names this step (saving a step again deletes the linked checkpoint before
    it renames the new one in: a kill between the two would leave the link on nothing). True once written; a
    write that fails (a full disk: `write_error`) leaves the one before linked and returns the line saying so
    (rank 0), which a stop ends with and mid-run is a warning, once: training goes on."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    cfg, model, step, fleet = t.cfg, t.model, t.step, t.fleet
    done = torch.tensor([float(t.rank == 0 and linked(cfg.out, step))])  # rank 0's answer on every rank
    if t.world > 1:
        torch.distributed.broadcast(done, src=0)
    if done.item():
        return True
    t0 = time.time()
    counters = dict(elapsed=t.log.now(), samples=fleet.received, tokens=fleet.tokens, kept=fleet.kept,
                    first_eval=t.log.first_eval, reuse=[t.cap.credit, t.cap.counted, t.cap.drawn],
                    node_samples=fleet.nodes.samples if fleet.nodes else [],  # several nodes: each one's
                    problems=[len(t.data.prompts), t.data.digest()])  # what its buffer's prompt ids index
    sd = full_state_dict(model)
    osd = get_optimizer_state_dict(model, t.opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def write(folder):
        save_hf(model, sd, t.tokenizer, os.path.join(folder, "model"))
        if lora.active(model):  # what --resume rebuilds the policy from, with the frozen --model
            model.save_pretrained(os.path.join(folder, "adapter"), state_dict=sd)  # peft's format
        weights = {os.path.relpath(w, folder): digest(w)  # damage of the same size: load_checkpoint
                   for w in glob.glob(os.path.join(folder, "*", "*.safetensors"))}
        with open(os.path.join(folder, "trainer.pt"), "wb") as f:  # our file: a failed write's OSError is kept
            torch.save(dict(optimizer=osd, step=step, torch_rng=torch.get_rng_state(), **counters,
                            weights=weights, **fleet.saved(step)), f)
        buffer = t.buffer.state()
        np.savez(os.path.join(folder, "buffer.npz"), **buffer)
        dropped.extend(json.loads(str(buffer["dropped"])))
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=1)
    failed, dropped = None, []
    try:
        if t.rank == 0:
            atomic_checkpoint(cfg.out, step, write)
    except Exception as e:
        if write_error(e) is None:
            raise
        failed = (f"the checkpoint of step {step} could not be written in {cfg.out} ({write_error(e)}): the last is "
                  f"{last_checkpoint(cfg.out)}")
    t.log.overhead += time.time() - t0
    if failed and not stopping and not t.unsaved_said:
        t.log.print(f"tba.py: warning: {failed}; training goes on (a later checkpoint that fails is not said again)",
                    file=sys.stderr)
        t.unsaved_said = True
    if dropped and not t.dropped_said:  # a researcher's buffer attribute that is no plain data (buffer.plain)
        t.log.print(f"tba.py: warning: the checkpoint's buffer leaves out {', '.join(dropped)}: a resume "
                    f"starts it afresh (said once)", file=sys.stderr)
        t.dropped_said = True
    return failed or True


def restore(t, ckpt: dict):
    """--resume, into trainer `t`: the optimizer, the RNG, the counters; the buffer's sampling knobs act from
    the next step on (`check_resumed_flags`), what it keeps cannot change (`fixed_on_resume`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    set_optimizer_state_dict(t.model, t.opt, ckpt["optimizer"], options=StateDictOptions(full_state_dict=True))
    torch.set_rng_state(ckpt["torch_rng"])
    t.fleet.received, t.fleet.kept, t.log.first_eval = ckpt["samples"], ckpt["kept"], ckpt["first_eval"]
    t.fleet.tokens = ckpt.get("tokens", 0)  # (a checkpoint saved before it counted them: from 0)
    for name, flag in t.buffer.FLAGS.items():  # the buffer's knobs that may change (fixed_on_resume: the others)
        if flag not in fixed_on_resume():
            setattr(t.buffer, name, getattr(t.cfg, flag))
    t.cap.credit, t.cap.counted, t.cap.drawn = ckpt["reuse"]
    if t.fleet.nodes:  # each other node's count (node 0's is the rest; a node no longer there: node 0's)
        counts = ckpt.get("node_samples", [])[1:t.fleet.nodes.count]
        t.fleet.nodes.samples[1:1 + len(counts)] = counts


def load_checkpoint(folder: str) -> dict:
    """The trainer state and the buffer's arrays of a checkpoint, read without running any code it could carry."""
    trainer, buffer = os.path.join(folder, "trainer.pt"), os.path.join(folder, "buffer.npz")
    if not os.path.exists(folder):
        raise ConfigError(f"--resume: {folder} does not exist")
    if not os.path.isfile(trainer):
        inside = os.path.join(folder, "checkpoint")
        hint = f" (its run's checkpoint is {inside})" if os.path.isfile(os.path.join(inside, "trainer.pt")) else ""
        raise ConfigError(f"--resume: {folder} is not a checkpoint folder{hint}")
    for name in ("buffer.npz", "model/config.json"):  # (without model/config.json: transformers' traceback)
        if not os.path.isfile(os.path.join(folder, name)):
            raise ConfigError(f"--resume: {folder} has no {name} (an incomplete checkpoint?)")
    check_weights(os.path.join(folder, "model"), "resume", "; an incomplete checkpoint?")
    try:
        state = torch.load(trainer, weights_only=True, map_location="cpu")  # tensors and plain data only
        with np.load(buffer, allow_pickle=False) as f:
            state["buffer"] = dict(f)
    except Exception as e:
        raise ConfigError(f"--resume: {folder} does not parse as a checkpoint ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120] if str(e) else ''})") from None
    for name, sha in state.get("weights", {}).items():  # damage of the same size (a header check misses it)
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or digest(path) != sha:
            raise ConfigError(f"--resume: {path} is not the file its checkpoint wrote (missing, or its "
                              f"SHA-256 differs: damaged?)")
    return state


def linked(out: str, step: int) -> bool:
    """OUT/checkpoint already names the checkpoint of `step`."""
    link = os.path.join(out, "checkpoint")
    return os.path.islink(link) and os.readlink(link) == f"checkpoint-{step:06d}"


def atomic_checkpoint(out: str, step: int, write):
    """OUT/checkpoint is a link to the newest complete OUT/checkpoint-STEP: the new one is written
    under a temporary name, renamed, then the link is swapped in one rename, then the old one goes.
    A crash at any point leaves the link on a complete checkpoint; a write that fails, no temporary folder."""
    name = f"checkpoint-{step:06d}"
    for stale in glob.glob(os.path.join(out, "checkpoint-*.tmp")):  # left by a process killed mid-save
        shutil.rmtree(stale, ignore_errors=True)
    write_folder(os.path.join(out, name), write)
    link = os.path.join(out, "checkpoint")
    previous = os.path.realpath(link) if os.path.islink(link) else None
    if os.path.lexists(link + ".tmp"):
        os.remove(link + ".tmp")
    os.symlink(name, link + ".tmp")
    os.replace(link + ".tmp", link)
    if previous and os.path.basename(previous) != name:
        shutil.rmtree(previous, ignore_errors=True)


def last_checkpoint(out: str) -> str:
    """The checkpoint OUT/checkpoint links to, for a line that says what is left."""
    link = os.path.join(out, "checkpoint")
    return f"{link} ({os.readlink(link)})" if os.path.islink(link) else "none (--save-every)"


def write_folder(path: str, write):
    """PATH written whole or not at all: `write(PATH.tmp)`, then renamed to PATH (an older PATH goes only once the new
    one is complete). Whatever stops the write (an error, a signal), the temporary folder goes with it."""
    tmp, old = path + ".tmp", path + ".old"
    for stale in (tmp, old):  # left by a process killed mid-write
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.makedirs(tmp)
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.isdir(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def write_error(e: BaseException) -> str | None:
    """What failed, if `e` (or an exception it came from) is a failed write (a full disk, a quota, a file size
    limit, a read-only or failing disk), else None (a bug: its traceback). safetensors, which transformers saves
    the weights with, says the OS's error in its message only ("... I/O error: No space left on device (os error
    28)"); torch.save's RuntimeError keeps the OSError of the file it was given (save_checkpoint opens it)."""
    while e is not None:
        if isinstance(e, OSError):
            return e.strerror or type(e).__name__
        code = re.search(r"\(os error (\d+)\)", str(e)) if type(e).__name__ == "SafetensorError" else None
        if code:
            return os.strerror(int(code.group(1)))
        e = e.__cause__ or e.__context__
    return None


RETRY = 5.0  # s between two tries to write OUT/final


def save_final(model, state_dict, tokenizer, out: str, step: int, timeout: float, signals, log) -> str | None:
    """OUT/final (`save_hf`), whole or not at all; a write that fails keeps the weights in memory, says so in
    one line and is tried again every RETRY s until `timeout` s or a signal (docs/faults.md). Returns None
    once written, else the line that ends the run."""
    path, deadline = os.path.join(out, "final"), None
    while True:
        try:
            write_folder(path, lambda tmp: save_hf(model, state_dict, tokenizer, tmp))
            if deadline is not None:
                log.print(f"tba.py: {path} written at a later try", file=sys.stderr)
            return None
        except Exception as e:
            why = write_error(e)
            if why is None:
                raise
        if deadline is None:
            deadline = time.time() + timeout
            if not signals.first:
                log.print(f"tba.py: warning: {path} could not be written ({why}): free space there; the weights of "
                          f"step {step} are kept in memory and written again every {RETRY:g} s, for {timeout:g} s "
                          f"(--timeout)", file=sys.stderr)
        wake = min(deadline, time.time() + RETRY)
        while not signals.first and time.time() < wake:
            time.sleep(0.25)
        if signals.first or time.time() >= deadline:
            given_up = (f", and {signals.first[0]} stopped the tries" if signals.first else
                        f" in {timeout:g} s of tries (--timeout)")
            return (f"{path} could not be written ({why}){given_up}: the weights of step {step} are lost; the last "
                    f"checkpoint is {last_checkpoint(out)}")


def save_hf(model, state_dict, tokenizer, path):
    """The model in Hugging Face format; with LoRA the merged one (lora.py): a plain model anyone can load."""
    if lora.active(model):
        model, state_dict = model.get_base_model(), lora.merge_state_dict(model, state_dict)
    model.save_pretrained(path, state_dict=state_dict)
    tokenizer.save_pretrained(path)


def fixed_on_resume() -> tuple[str, ...]:
    """The flags the checkpoint's data depend on, each declared so where it is declared (runtime/config.py's
    `arg(..., fixed=True)`): the buffer's prompt ids index the task's prompts, its rewards and logp_ref were
    computed with these models, this reward and this temperature, and it kept what these settings kept."""
    from runtime.config import Config
    return tuple(f.name for f in dataclasses.fields(Config) if f.metadata.get("fixed"))


def read_config(folder: str, needed: bool = True) -> dict | None:
    """A checkpoint's config.json: its run's flags and derived values. Not `needed`: None where the folder
    holds none (load_checkpoint then says what the folder is)."""
    path = os.path.join(folder, "config.json")
    if not needed and not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--resume: {folder}/config.json does not read ({type(e).__name__})") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"--resume: {folder}/config.json does not read (not an object)")
    return saved


def resumed_flags(cfg, saved: dict):
    """--resume continues its run: a flag the command line does not give takes the checkpoint's value where the
    checkpoint's run (or a resume of it) gave it, and is otherwise left to its default (a task's, or one derived from
    other flags) as it was there. `given` becomes both's. --resume and --out are this command line's alone."""
    flags = {f.name: f.default for f in dataclasses.fields(cfg) if not f.metadata.get("derived")
             and f.name not in ("resume", "out")}
    mine = set(cfg.given) if cfg.given is not None else {n for n in flags if getattr(cfg, n) != flags[n]}
    theirs = saved.get("given")
    if theirs is None:  # a run made in code, or saved before `given` was: what it held other than the defaults
        theirs = [n for n in flags if n in saved and saved[n] != flags[n]]
    taken = {n: saved[n] for n in theirs if n in flags and n in saved and n not in mine}
    return dataclasses.replace(cfg, **taken, given=tuple(sorted(mine | set(taken))))


def check_resumed_flags(cfg, folder: str, same_weights: bool = False) -> dict:
    """One line naming the flags that differ from the checkpoint's run; a refusal for those that cannot change
    mid-run (`fixed_on_resume`; docs/output.md). `same_weights`: --model's weights were found to be the
    checkpoint's (`check_model`). Returns what changed, {name: [old, new]}: the flags, and the models' folders."""
    saved = read_config(folder)
    flags = [f.name for f in dataclasses.fields(cfg) if not f.metadata.get("derived") and f.name not in ("resume", "out")]

    def same_folder(n):  # --model tiny then --model FOLDER-IT-RESOLVED-TO: the same model, named two ways
        path, was = getattr(cfg, f"{n}_path", None), saved.get(f"{n}_path")
        return bool(path and was) and os.path.realpath(path) == os.path.realpath(was)
    differ = [n for n in flags if n in saved and saved[n] != getattr(cfg, n) and not same_folder(n)]
    show = lambda n: f"--{n.replace('_', '-')} {getattr(cfg, n)} (was {saved[n]})"
    fixed = [n for n in differ if n in fixed_on_resume() and not (n == "model" and same_weights)]
    if fixed:
        raise ConfigError(f"--resume: {', '.join(map(show, fixed))} cannot change mid-run (the checkpoint's buffer "
                          f"was searched, scored and kept with the old value)")
    adapter = [n for n in ("lora_rank", "lora_alpha") if n in differ or (n == "lora_rank" and saved[n] != cfg.lora_rank)]
    if adapter and (cfg.lora_rank or saved["lora_rank"]):
        raise ConfigError(f"--resume: {', '.join(map(show, adapter))} cannot change mid-run (the checkpoint's weights "
                          f"and optimizer state are those of its own adapter, or of all weights)")
    weights = os.path.join(folder, "adapter", "adapter_model.safetensors")
    if cfg.lora_rank and safetensors_damage(weights):
        raise ConfigError(f"--resume: {weights} {safetensors_damage(weights)} (an incomplete checkpoint?)")
    if differ and int(os.environ.get("RANK", "0")) == 0:
        print(f"tba.py: resuming with flags that differ from the checkpoint's: {', '.join(map(show, differ))}",
              flush=True)
    paths = [f.name for f in dataclasses.fields(cfg) if f.name.endswith("_path") and f.name in saved]
    return {n: [saved[n], getattr(cfg, n)] for n in differ + paths if saved[n] != getattr(cfg, n)}


def check_model(cfg, ckpt: dict, folder: str) -> bool:
    """--resume: --model's weights are those the checkpoint's run started from (pi_ref's, whose log-probs its buffer
    holds), by their fingerprints (runtime.weights.identity), whatever folder --model resolves to now: a refusal in
    one line naming both folders where they are not. A checkpoint saved before it kept them: a note, and False (its
    --model is then compared by folder: check_resumed_flags)."""
    from runtime.weights import covers, file_fingerprints
    recorded = ckpt.get("model_prints")
    if int(os.environ.get("RANK", "0")) != 0:  # rank 0 reads the files: its refusal reaches every rank (first_refusal)
        return recorded is not None
    was = (read_config(folder, needed=False) or {}).get("model_path", "?")
    if recorded is None:
        print(f"tba.py: note: {folder} keeps no fingerprints of its --model's weights (saved before they were kept): "
              f"--model is compared by its folder alone", flush=True)
        return False
    held = file_fingerprints(cfg.model_path, recorded["dtypes"], "cuda" if cfg.device == "cuda" else "cpu")
    if not covers(held, recorded["prints"]):
        raise ConfigError(f"--model: {cfg.model} resolves to {cfg.model_path}, whose weights are not those the "
                          f"checkpoint's run started from (in {was} then): pi_ref's, whose log-probs its buffer holds; "
                          f"resume with those weights")
    return True
