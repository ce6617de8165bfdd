"""Start child processes with the spawn method without re-running the user's main script.

Spawned children normally re-import `__main__`, which re-runs an unguarded script (one without
`if __name__ == "__main__":`) and makes it start engines recursively. Our children only need
fastdeploy_r3's own modules, so the main module is hidden from the spawn preparation data.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from collections.abc import Callable
from typing import Any

_ctx = mp.get_context("spawn")


def spawn_context() -> Any:
    return _ctx


def start_process(target: Callable[..., Any], args: tuple, name: str, daemon: bool = True) -> mp.process.BaseProcess:
    proc = _ctx.Process(target=target, args=args, name=name, daemon=daemon)
    main = sys.modules.get("__main__")
    saved = {k: getattr(main, k) for k in ("__spec__", "__file__") if main is not None and hasattr(main, k)}
    try:
        if main is not None:
            main.__spec__ = None
            if hasattr(main, "__file__"):
                del main.__file__
        proc.start()
    finally:
        for k, v in saved.items():
            setattr(main, k, v)
    return proc
