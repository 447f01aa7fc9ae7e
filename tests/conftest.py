"""Fixtures shared by test modules: device configurations, the Redis server of the tier tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, NoReturn

import pytest
from helpers import DEVICE_CONFIGS, DeviceConfig

if TYPE_CHECKING:
    from redis_server import RedisServer


@pytest.fixture(params=DEVICE_CONFIGS, ids=[c.name for c in DEVICE_CONFIGS])
def cfg(request: pytest.FixtureRequest) -> DeviceConfig:
    """Each device configuration a store runs in (CUDA ones where a GPU is present)."""
    config: DeviceConfig = request.param
    return config


def _no_redis(reason: str) -> NoReturn:
    """Skips a test that needs a Redis server, or under CI=true fails it."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true requires a Redis server: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def redis_server_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    # NOTE: imported here, so that modules without Redis tests run in an
    # environment without redis-py (the tier modules then fail to import).
    from redis_server import find_server

    found = find_server(tmp_path_factory.mktemp("redis"))
    if isinstance(found, str):
        _no_redis(found)
    yield found
    found.shut_for_good()


@pytest.fixture(scope="session")
def redis_binary() -> str:
    """The server binary of tests that start servers of their own (tests/redis_server.py)."""
    from redis_server import server_binary

    try:
        return server_binary()
    except RuntimeError as exc:
        _no_redis(str(exc))


@pytest.fixture
def redis_server(redis_server_session: RedisServer) -> Iterator[RedisServer]:
    """The test server, up; one that a test stopped is started again afterwards."""
    if not redis_server_session.is_up():
        redis_server_session.start()
    yield redis_server_session
    if not redis_server_session.is_up():
        redis_server_session.start()
