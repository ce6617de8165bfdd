from __future__ import annotations

import os

# Before anything imports torch (fake_model does), so that this process and every server, engine, worker and
# tool the tests start (they inherit the environment) have it: an OpenMP thread that finds no work spins for a
# while before it sleeps (libgomp's default), and on the 2-core CI machine, where the two pytest-xdist workers,
# their servers' workers and the tests' own torch code all compute at once, those spinning threads take the
# cores from the processes that have work: a request that takes 0.2 s took 1-3 s beside one busy torch process.
# PASSIVE makes them sleep at once; it changes no result, only who waits on the CPU.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from collections.abc import Callable, Iterator  # noqa: E402

import pytest  # noqa: E402
from fake_model import make_fake_model  # noqa: E402
from mooncake_server import MooncakeMissing, mooncake_holder, mooncake_master, mooncake_url  # noqa: E402
from redis_server import RedisServerMissing, redis_server  # noqa: E402
from xdist_order import file_rank  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    # keep the files in the order pytest_collection_modifyitems gives them (xdist's own: most tests first)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Longest files first (tests/xdist_order.py), so that no long file starts last and keeps one xdist
    worker busy alone at the end; the order inside each file is kept (a stable sort)."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    items.sort(key=lambda item: file_rank(os.path.relpath(str(item.path), tests_dir).replace(os.sep, "/")))


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A real redis-server for the whole session; fails (never skips) when it is not installed."""
    try:
        with redis_server() as url:
            yield url
    except RedisServerMissing as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def mooncake_store_url() -> Iterator[str]:
    """A real mooncake_master and a 256 MB holder for the whole session; fails (never skips) when not installed.

    The URL has `segment=0`: clients made from it keep nothing themselves, so what they put outlives them.
    """
    try:
        with mooncake_master() as master, mooncake_holder(master):
            yield mooncake_url(master, segment="0")
    except MooncakeMissing as e:
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


@pytest.fixture(scope="session")
def hf_checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """hf_checkpoint_dir(family) -> directory of a tiny checkpoint written by the installed transformers's
    save_pretrained (tests/hf_checkpoints.py), written once per session."""
    from hf_checkpoints import write_hf_checkpoint

    cache: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in cache:
            cache[family] = write_hf_checkpoint(family, str(tmp_path_factory.mktemp(f"hf-{family}")))
        return cache[family]

    return get
