"""Shared-memory segments: owner unlinks, stale ones go, and a too-small /dev/shm stops start-up clearly."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from fake_model import make_fake_model

from fastdeploy_r3.cache_manager import shm
from fastdeploy_r3.cache_manager.shm import SharedMemoryError, ShmSegment, list_segments, remove_stale_segments
from fastdeploy_r3.config import ConfigError, EngineConfig
from fastdeploy_r3.engine.engine_service import EngineService


def test_owner_unlinks_and_attacher_sees_the_same_bytes():
    seg = ShmSegment.create("fdr3_testshm_a", 64)
    seg.numpy((8,), "int64")[:] = range(8)
    other = ShmSegment.attach("fdr3_testshm_a")
    assert other.numpy((8,), "int64").tolist() == list(range(8))
    other.close()
    assert list_segments("testshm") == ["fdr3_testshm_a"]
    seg.close()
    assert list_segments("testshm") == []


def test_segments_of_a_dead_engine_pid_are_removed():
    dead_pid = 2**22 + 12345  # above the default pid_max: no such process
    seg = ShmSegment.create(f"fdr3_{dead_pid}_abcd_kv_rank0", 16)
    seg.owner = False  # pretend its engine crashed
    seg.close()
    assert f"fdr3_{dead_pid}_abcd_kv_rank0" in remove_stale_segments()
    assert list_segments(f"{dead_pid}_abcd") == []


def test_engine_refuses_to_start_when_dev_shm_cannot_hold_the_routing_buffer(tmp_path, monkeypatch):
    """/dev/shm "has" 1 KiB: the routing host buffer cannot be created; the error says what to do."""
    model = make_fake_model("qwen3_moe", str(tmp_path / "m"), preset="tiny")
    cfg = EngineConfig.from_kwargs(model, block_size=4, num_gpu_blocks_override=64,
                                   routing_replay_config={"enable_routing_replay": True})
    monkeypatch.setattr(shm, "shm_free_bytes", lambda: 1024)
    with pytest.raises(SharedMemoryError, match=r"/dev/shm has 0.0 MiB free but fdr3_.*routing_host needs"):
        EngineService(cfg)
    monkeypatch.undo()
    assert list_segments(str(os.getpid())) == []  # the engine's suffix starts with our pid


def test_unknown_engine_argument_is_named():
    with pytest.raises(ConfigError, match="unknown engine argument 'blocksize'"):
        EngineConfig.from_kwargs("/nonexistent", blocksize=4)


def test_a_created_segment_reserves_its_pages_at_once():
    """8 MiB created and never touched: its file already holds 8 MiB of tmpfs pages (not a sparse file whose
    first write past /dev/shm's free space would SIGBUS). Its own blocks, not /dev/shm's free space, which
    other processes change meanwhile."""
    seg = ShmSegment.create("fdr3_testshm_reserve", 8 << 20)
    try:
        assert os.stat("/dev/shm/fdr3_testshm_reserve").st_blocks * 512 >= 8 << 20
    finally:
        seg.close()


def test_segments_that_together_overflow_dev_shm_fail_at_creation_not_at_first_touch():
    """A private 1 MiB /dev/shm (own mount namespace): 600 KiB fits, a second 600 KiB is refused clearly."""
    script = (
        "from fastdeploy_r3.cache_manager.shm import ShmSegment, SharedMemoryError\n"
        "a = ShmSegment.create('fdr3_testshm_one', 600 << 10)\n"
        "try:\n"
        "    ShmSegment.create('fdr3_testshm_two', 600 << 10)\n"
        "except SharedMemoryError as e:\n"
        "    print('refused:', e)\n"
        "a.numpy((600 << 10,), 'uint8')[:] = 1\n"
        "print('touched')\n"
    )
    userns = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    cmd = ["unshare", *userns, "--mount", "--propagation", "private", "sh", "-c",
           'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$0" -c "$1"', sys.executable, script]
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    # without the reservation the untouched first segment did not count and the second was "free"
    assert "refused: /dev/shm has 0.4 MiB free but fdr3_testshm_two needs 0.6 MiB" in out.stdout
    assert out.stdout.rstrip().endswith("touched")
