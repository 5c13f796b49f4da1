"""The names README.md and docs/ give exist: every flag (`--x`) is tba.py's (a field of runtime/config.py's Config,
or one docs/experiments.md's code adds), a tool's own (an argparse flag of a file of this repository, a run
script's), or another program's that the pages run (OTHERS); every mode after bench.py's `--modes`, and every part
after its `--parts` or named "part N", is one of bench.py's. A section that says it is history (in its heading or
first paragraph) keeps the names of its time (docs/performance.md's earlier measurements)."""

import dataclasses
import glob
import os
import re

from conftest import ROOT

OTHERS = {  # flags of other programs the pages show, each with whose
    "--nnodes": "torchrun", "--node-rank": "torchrun", "--nproc-per-node": "torchrun", "--nproc_per_node": "torchrun",
    "--master-addr": "torchrun", "--master-port": "torchrun", "--nodes": "Slurm", "--ntasks-per-node": "Slurm",
    "--gpus-per-node": "Slurm", "--exclusive": "Slurm", "--extra-index-url": "pip", "--dist": "pytest-xdist",
    "--help": "argparse", "--max-steps": "the authors' launcher (docs/departures.md)",
    "--ste": "docs/faults.md's example of an abbreviation, refused"}
NO_PART = {42: "docs/faults.md's example of an unknown part, refused"}
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")


def sections():
    """(page, heading, text) of each section of README.md and docs/*.md (a heading inside a code fence is code)."""
    for page in ["README.md", *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        heading, lines, fenced = "", [], False
        for line in open(os.path.join(ROOT, page)):
            fenced ^= line.startswith("```")
            if line.startswith("#") and not fenced:
                yield os.path.basename(page), heading, "".join(lines)
                heading, lines = line.strip(), []
            else:
                lines.append(line)
        yield os.path.basename(page), heading, "".join(lines)


def known_flags() -> set:
    from runtime.config import Config
    fields = [f for f in dataclasses.fields(Config) if not f.metadata.get("derived")]
    flags = {"--" + f.name.replace("_", "-") for f in fields}
    flags |= {"--no-" + f.name.replace("_", "-") for f in fields if f.type in (bool, bool | None)}  # argparse's off
    for path in glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True):
        if "/tests/" not in path:
            flags |= set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", open(path).read()))
    if any("--dry-run" in open(path).read() for path in glob.glob(os.path.join(ROOT, "**", "*.sh"), recursive=True)):
        flags.add("--dry-run")  # the run scripts' own
    page = open(os.path.join(ROOT, "docs", "experiments.md")).read()  # the flags its examples add
    flags |= {"--" + name.replace("_", "-") for name in re.findall(r"\n    (\w+): [\w |]+ = arg\(", page)}
    return flags | set(OTHERS)


def test_every_flag_mode_and_part_the_docs_name_exists():
    import bench
    flags, wrong = known_flags(), []
    for page, heading, text in sections():
        if "history" in (heading + text.strip().split("\n\n")[0]).lower():  # it says so in its first paragraph
            continue
        wrong += [f"{page} {heading!r}: {flag}" for flag in sorted(set(FLAG.findall(text)) - flags)]
        for modes in re.findall(r"--modes((?: [a-z0-9+]+)+)", text):
            wrong += [f"{page} {heading!r}: mode {m}" for m in modes.split() if m not in bench.MODES]
        parts = [int(n) for group in re.findall(r"--parts((?: \d+)+)", text) for n in group.split()]
        parts += [int(n) for n in re.findall(r"\b[Pp]arts? (\d+)\b", text)]
        wrong += [f"{page} {heading!r}: part {n}" for n in parts if n not in bench.PARTS and n not in NO_PART]
    assert not wrong, "\n".join(wrong)


def test_the_check_finds_a_name_that_is_not_there():
    """The patterns catch what they are for (a flag, a mode, a part in a page's wording)."""
    assert FLAG.findall("with `--no-inflight`, `--lag 0` -- --recency 1") == ["--no-inflight", "--lag", "--recency"]
    assert "--no-inflight" not in known_flags() and "--lag" in known_flags() and "--parts" in known_flags()
