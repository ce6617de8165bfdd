"""tools/test_r3_swap.py against a real server whose tiny GPU cache (24 blocks of 4 tokens) forces the
shared prefix through the CPU tier; in p2pstore mode so that phase 4 runs too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from api_server_process import REPO_ROOT, api_server, server_env
from fake_model import make_fake_model


def test_r3_swap_tool_passes_on_a_swapping_server(tmp_path, redis_url: str) -> None:
    model_dir = make_fake_model("glm4_moe", str(tmp_path / "glm"))
    cfg = {"enable_routing_replay": True, "routing_store_type": "p2pstore", "p2pstore_url": redis_url}
    flags = ["--routing-replay-config", json.dumps(cfg), "--block-size", "4", "--num-gpu-blocks-override", "24",
             "--num-cpu-blocks-override", "64", "--api-key", "k1"]
    with api_server(model_dir, str(tmp_path), *flags) as server:
        proc = subprocess.run(
            [sys.executable, os.path.join(REPO_ROOT, "tools", "test_r3_swap.py"), "--api-url", server.url,
             "--api-key", "k1", "--log-dir", str(tmp_path / "r3log")],
            capture_output=True, text=True, timeout=300, env=server_env(),
        )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["PASS phase 1 init", "PASS phase 2 capture",
                                                      "PASS phase 3 swap", "PASS phase 4 store"]
    assert "bit-exact" in lines[2] and "ttl=" in lines[3]
    assert os.path.isfile(tmp_path / "r3log" / "swap1.npy")


def test_r3_swap_tool_fails_without_a_cpu_tier(tmp_path) -> None:
    model_dir = make_fake_model("glm4_moe", str(tmp_path / "glm"))
    with api_server(model_dir, str(tmp_path), "--routing-replay-config", '{"enable_routing_replay": true}') as server:
        proc = subprocess.run(
            [sys.executable, os.path.join(REPO_ROOT, "tools", "test_r3_swap.py"), "--api-url", server.url],
            capture_output=True, text=True, timeout=300, env=server_env(),
        )
    assert proc.returncode == 1
    assert "FAIL phase 3 swap" in proc.stdout and "no CPU tier" in proc.stdout
    assert "PASS phase 2 capture" in proc.stdout
