from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from fake_model import make_fake_model
from redis_server import RedisServerMissing, redis_server


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A real redis-server for the whole session; fails (never skips) when it is not installed."""
    try:
        with redis_server() as url:
            yield url
    except RedisServerMissing as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def fake_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """fake_model_dir(arch, preset="tiny", seed=0) -> directory of a cached fake checkpoint."""
    cache: dict[tuple[str, str, int], str] = {}

    def get(arch: str, preset: str = "tiny", seed: int = 0) -> str:
        key = (arch, preset, seed)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-{preset}-{seed}")
            cache[key] = make_fake_model(arch, str(out), preset=preset, seed=seed)
        return cache[key]

    return get
