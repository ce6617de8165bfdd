"""Run a test body in a fresh Python process under the Triton interpreter (CPU).

TRITON_INTERPRET must be set before triton builds a kernel, and the parent process may already have
imported triton for other tests, so each body runs in a process of its own: `prelude` (a test file's shared
imports and checks), then `body`, both dedented; the run passes when it exits 0 having printed OK.
tests/ is on the child's sys.path (the case modules), the repository root is its working directory.

Starting that process (torch, triton, the kernels' modules) took 2-3 s of the CPU per body, more than many
bodies themselves, so a test file's bodies are forked from one process that ran their prelude once (a
zygote): each body starts from exactly the state a fresh process has after the prelude (the prelude's
globals, torch's seeded generator, no kernel run yet, nothing another body did) and runs in its own child,
which exits. The zygote itself never computes (a prelude only imports, defines and seeds): it starts no
Python thread (checked) and no OpenMP pool; numpy's OpenBLAS pool stops itself across a fork (pthread_atfork)
and starts again in the child when needed.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# The zygote: runs the prelude, then per request line {"body", "out", "err"} forks a child that runs the
# body in a copy of the prelude's globals, its stdout and stderr in those files, and answers {"pid"} when
# the child started and {"rc"} (its exit code) when it ended.
_ZYGOTE = r"""
import json, os, sys, threading, traceback
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, sys.argv[1])
reply = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # what the prelude prints goes with its errors, never into the replies
prelude_globals = {"__name__": "__main__"}
exec(compile(json.loads(sys.argv[2]), "<prelude>", "exec"), prelude_globals)
assert threading.active_count() == 1, "the prelude started a thread, which a forked child would not have"
for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for fd, path in ((1, req["out"]), (2, req["err"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
        code = 1
        try:
            exec(compile(req["body"], "<body>", "exec"), prelude_globals)
            print("OK")
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    reply.write(json.dumps({"pid": pid}) + "\n")
    _, status = os.waitpid(pid, 0)
    reply.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
"""


class _Zygote:
    def __init__(self, prelude: str) -> None:
        self.prelude = prelude
        self.log = tempfile.TemporaryFile("w+")  # the zygote's own stderr: a failed prelude's traceback
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE, str(REPO_ROOT / "tests"), json.dumps(prelude)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, bufsize=0, cwd=REPO_ROOT,
        )  # fmt: skip
        self.pending = b""  # read from the zygote, not yet a whole reply

    def _reply(self, timeout: float | None = None) -> dict | None:
        """The next reply; None after `timeout` seconds without one; EOFError when the zygote is gone."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            if timeout is not None and not select.select([fd], [], [], timeout)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, body: str, timeout: float) -> tuple[int | None, str, str]:
        """(exit code, stdout, stderr) of one body; exit code None when the zygote died (stderr: its own)."""
        assert self.proc.stdin is not None
        with tempfile.NamedTemporaryFile("w+") as out, tempfile.NamedTemporaryFile("w+") as err:
            killed = ""
            try:
                self.proc.stdin.write(json.dumps({"body": body, "out": out.name, "err": err.name}).encode() + b"\n")
                started = self._reply()
                ended = self._reply(timeout)  # the deadline of the whole body, as for a process of its own
                if ended is None:
                    os.kill(started["pid"], signal.SIGKILL)
                    ended, killed = self._reply(), f"\n(killed after {timeout} s)"
            except (BrokenPipeError, EOFError):
                return None, "", self.close()
            return ended["rc"], out.read(), err.read() + killed

    def close(self) -> str:
        """Stop the zygote; its stderr."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.seek(0)
        text = self.log.read()
        self.log.close()
        return text


_zygote: _Zygote | None = None  # the current test file's (pytest-xdist runs a file's tests one after another)


@atexit.register
def _close_zygote() -> None:
    global _zygote
    if _zygote is not None:
        _zygote.close()
        _zygote = None


def run_interpreted(body: str, prelude: str = "", timeout: float = 300) -> None:
    global _zygote
    prelude, body = textwrap.dedent(prelude), textwrap.dedent(body)
    if _zygote is not None and (_zygote.prelude != prelude or _zygote.proc.poll() is not None):
        _close_zygote()
    if _zygote is None:
        _zygote = _Zygote(prelude)
    rc, stdout, stderr = _zygote.run(body, timeout)
    if rc is None:
        _zygote = None
    assert rc == 0 and stdout.strip().endswith("OK"), stdout + stderr
