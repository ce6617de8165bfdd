"""Run a test body in a fresh Python process under the Triton interpreter (CPU).

TRITON_INTERPRET must be set before triton builds a kernel, and the parent process may already have
imported triton for other tests, so each body runs in its own process: `prelude` (a test file's shared
imports and checks), then `body`, both dedented; the run passes when it exits 0 having printed OK.
tests/ is on the child's sys.path (the case modules), the repository root is its working directory.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(body: str, prelude: str = "", timeout: float = 300) -> None:
    head = f"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, {str(REPO_ROOT / "tests")!r})
"""
    code = head + textwrap.dedent(prelude) + textwrap.dedent(body) + "\nprint('OK')\n"
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO_ROOT)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout + proc.stderr
