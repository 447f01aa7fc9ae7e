"""Fixtures shared by test modules: device configurations, the Redis server of the tier tests."""

from __future__ import annotations

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


@pytest.fixture(scope="session")
def redis_server_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    # NOTE: imported here, so that modules without Redis tests run in an
    # environment without redis-py (the tier modules then fail to import).
    from redis_server import find_server

    found = find_server(tmp_path_factory.mktemp("redis"))
    if isinstance(found, str):
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true requires a Redis server: {found}", pytrace=False)
        pytest.skip(found)
    yield found
    found.shut_for_good()


@pytest.fixture
def redis_server(redis_server_session: RedisServer) -> Iterator[RedisServer]:
    """The test server, up; one that a test stopped is started again afterwards."""
    if not redis_server_session.is_up():
        redis_server_session.start()
    yield redis_server_session
    if not redis_server_session.is_up():
        redis_server_session.start()
