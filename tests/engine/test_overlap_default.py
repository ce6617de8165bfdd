"""Where overlap scheduling is on (engine/overlap.py overlap_enabled) and how the flag reads on the CLI."""

from __future__ import annotations

import argparse

from fastdeploy_r3.config.cli import add_engine_args
from fastdeploy_r3.engine.overlap import overlap_enabled


def test_on_unless_disabled() -> None:
    assert overlap_enabled(False, 1, 0) is True
    assert overlap_enabled(True, 1, 0) is False


def test_tensor_parallelism_and_multi_token_steps_stay_synchronous() -> None:
    # only rank 0 samples (the others could not fill a placeholder); a multi-token step's count is unknown
    assert overlap_enabled(False, 2, 0) is False
    assert overlap_enabled(False, 1, 2) is False


def test_the_flag_is_sglangs_and_off_by_default() -> None:
    parser = add_engine_args(argparse.ArgumentParser())
    assert parser.parse_args(["--model", "m"]).disable_overlap_schedule is False
    assert parser.parse_args(["--model", "m", "--disable-overlap-schedule"]).disable_overlap_schedule is True
