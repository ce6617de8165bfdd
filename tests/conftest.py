from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis_server import RedisServerMissing, redis_server


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A real redis-server for the whole session; fails (never skips) when it is not installed."""
    try:
        with redis_server() as url:
            yield url
    except RedisServerMissing as e:
        pytest.fail(str(e))
