"""Counts the lines of the repository's own files that each process of a traced run executes (tests/test_step.py).

Put on PYTHONPATH with TBA_TRACE_OUT (a folder) and TBA_TRACE_ROOT (the repository) set, it traces every thread of
every process that starts Python, the fork server's children too (they inherit its trace), but the watchdogs' (a
beat a second, not a step's work), and writes {file, line, count} rows to TBA_TRACE_OUT/<pid>.json at the
process's exit. Nothing happens without the two variables."""
import atexit
import collections
import json
import os
import sys
import threading

OUT, ROOT = os.environ.get("TBA_TRACE_OUT"), os.environ.get("TBA_TRACE_ROOT")
if OUT and ROOT:
    import multiprocessing.util as mp_util
    counts = collections.Counter()
    skip = tuple(os.path.join(ROOT, d) + os.sep for d in (".venv", "tests"))
    mine = {}

    def lines(frame, event, arg):
        if event == "line":
            counts[(frame.f_code.co_filename, frame.f_lineno)] += 1
        return lines

    def calls(frame, event, arg):
        name = frame.f_code.co_filename
        if name not in mine:
            mine[name] = name.startswith(ROOT + os.sep) and not name.startswith(skip)
        if not mine[name] or threading.current_thread().name == "tba-watchdog":
            return None
        return lines

    def dump():
        with open(os.path.join(OUT, f"{os.getpid()}.json"), "w") as f:
            json.dump([[os.path.relpath(k[0], ROOT), k[1], n] for k, n in counts.items()], f)

    class Anchor:  # a process the fork server forks runs multiprocessing's finalizers at its end, not atexit's
        pass
    anchor = Anchor()
    sys.settrace(calls)
    threading.settrace(calls)
    atexit.register(dump)
    mp_util.Finalize(None, dump, exitpriority=100)
    mp_util.register_after_fork(anchor, lambda _: mp_util.Finalize(None, dump, exitpriority=100))
