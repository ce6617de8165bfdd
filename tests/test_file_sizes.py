"""No module of the package is longer than 400 lines: past that a file holds more than one job."""

from __future__ import annotations

import os

PACKAGE = "fastdeploy_r3"
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PACKAGE)
MAX_LINES = 400

def line_counts(root: str = ROOT) -> dict[str, int]:
    counts = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    counts[os.path.relpath(path, root).replace(os.sep, "/")] = sum(1 for _ in f)
    return counts


def too_long(counts: dict[str, int]) -> dict[str, int]:
    return {rel: n for rel, n in sorted(counts.items()) if n > MAX_LINES}


def test_no_module_is_longer_than_400_lines() -> None:
    over = too_long(line_counts())
    assert over == {}


def test_the_counter_sees_a_long_file_in_a_subpackage(tmp_path) -> None:
    (tmp_path / "room").mkdir()
    (tmp_path / "room" / "long.py").write_text("x = 1\n" * 401)
    (tmp_path / "room" / "short.py").write_text("x = 1\n" * 400)
    assert too_long(line_counts(str(tmp_path))) == {"room/long.py": 401}
