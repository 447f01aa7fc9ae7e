"""`cpu_server_env` against vLLM 0.32's own CPU binding (``OMPProcessManager``), no engine.

vLLM's multiprocess CPU engine reserves cores for its engine core before it
binds each worker's OpenMP threads to the rest, and reserves one more a
local rank whenever a KV connector is configured. With `cpu_server_env`'s
environment, an engine with omnicache's connector must be bound exactly as
the same engine without a connector: the same reservation, the same cores
for each worker, the same cores left out.

Same gate as ``test_vllm_live``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import test_vllm_live as live

from omnicache.integrations.vllm.common import (
    RESERVED_CPU_ENV,
    cpu_server_env,
    store_kv_transfer_config,
)

pytestmark = live.pytestmark


def _binding(local_world_size: int, connector: bool) -> tuple[int, list[list[int]], list[int]]:
    import vllm.envs
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    vllm.envs.disable_envs_cache()
    config: Any = SimpleNamespace(
        parallel_config=SimpleNamespace(
            local_world_size=local_world_size,
            data_parallel_rank_local=None,
            _api_process_count=1,
        ),
        kv_transfer_config=store_kv_transfer_config() if connector else None,
    )
    manager = OMPProcessManager(config)
    return manager.reserve_cpu_num, manager.cpu_lists, manager.reserved_cpu_list


def test_omnicaches_connector_is_bound_as_an_engine_without_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    monkeypatch.delenv(RESERVED_CPU_ENV, raising=False)
    without = _binding(1, connector=False)
    doubled = _binding(1, connector=True)
    # vLLM reserves one more core a local rank for any connector.
    assert (without[0], doubled[0]) == (1, 2)
    for name, value in cpu_server_env().items():
        monkeypatch.setenv(name, value)
    assert _binding(1, connector=True) == without


@pytest.mark.parametrize("local_world_size", [1, 2, 4])
def test_the_reservation_is_vllms_without_a_connector_at_every_local_world_size(
    local_world_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Binding lists named by hand (as tensor-parallel engines on one NUMA node
    # need): vLLM still computes its reservation, and binds nothing here.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    monkeypatch.delenv(RESERVED_CPU_ENV, raising=False)
    without = _binding(local_world_size, connector=False)[0]
    assert without == local_world_size
    assert _binding(local_world_size, connector=True)[0] == 2 * local_world_size
    for name, value in cpu_server_env(local_world_size).items():
        monkeypatch.setenv(name, value)
    assert _binding(local_world_size, connector=True)[0] == without


def test_cpu_server_env_refuses_what_is_no_local_world_size() -> None:
    assert cpu_server_env() == {RESERVED_CPU_ENV: "1"}
    assert cpu_server_env(4) == {RESERVED_CPU_ENV: "4"}
    for bad in (0, -1, True, 1.0, "1"):
        with pytest.raises(ValueError, match=r"local_world_size: expected an int >= 1, found"):
            cpu_server_env(bad)  # type: ignore[arg-type]
