"""The tasks, one file each (task.py says what a task is):

- `arith`: the toy task, two-digit addition (built in, no download);
- `gsm8k`: the paper's headline task, with the paper's reward;
- `tldr`: the paper's summarisation task, scored by a reward model, evaluated by win rate and KL;
- `redteam`: the paper's red-teaming task after Lee et al.: an attacker against a frozen victim;
- `math`: MATH, the paper's Sec. 6 run (Qwen 2.5 7B, TBA′ against Dr. GRPO), with the authors' grading.

`TASKS` maps each `--task` name to the module that holds its `TASK`; `get(name)` imports it (only the
task a run uses is imported). A new task is one new file with its `TASK`, and its line here.
"""

import importlib

TASKS = {"arith": "tasks.arith", "gsm8k": "tasks.gsm8k", "tldr": "tasks.tldr", "redteam": "tasks.redteam",
         "math": "tasks.math"}


def get(name: str):
    """The Task of `--task name` (an entry may also be a Task itself, registered in code)."""
    entry = TASKS[name]
    return importlib.import_module(entry).TASK if isinstance(entry, str) else entry
