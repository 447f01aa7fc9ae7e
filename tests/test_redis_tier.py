"""RedisTier against a real server: faults, eviction, TTLs, write-behind, and two processes.

Fault tests stop, pause and restart the test server (tests/redis_server.py);
the fixture starts it again if a test leaves it down.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import redis
import torch
from helpers import key
from redis_server import (
    SCRIPT,
    SERVER_VARIABLE,
    RedisServer,
    ServerStartError,
    no_server,
    start_cluster,
)

from omnicache.demo import cli
from omnicache.demo.processor import Processor
from omnicache.demo.workloads import synthetic_trace
from omnicache.store import EntrySpec, TensorStore, TierBlock
from omnicache.tiers import codec
from omnicache.tiers.base import value_key
from omnicache.tiers.redis import RedisTier

ROOT = Path(__file__).resolve().parents[1]
BS = 4
HIDDEN = EntrySpec("hidden_states", (8,), torch.float32, False, 0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def rows(i: int) -> torch.Tensor:
    return torch.arange(BS * 8, dtype=torch.float32).reshape(BS, 8) + 100 * i


def put(tier: RedisTier, indices: list[int]) -> None:
    tier.put([TierBlock(key(i), HIDDEN.name, rows(i)) for i in indices])


def hits(tier: RedisTier, indices: list[int]) -> list[int]:
    """Indices of the leading blocks found, each checked against its rows."""
    found = tier.get([key(i) for i in indices], [HIDDEN], BS)
    for got, i in zip(found, indices, strict=False):
        assert torch.equal(got[HIDDEN.name], rows(i))
    return indices[: len(found)]


@pytest.fixture
def namespace() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def tier(redis_server: RedisServer, namespace: str, clock: FakeClock) -> Iterator[RedisTier]:
    t = RedisTier.from_url(
        redis_server.url, namespace=namespace, retry_after_s=5.0, clock=clock, socket_timeout_s=0.3
    )
    yield t
    t.close(2)


# -- faults ---------------------------------------------------------------------------


def test_a_stopped_server_costs_misses_and_the_tier_comes_back(
    tier: RedisTier,
    redis_server: RedisServer,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    put(tier, [1, 2])
    assert tier.flush(5)
    assert hits(tier, [1, 2]) == [1, 2]
    redis_server.stop()
    with caplog.at_level(logging.WARNING, logger="omnicache.tiers.redis"):
        assert hits(tier, [1, 2]) == []
        # Backing off: answered without asking.
        assert hits(tier, [1, 2]) == []
        put(tier, [3])
        assert not tier.flush(0.3)
    stats = tier.stats
    assert (stats.num_read_errors, stats.num_skipped_calls, stats.num_faults) == (1, 1, 1)
    assert (stats.num_put_values, stats.num_written_values, stats.num_write_errors) == (3, 2, 0)
    assert stats.num_pending_bytes == len(codec.encode(key(3), HIDDEN.name, rows(3)))
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert warnings[0].startswith("redis tier: read failed (ConnectionError: ")
    assert warnings[0].endswith("serving misses, retrying in 5.0 s")

    caplog.clear()
    redis_server.start()
    clock.now += 5.0
    with caplog.at_level(logging.WARNING, logger="omnicache.tiers.redis"):
        # The restarted server kept nothing (no persistence): a plain miss.
        assert hits(tier, [1]) == []
        # The value queued while it was down goes out now.
        assert tier.flush(5)
        assert hits(tier, [3]) == [3]
    stats = tier.stats
    assert (stats.num_reconnects, stats.num_faults, stats.num_read_errors) == (1, 1, 1)
    assert (stats.num_written_values, stats.num_write_errors, stats.num_pending_bytes) == (3, 0, 0)
    assert [r.getMessage() for r in caplog.records] == [
        "redis tier: server answers again; reads and writes resume"
    ]


def test_writes_to_a_stopped_server_are_counted_losses(
    tier: RedisTier, redis_server: RedisServer, clock: FakeClock
) -> None:
    put(tier, [1])
    assert tier.flush(5)
    redis_server.stop()
    put(tier, [2, 3])
    # The writer tries once, fails, and backs off: the values it held are lost.
    deadline = time.monotonic() + 10
    while tier.stats.num_faults == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tier.flush(5)
    stats = tier.stats
    assert (stats.num_written_values, stats.num_write_errors, stats.num_faults) == (1, 2, 1)
    redis_server.start()
    clock.now += 5.0
    assert hits(tier, [2]) == []
    put(tier, [2])
    assert tier.flush(5)
    assert hits(tier, [2]) == [2]
    assert tier.stats.num_reconnects == 1


def test_a_slow_server_is_a_miss_within_the_timeout(
    tier: RedisTier, redis_server: RedisServer, clock: FakeClock
) -> None:
    put(tier, [1])
    assert tier.flush(5)
    pauser = redis_server.client()
    pauser.execute_command("CLIENT", "PAUSE", 1500, "ALL")
    t0 = time.monotonic()
    assert hits(tier, [1]) == []
    waited = time.monotonic() - t0
    stats = tier.stats
    assert (stats.num_read_errors, stats.num_faults) == (1, 1)
    # One socket timeout (0.3 s), no retry of a timed-out command.
    assert 0.25 < waited < 1.2
    pauser.execute_command("CLIENT", "UNPAUSE")
    clock.now += 5.0
    assert hits(tier, [1]) == [1]
    assert tier.stats.num_reconnects == 1


def test_a_server_restarted_between_calls_is_reconnected_at_once(
    tier: RedisTier, redis_server: RedisServer
) -> None:
    """Pooled connections die with the server; the next call opens a new one."""
    put(tier, [1])
    assert tier.flush(5)
    assert hits(tier, [1]) == [1]
    redis_server.stop()
    redis_server.start()
    assert hits(tier, [1]) == []
    put(tier, [1])
    assert tier.flush(5)
    assert hits(tier, [1]) == [1]
    stats = tier.stats
    assert (stats.num_faults, stats.num_read_errors, stats.num_write_errors) == (0, 0, 0)


def test_nothing_raises_into_the_caller_while_the_server_flaps(
    tier: RedisTier, redis_server: RedisServer, clock: FakeClock
) -> None:
    """A store serving through a tier whose server stops and starts under it.

    Rounds alternate: server up (writes land, reads hit), server down (the
    write is lost and counted, the read is a miss). The clock moves past the
    back-off before each round.
    """
    writer = TensorStore(64, BS, hidden_size=8, hidden_dtype=torch.float32, tier=tier)
    served = 0
    for round_ in range(6):
        down = round_ % 2 == 1
        if down:
            redis_server.stop()
        elif round_:
            redis_server.start()
        clock.now += 10.0
        indices = [round_ * 8 + b for b in range(8)]
        hs = torch.cat([rows(i) for i in indices])
        writer.write_blocks(HIDDEN.name, hs, list(range(8)), block_keys=[key(i) for i in indices])
        assert tier.flush(5)
        reader = TensorStore(64, BS, hidden_size=8, hidden_dtype=torch.float32, tier=tier)
        n = reader.read_through(list(range(8)), [key(i) for i in indices])
        assert n == (0 if down else 8)
        if n:
            got = reader.read_blocks(HIDDEN.name, list(range(8)), [key(i) for i in indices])
            assert torch.equal(got, hs)
        served += n
    assert served == 24
    assert writer.stats.num_tier_errors == 0
    stats = tier.stats
    assert (stats.num_written_values, stats.num_write_errors) == (24, 24)
    # Each down round: the write fails (a fault), then the read is skipped.
    assert (stats.num_faults, stats.num_skipped_calls, stats.num_read_errors) == (3, 3, 0)
    assert (stats.num_reconnects, stats.num_rejected_values) == (2, 0)


# -- eviction and expiry ---------------------------------------------------------------


@pytest.fixture
def private_server(tmp_path: Path, redis_binary: str) -> Iterator[RedisServer]:
    """A fresh server of the test's own, stopped afterwards; one that does not start
    fails or skips as the shared one does (``no_server``)."""
    # NOTE: started in a fixture, not in the test: pytest reports a fixture's
    # skip at the test's line, a test's own at the line of pytest.skip.
    try:
        server = RedisServer.start_private(tmp_path / "redis", redis_binary)
    except ServerStartError as exc:
        no_server(str(exc))
    yield server
    server.shut_for_good()


def test_maxmemory_eviction_leaves_misses_never_mixed_blocks(private_server: RedisServer) -> None:
    client = private_server.client()
    client.config_set("maxmemory", 2 * 1024 * 1024)
    client.config_set("maxmemory-policy", "allkeys-random")
    entries = [EntrySpec(f"layer{j}", (2048,), torch.float32, False, 0) for j in range(3)]
    tier = RedisTier.from_url(private_server.url, namespace="evict")
    n = 64
    data = {
        (i, e.name): torch.full((BS, 2048), float(i * 10 + j))
        for i in range(n)
        for j, e in enumerate(entries)
    }
    for i in range(n):
        tier.put([TierBlock(key(i), e.name, data[i, e.name]) for e in entries])
        assert tier.flush(10)
    assert tier.stats.num_written_values == 3 * n
    # NOTE: replies count against maxmemory too, so reads near the limit
    # evict more; lift it to check against a fixed set of survivors.
    client.config_set("maxmemory", 0)
    present = [
        all(client.exists(value_key("omnicache", "evict", key(i), e.name)) for e in entries)
        for i in range(n)
    ]
    # 6 MiB written into 2 MiB: most blocks lost some value.
    assert sum(present) < n // 2
    expected_run = present.index(False) if False in present else n
    found = tier.get([key(i) for i in range(n)], entries, BS)
    assert len(found) == expected_run
    for i, got in enumerate(found):
        for e in entries:
            assert torch.equal(got[e.name], data[i, e.name])
    # Every block still whole is served on its own.
    for i in range(n):
        assert len(tier.get([key(i)], entries, BS)) == int(present[i])
    assert tier.stats.num_rejected_values == 0
    tier.close(2)


def test_a_full_server_under_noeviction_refuses_writes_counted(
    private_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    client = private_server.client()
    client.config_set("maxmemory-policy", "noeviction")
    tier = RedisTier.from_url(private_server.url, namespace="full", retry_after_s=60.0)
    put(tier, [1])
    assert tier.flush(5)
    # Memory now counts as full: every further SET is refused with OOM.
    client.config_set("maxmemory", 1)
    with caplog.at_level(logging.WARNING, logger="omnicache.tiers.redis"):
        put(tier, [2, 3])
        assert tier.flush(5)
    stats = tier.stats
    assert (stats.num_written_values, stats.num_write_errors, stats.num_faults) == (1, 2, 0)
    [message] = [r.getMessage() for r in caplog.records]
    assert message.startswith("redis tier: server refused 2 of 2 writes (")
    assert "command not allowed when used memory > 'maxmemory'" in message
    # No outage: reads are not held back, and what was stored is served.
    assert hits(tier, [1, 2]) == [1]
    assert tier.stats.num_skipped_calls == 0
    tier.close(2)


def test_values_carry_the_ttl(redis_server: RedisServer, namespace: str) -> None:
    tier = RedisTier.from_url(redis_server.url, namespace=namespace, ttl_s=30)
    try:
        put(tier, [1])
        assert tier.flush(5)
        ttl = redis_server.client().ttl(value_key("omnicache", namespace, key(1), HIDDEN.name))
        assert 28 <= ttl <= 30
    finally:
        tier.close(2)


def test_an_expired_value_is_a_miss(redis_server: RedisServer, namespace: str) -> None:
    tier = RedisTier.from_url(redis_server.url, namespace=namespace, ttl_s=30)
    try:
        put(tier, [1, 2])
        assert tier.flush(5)
        name = value_key("omnicache", namespace, key(2), HIDDEN.name)
        assert redis_server.client().pexpire(name, 1)
        time.sleep(0.05)
        assert hits(tier, [1, 2]) == [1]
    finally:
        tier.close(2)


# -- write-behind ------------------------------------------------------------------------


def test_put_returns_before_the_server_has_the_value(
    redis_server: RedisServer, namespace: str
) -> None:
    tier = RedisTier.from_url(redis_server.url, namespace=namespace, socket_timeout_s=5)
    pauser = redis_server.client()
    try:
        pauser.execute_command("CLIENT", "PAUSE", 1000, "WRITE")
        t0 = time.monotonic()
        put(tier, [1])
        assert time.monotonic() - t0 < 0.2
        assert tier.stats.num_written_values == 0
        assert tier.flush(5)
        assert tier.stats.num_written_values == 1
    finally:
        pauser.execute_command("CLIENT", "UNPAUSE")
        tier.close(2)


def test_a_full_queue_drops_and_counts(
    redis_server: RedisServer, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    value_size = len(codec.encode(key(1), HIDDEN.name, rows(1)))
    tier = RedisTier.from_url(
        redis_server.url, namespace=namespace, max_pending_bytes=2 * value_size, socket_timeout_s=5
    )
    pauser = redis_server.client()
    try:
        # The writer blocks on its first batch while writes are paused.
        pauser.execute_command("CLIENT", "PAUSE", 1000, "WRITE")
        with caplog.at_level(logging.WARNING, logger="omnicache.tiers.redis"):
            put(tier, [1, 2, 3, 4])
        stats = tier.stats
        assert (stats.num_put_values, stats.num_dropped_values) == (4, 2)
        assert "2 values not written: write-behind queue full" in caplog.text
        pauser.execute_command("CLIENT", "UNPAUSE")
        assert tier.flush(5)
        assert tier.stats.num_written_values == 2
        assert hits(tier, [1, 2, 3]) == [1, 2]
    finally:
        tier.close(2)


def test_close_writes_what_is_queued_and_later_puts_are_dropped(
    redis_server: RedisServer, namespace: str
) -> None:
    tier = RedisTier.from_url(redis_server.url, namespace=namespace)
    put(tier, list(range(20)))
    tier.close(10)
    assert tier.stats.num_written_values == 20
    put(tier, [21])
    assert tier.stats.num_dropped_values == 1
    assert hits(tier, list(range(20))) == list(range(20))


def test_concurrent_puts_and_gets_from_threads(redis_server: RedisServer, namespace: str) -> None:
    tier = RedisTier.from_url(redis_server.url, namespace=namespace)
    errors: list[BaseException] = []

    def work(offset: int) -> None:
        try:
            for i in range(offset, offset + 50):
                put(tier, [i])
                hits(tier, [i])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k * 100,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert tier.flush(5)
    assert tier.stats.num_written_values == 200
    assert all(hits(tier, [k * 100 + i for i in range(50)]) for k in range(4))
    tier.close(2)


def test_a_client_that_is_not_redis_is_refused() -> None:
    with pytest.raises(TypeError, match=r"client: expected redis\.Redis or redis\.cluster"):
        RedisTier(object(), namespace="x")


def test_unreachable_at_start_is_only_misses(namespace: str) -> None:
    tier = RedisTier.from_url("redis://127.0.0.1:1/0", namespace=namespace, socket_timeout_s=0.2)
    try:
        assert tier.get([key(1)], [HIDDEN], BS) == []
        put(tier, [1])
        assert tier.flush(5)
        stats = tier.stats
        assert (stats.num_read_errors, stats.num_write_errors, stats.num_written_values) == (
            1,
            1,
            0,
        )
    finally:
        tier.close(1)
    assert isinstance(tier.client, redis.Redis)


# -- two engine processes ------------------------------------------------------------------

_ENGINE = """
import json, sys
from omnicache.demo.cli import QUICK_MODEL, QUICK_TRACE
from omnicache.demo.config import CacheConfig
from omnicache.demo.engine import ServingEngine
from omnicache.demo.model import TinyOmniModel
from omnicache.demo.oracle import run_cached
from omnicache.demo.processor import Processor
from omnicache.demo.workloads import synthetic_trace
from omnicache.tiers.redis import RedisTier

url, namespace = sys.argv[1], sys.argv[2]
trace = synthetic_trace(QUICK_TRACE, seed=3)
model = TinyOmniModel(QUICK_MODEL)
processor = Processor(QUICK_MODEL)
config = CacheConfig(num_blocks=160, block_size=16)
tier = RedisTier.from_url(url, namespace=namespace)
engine = ServingEngine(model, processor, config, tier=tier)
report = run_cached(model, processor, trace, config, [], engine=engine)
tier.close()
prompts = [processor.annotate(processor.tokenize(r.messages)) for r in trace.requests]
cap = sum((len(p) - 1) // 16 * 16 for p in prompts)
stats = tier.stats
print(json.dumps({
    "hit": report.num_hit_tokens, "tier_hit": report.num_tier_hit_tokens,
    "best_local": report.num_best_hit_tokens, "cap": cap,
    "mismatches": report.num_mismatches, "stale": report.num_stale_reads,
    "written": stats.num_written_values, "rejected": stats.num_rejected_values,
    "faults": stats.num_faults, "evictions": report.num_evictions,
}))
"""


def _engine_run(url: str, namespace: str) -> dict[str, int]:
    result = subprocess.run(
        [sys.executable, "-c", _ENGINE, url, namespace],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    out: dict[str, int] = json.loads(result.stdout.strip().splitlines()[-1])
    return out


def test_a_second_engine_process_hits_what_the_first_computed(
    redis_server: RedisServer, namespace: str
) -> None:
    first = _engine_run(redis_server.url, namespace)
    second = _engine_run(redis_server.url, namespace)
    for run in (first, second):
        assert (run["mismatches"], run["stale"], run["rejected"], run["faults"]) == (0, 0, 0, 0)
    # The first engine's pool holds every block of this trace: its hits are local.
    assert first["hit"] == first["best_local"]
    assert first["tier_hit"] == 0
    assert first["written"] > 0
    # The second starts empty and hits every prompt up to its cap (the last
    # token is always computed): locally what its own earlier requests left in
    # its pool (as in the first run), from the tier the rest.
    assert second["hit"] == second["cap"]
    assert second["tier_hit"] == second["cap"] - first["best_local"]
    assert second["tier_hit"] > 1000
    assert first["evictions"] == second["evictions"] == 0


# -- Redis Cluster ----------------------------------------------------------------------------


@pytest.fixture
def cluster(tmp_path: Path, redis_binary: str) -> Iterator[list[RedisServer]]:
    """Three masters on loopback; no binary, or a node that does not start, fails or
    skips as the shared server does (``no_server``); a cluster that does not form
    fails."""
    try:
        nodes = start_cluster(tmp_path, redis_binary)
    except ServerStartError as exc:
        no_server(str(exc))
    yield nodes
    for node in nodes:
        node.shut_for_good()


def test_a_cluster_spreads_blocks_over_its_nodes(
    cluster: list[RedisServer], namespace: str, clock: FakeClock
) -> None:
    tier = RedisTier.from_url(
        cluster[0].url, namespace=namespace, cluster=True, retry_after_s=5.0, clock=clock
    )
    try:
        writer = TensorStore(64, BS, hidden_size=8, hidden_dtype=torch.float32, tier=tier)
        hs = torch.cat([rows(i) for i in range(64)])
        keys = [key(i) for i in range(64)]
        writer.write_blocks(HIDDEN.name, hs, list(range(64)), block_keys=keys)
        assert tier.flush(10)
        per_node = [node.client().dbsize() for node in cluster]
        assert sum(per_node) == 64
        assert min(per_node) > 0
        reader = TensorStore(64, BS, hidden_size=8, hidden_dtype=torch.float32, tier=tier)
        assert reader.read_through(list(range(64)), keys) == 64
        assert torch.equal(reader.read_blocks(HIDDEN.name, list(range(64)), keys), hs)
        # A node down: its slots cannot answer, so the read is a miss, not an error.
        cluster[2].stop()
        assert reader.read_through(list(range(64)), keys) == 0
        stats = tier.stats
        assert (stats.num_read_errors, stats.num_faults, stats.num_rejected_values) == (1, 1, 0)
    finally:
        tier.close(2)


def test_a_long_read_is_cut_into_mgets_that_stop_at_a_miss(
    redis_server: RedisServer, namespace: str
) -> None:
    block_bytes = BS * 8 * 4
    tier = RedisTier.from_url(
        redis_server.url, namespace=namespace, read_batch_bytes=3 * block_bytes
    )
    client = redis_server.client()
    try:
        put(tier, list(range(10)))
        assert tier.flush(5)
        client.delete(value_key("omnicache", namespace, key(7), HIDDEN.name))
        before = int(client.info("stats")["total_commands_processed"])
        # MGETs of 3 blocks: 0-2, 3-5, then 6-8 comes back short at 7.
        assert hits(tier, list(range(10))) == list(range(7))
        after = int(client.info("stats")["total_commands_processed"])
        # Three MGETs, plus the INFO that read the first count.
        assert after - before == 4
        stats = tier.stats
        assert (stats.num_get_calls, stats.num_get_blocks, stats.num_hit_blocks) == (1, 10, 7)
    finally:
        tier.close(2)


# -- the command line ----------------------------------------------------------------------

_QUICK = ["demo", "--quick", "--requests", "10"]


def _cli_row(out: str, name: str) -> int:
    match = re.search(rf"^  {re.escape(name)}\s+([\d,]+)", out, re.MULTILINE)
    assert match is not None, f"no row {name!r} in:\n{out}"
    return int(match.group(1).replace(",", ""))


def test_the_cli_shares_blocks_between_runs_through_redis(
    redis_server: RedisServer, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*_QUICK, "--redis", redis_server.url, "--redis-namespace", namespace]
    assert cli.main(argv) == cli.EXIT_OK
    first = capsys.readouterr().out
    assert cli.main(argv) == cli.EXIT_OK
    second = capsys.readouterr().out
    trace = synthetic_trace(replace(cli.QUICK_TRACE, num_requests=10), seed=0)
    processor = Processor(cli.QUICK_MODEL)
    prompts = [processor.annotate(processor.tokenize(r.messages)) for r in trace.requests]
    cap = sum((len(p) - 1) // 16 * 16 for p in prompts)
    for out in (first, second):
        assert _cli_row(out, "mismatches") == _cli_row(out, "stale reads") == 0
        assert f"redis tier {redis_server.url} (namespace {namespace}):" in out
        assert "values rejected 0, faults 0 (read errors 0, reconnects 0)" in out
    assert _cli_row(first, "hit tokens from the tier") == 0
    assert _cli_row(second, "hit tokens") == cap
    # Local hits are the same in both runs (each pool holds the whole trace).
    assert _cli_row(second, "hit tokens from the tier") == cap - _cli_row(first, "hit tokens")


def test_the_cli_with_redis_down_serves_every_request(
    namespace: str, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    argv = [*_QUICK, "--redis", "redis://127.0.0.1:1/0", "--redis-namespace", namespace]
    with caplog.at_level(logging.WARNING, logger="omnicache.tiers.redis"):
        assert cli.main(argv) == cli.EXIT_OK
    captured = capsys.readouterr()
    assert _cli_row(captured.out, "mismatches") == 0
    assert _cli_row(captured.out, "hit tokens from the tier") == 0
    assert "blocks found 0 of" in captured.out
    assert "values written 0, lost" in captured.out
    assert "redis tier: read failed (ConnectionError: " in caplog.text


def test_the_cli_prints_the_tiers_warnings_on_stderr() -> None:
    """In a process of its own, without logging configured."""
    result = subprocess.run(
        [sys.executable, "-m", "omnicache", *_QUICK, "--redis", "redis://127.0.0.1:1/0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == cli.EXIT_OK, result.stderr
    assert result.stderr.startswith("omnicache: redis tier: read failed (ConnectionError: ")


def test_the_cli_refuses_a_bad_redis_url(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([*_QUICK, "--redis", "not-a-url"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "omnicache: error: --redis: Redis URL must specify one of the following schemes" in err
    assert cli.main([*_QUICK, "--redis", "redis://127.0.0.1:1/0", "--redis-namespace", "a:b"]) == (
        cli.EXIT_USAGE
    )
    assert "omnicache: error: --redis: namespace: expected non-empty printable ASCII" in (
        capsys.readouterr().err
    )


def test_a_process_that_exits_without_close_still_writes_its_queue(
    redis_server: RedisServer, namespace: str
) -> None:
    code = (
        "import sys, torch\n"
        "from omnicache.store import TierBlock\n"
        "from omnicache.tiers.redis import RedisTier\n"
        "tier = RedisTier.from_url(sys.argv[1], namespace=sys.argv[2])\n"
        "tier.put([TierBlock(bytes([i]) * 32, 'h', torch.full((4, 8), float(i)))"
        " for i in range(50)])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, redis_server.url, namespace],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    names = [value_key("omnicache", namespace, bytes([i]) * 32, "h") for i in range(50)]
    assert redis_server.client().exists(*names) == 50


# -- the script that starts the test server ------------------------------------------------


def _script(command: str, folder: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), command, str(folder)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def bare_env(tmp_path: Path, redis_binary: str) -> dict[str, str]:
    """The environment with a PATH of only bash, mkdir, sleep and python3 (the list in
    the script's header): no seq, cat or redis-cli, which a machine may lack."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in ("bash", "mkdir", "sleep"):
        found = shutil.which(name)
        assert found is not None, f"no {name} on PATH"
        (tools / name).symlink_to(found)
    # The Python the script falls back on where the project's environment is missing.
    (tools / "python3").symlink_to(sys.executable)
    return {**os.environ, "PATH": str(tools), SERVER_VARIABLE: redis_binary}


@pytest.fixture
def started_by_script(
    tmp_path: Path, bare_env: dict[str, str], redis_binary: str
) -> Iterator[tuple[subprocess.CompletedProcess[str], RedisServer]]:
    """What ``start`` printed, and its server; one that does not start fails or skips
    as the shared one does (``no_server``)."""
    folder = tmp_path / "server"
    started = _script("start", folder, bare_env)
    if started.returncode != 0:
        no_server(f"redis-test-server.sh start failed: {started.stderr.strip()}")
    server = RedisServer(started.stdout.strip(), str(folder / "redis.conf"), folder, redis_binary)
    yield started, server
    server.shut_for_good()


def test_the_script_starts_and_stops_a_server_with_only_the_tools_it_names(
    started_by_script: tuple[subprocess.CompletedProcess[str], RedisServer],
    bare_env: dict[str, str],
) -> None:
    started, server = started_by_script
    folder = server.owned_dir
    assert folder is not None
    assert (started.stdout, started.stderr) == (f"redis://127.0.0.1:{server.port}/0\n", "")
    assert (folder / "redis.conf").read_text() == (
        f"bind 127.0.0.1\nport {server.port}\ndaemonize yes\npidfile {folder}/redis.pid\n"
        f'logfile {folder}/redis.log\ndir {folder}\nsave ""\nappendonly no\n'
    )
    assert server.client().ping() is True
    # What RedisServer.attach restarts a server from.
    assert server.client().info("server")["config_file"] == str(folder / "redis.conf")
    stopped = _script("stop", folder, bare_env)
    assert (stopped.returncode, stopped.stdout, stopped.stderr) == (0, "", "")
    # Shut down by SIGTERM (the server removes its pid file as it exits), and
    # nothing listens on the port any more.
    assert not (folder / "redis.pid").exists()
    with pytest.raises(redis.ConnectionError):
        server.client().ping()
