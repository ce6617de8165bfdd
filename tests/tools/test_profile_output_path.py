"""tools/profile_output_path.py --r3-payload stays runnable: one answer's R3 gathered, checked, encoded and
serialised three ways, and
crossing a ZMQ socket two ways (no model)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_r3_payload_mode_prints_its_table() -> None:
    cmd = [sys.executable, "tools/profile_output_path.py", "--r3-payload", "7,3,2"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    header, row = proc.stdout.strip().splitlines()
    assert header.split() == ["rows", "x", "layers", "x", "K", "engine_gather_ms", "api_check_ms", "payload_MiB",
                              "encode_ms", "json.dumps_ms", "spliced_text_ms", "answer_bytes_ms", "socket_pickle_ms",
                              "socket_frames_ms"]
    assert row.split()[0] == "7,3,2" and all(float(x) >= 0 for x in row.split()[1:])
