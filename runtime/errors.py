"""The exceptions that end a run, in one leaf module that imports nothing of the project, so that
every other module can raise or catch them without importing the module that raises them.

tba.py turns each into one line and an exit status: ConfigError is a refusal (status 2), the others
stop a run that has begun (after a checkpoint where training has begun).
"""

import signal

# The signals that stop a run (a checkpoint first, once training began), status 128 + the signal: Ctrl-C, a
# kill, a closed terminal or ssh session, a batch scheduler's warning (Slurm's --signal). Searchers ignore
# them.
STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


class ConfigError(ValueError):
    """Bad input (a flag, a path, a data file): reported in one line, exit status 2."""


class Dead(RuntimeError):
    """Another process of the run died; the message names it."""


class Silent(Exception):
    """A searcher sent nothing for --timeout seconds; the message names it."""


class Stop(Exception):
    """A signal asked the run to stop (after a checkpoint, once training has begun)."""


class Unsaved(RuntimeError):
    """The final weights could not be written (a full disk) in --timeout; the message says what is left."""


class WrongWeights(RuntimeError):
    """A searcher's engine holds other weights than the trainer published (runtime/weights.fingerprint)."""
