"""Fixtures shared by test modules: device configurations, the live vLLM engine's
gate and in-process mode, the Redis server of the tier tests."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from helpers import DEVICE_CONFIGS, DeviceConfig

if TYPE_CHECKING:
    from redis_server import RedisServer


@pytest.fixture(params=DEVICE_CONFIGS, ids=[c.name for c in DEVICE_CONFIGS])
def cfg(request: pytest.FixtureRequest) -> DeviceConfig:
    """Each device configuration a store runs in (CUDA ones where a GPU is present)."""
    config: DeviceConfig = request.param
    return config


@functools.cache
def _live_engine_missing() -> str | None:
    """Why vLLM 0.32's live CPU engine cannot run here (with how to get it), or None."""
    from omnicache.integrations.vllm.common import LIVE_INSTALL_HINT, live_engine_missing

    missing = live_engine_missing()
    return None if missing is None else f"{missing}; {LIVE_INSTALL_HINT}"


@pytest.fixture(scope="module", autouse=True)
def _live_engine_gate(request: pytest.FixtureRequest) -> None:
    """Skips a ``vllm_live`` module without the live engine, or fails it where it is required.

    Required under ``CI=true`` or ``OMNICACHE_REQUIRE_VLLM_LIVE=1``. Runs
    before any of the module's fixtures builds a model or starts an engine.
    The marker also lets ``-m "not vllm_live"`` leave those modules out of a
    run in another environment, even under CI=true.
    """
    if request.node.get_closest_marker("vllm_live") is None:
        return
    missing = _live_engine_missing()
    if missing is None:
        return
    if os.environ.get("CI") == "true" or os.environ.get("OMNICACHE_REQUIRE_VLLM_LIVE") == "1":
        pytest.fail(
            f"CI=true or OMNICACHE_REQUIRE_VLLM_LIVE=1 requires the live engine: {missing}",
            pytrace=False,
        )
    pytest.skip(missing)


@pytest.fixture(scope="module")
def in_process() -> Iterator[None]:
    """vLLM's in-process mode: scheduler and model runner in this process."""
    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    yield
    if saved is None:
        del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved


# The Redis fixtures: a server that cannot be found or started goes through
# redis_server.no_server (fails under CI=true, else skips, with the reason).
# NOTE: redis_server is imported inside them, so that modules without Redis
# tests run in an environment without redis-py (the tier modules then fail to
# import).


@pytest.fixture(scope="session")
def redis_server_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """The server of the whole run: ``OMNICACHE_REDIS_URL``'s, else one started for it."""
    from redis_server import find_server, no_server

    found = find_server(tmp_path_factory.mktemp("redis"))
    if isinstance(found, str):
        no_server(found)
    yield found
    found.shut_for_good()


@pytest.fixture(scope="session")
def redis_binary() -> str:
    """The server binary of tests that start servers of their own (tests/redis_server.py)."""
    from redis_server import no_server, server_binary

    try:
        return server_binary()
    except RuntimeError as exc:
        no_server(str(exc))


@pytest.fixture
def redis_server(redis_server_session: RedisServer) -> Iterator[RedisServer]:
    """The test server, up; one that a test stopped is started again afterwards."""
    if not redis_server_session.is_up():
        redis_server_session.start()
    yield redis_server_session
    if not redis_server_session.is_up():
        redis_server_session.start()
