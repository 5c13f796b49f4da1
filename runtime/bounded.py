"""A function run in a child Python process under a hard time limit: `Bounded("module:function", seconds)`.

The math task's symbolic check (rewards.math_reward) runs sympy through math-verify, which can take
unbounded time on a pathological answer (\\boxed{9^{9^{9^{9}}}}). math-verify's own limit is
signal.alarm (math_verify/utils.py, `timeout`): it works in the main thread only (elsewhere `parse` and
`verify` raise ValueError), replaces the process's SIGALRM handler while it runs, and cannot stop C code
that does not check for signals (a C extension such as gmpy2, which sympy uses when it is installed). A
child process can be killed whatever it runs. Each call sends its arguments to the child as one JSON line
and waits at most `seconds` for the JSON line of its result; past that the child is killed (the next call
starts another) and the call raises TimedOut. The child starts on the first call, outside the call's
limit; it exits when its stdin closes (its parent gone) and, if stuck in C by then, when RLIMIT_CPU
(set before each call) ends it. Calls from several threads take turns; a forked copy starts its own child.
"""

import json
import os
import select
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START = 120.0  # s a child may take to import its function (sympy on a loaded machine)


class TimedOut(Exception):
    """The call ran past its limit, or the child died during it (killed for memory, say)."""


class Bounded:
    def __init__(self, target: str, seconds: float, preload: tuple[str, ...] = ()):
        self.target, self.seconds, self.preload = target, seconds, preload  # preload: imported before the clock
        self.proc, self.pid, self.lock = None, None, threading.Lock()

    def __call__(self, *args):
        with self.lock:
            if self.proc is None or self.pid != os.getpid() or self.proc.poll() is not None:
                self.start()
            try:
                self.proc.stdin.write((json.dumps(args) + "\n").encode())
                self.proc.stdin.flush()
            except BrokenPipeError:  # it died since the last call
                self.stop()
                raise TimedOut(f"{self.target}: the child process died") from None
            reply = self.read(self.seconds)
            if "error" in reply:
                raise RuntimeError(f"{self.target}: {reply['error']}")
            return reply["result"]

    def start(self):
        code = f"import sys; sys.path.insert(0, {ROOT!r}); from runtime.bounded import serve; serve()"
        # its own session: a Ctrl-C meant for the run does not print a child's traceback; stderr (math-verify's
        # warnings) goes nowhere, failures come back as replies
        self.proc = subprocess.Popen([sys.executable, "-c", code, self.target, str(self.seconds), *self.preload],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        self.pid = os.getpid()
        reply = self.read(START)
        if "error" in reply:
            self.stop()
            raise RuntimeError(f"{self.target}: {reply['error']}")

    def read(self, seconds: float) -> dict:
        """The child's next line, or TimedOut (the child killed) after `seconds`."""
        deadline, out, data = time.monotonic() + seconds, self.proc.stdout.fileno(), b""
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([out], [], [], left)[0]:
                self.stop()
                raise TimedOut(f"{self.target}: no result in {seconds:g} s")
            chunk = os.read(out, 1 << 16)
            if not chunk:
                self.stop()
                raise TimedOut(f"{self.target}: the child process died")
            data += chunk
        return json.loads(data)

    def stop(self):
        if self.proc is not None and self.pid == os.getpid():
            self.proc.kill()  # our own child, by its handle
            self.proc.wait()
            self.proc.stdin.close()
            self.proc.stdout.close()
        self.proc = None


def serve():
    """The child: import the target, then answer one JSON line of arguments with one JSON line of result."""
    import importlib
    import resource

    target, seconds, preload = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
    replies = os.fdopen(os.dup(1), "w")  # the protocol's own stdout; any other print goes to stderr
    os.dup2(2, 1)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file when RLIMIT_CPU ends it
    try:
        for name in preload:
            importlib.import_module(name)
        module, name = target.split(":")
        function = getattr(importlib.import_module(module), name)
    except Exception as e:
        replies.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        return
    replies.write('{"ready": true}\n')
    replies.flush()
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    for line in sys.stdin:
        used = resource.getrusage(resource.RUSAGE_SELF)
        soft = int(used.ru_utime + used.ru_stime + seconds) + 2  # SIGXCPU ends a child no parent watches
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
        try:
            reply = {"result": function(*json.loads(line))}
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
