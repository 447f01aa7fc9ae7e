"""RedisTier write and read speed on loopback, against raw redis-py on the same bytes.

Workload: ``--blocks`` blocks (512) of ``--block-size`` tokens (16) x
``--hidden`` (4096) bf16 hidden states: 128 KiB of rows per block, 64 MiB per
round. Every value is one Redis string of ``omnicache.tiers.codec``'s format
(rows plus a header of about a hundred bytes); GB/s count the rows only.

Rows, measured in one process against one server:
  write raw SET             redis-py pipelines (transaction=False) of SET, the
                            values pre-built (the very bytes the tier stores),
                            cut into batches as the tier cuts them
                            (``batch_bytes``), executed one after another
  write RedisTier           ``put`` of every block, then ``flush``: from the
                            first put until flush returns (copy on the
                            caller's thread, checksums and pipelines on the
                            tier's writer thread)
  write RedisTier put only  the same write's ``put`` call alone: how long the
                            caller is held
  write TensorStore         ``write_blocks`` of every block with their keys
                            into a store with the tier, then ``flush``: the
                            store's copy plus the tier's write
  read raw MGET             one MGET of every value: bytes only
  read RedisTier get        one ``get`` of every key: MGET, then every value
                            checked (header, length, checksum) and viewed as a
                            tensor
  read TensorStore          ``read_through`` of every key into the store: the
                            tier's get plus the copy into the store's blocks
                            and the stamps

Every write row starts from a server without the benchmark's keys (they are
deleted, untimed, before each write), so each write creates fresh keys. Reads
then find every value written by the round's last writer; all writers store
the same bytes. Variants alternate their order each round (the raw variant
first on even rounds, last on odd ones); times are medians over ``--reps``
rounds, and "vs raw" is the median of each round's raw time over the
variant's time (above 1: faster than raw).

The tier runs with its defaults except a socket timeout of 10 s (a round moves
tens of MiB) and a ``max_pending_bytes`` that holds a whole round's write;
``--batch-bytes`` sets its ``batch_bytes``. The second line of the output says
how redis-py talks to the server: with hiredis installed it parses replies
with hiredis and also packs commands with it, which copies every value.

Targets: the tier's write (put + flush) >= 70% of raw SET's GB/s; the tier's
get >= 70% of raw MGET's GB/s.

By default a private ``redis-server`` runs on a free loopback port with
``--save '' --appendonly no`` and is stopped at the end. With ``--url`` an
existing server is used; only the benchmark's own keys (a namespace unique to
this process) are written and deleted. Usage:

    python benchmarks/bench_redis_tier.py [--blocks N] [--hidden H]
        [--block-size B] [--reps R] [--url redis://host:port/db] [--auth] [--check]

``--auth`` gives the tier an ``auth_key``: values carry a keyed BLAKE3 MAC in
place of the xxh3_128 checksum (the raw rows then SET the same keyed values).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from importlib.metadata import version
from typing import Any

import redis
import torch

from omnicache.block_hash import BlockHash
from omnicache.store import HIDDEN_STATES, TensorStore, TierBlock
from omnicache.tiers import codec
from omnicache.tiers.base import value_key
from omnicache.tiers.redis import RedisTier

WRITE_TARGET = 0.70
READ_TARGET = 0.70
# Generous: a round moves tens of MiB, and a timeout would read as a fault.
SOCKET_TIMEOUT_S = 10.0


@contextlib.contextmanager
def private_server() -> Iterator[str]:
    """A ``redis-server`` on a free loopback port, stopped on exit (also on error).

    Returns:
        Its URL.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server: expected on PATH, found none (or pass --url)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        probe = redis.Redis.from_url(url, socket_timeout=1.0)
        deadline = time.monotonic() + 10.0
        while True:
            try:
                probe.ping()
                break
            except redis.ConnectionError:
                code = proc.poll()
                if code is not None or time.monotonic() > deadline:
                    found = "no answer in 10 s" if code is None else f"exit status {code}"
                    raise SystemExit(
                        f"redis-server on port {port}: expected to answer PING, found {found}"
                    ) from None
                time.sleep(0.05)
        probe.close()
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def client_text(client: redis.Redis) -> str:
    """How ``client`` speaks to the server: protocol, reply parser, command packer."""
    from redis.utils import HIREDIS_AVAILABLE

    hiredis = f"hiredis {version('hiredis')}" if HIREDIS_AVAILABLE else "hiredis not installed"
    # NOTE: redis-py picks the parser per connection (RESP2 or RESP3, hiredis
    # when importable), so ask one rather than the module defaults.
    pool = client.connection_pool
    conn = pool.connection_class(**pool.connection_kwargs)  # not connected
    parts = [
        f"RESP{getattr(conn, 'protocol', '?')}",
        f"parser {type(getattr(conn, '_parser', None)).__name__}",
        f"packer {type(getattr(conn, '_command_packer', None)).__name__}",
    ]
    return f"redis-py {redis.__version__} ({hiredis}): {', '.join(parts)}"


def batches(values: Sequence[bytes], batch_bytes: int) -> list[list[int]]:
    """Indexes of ``values`` cut as the tier's writer cuts its queue.

    NOTE: the same rule as ``RedisTier._next_batch``: a batch takes the next
    value, then more while the total stays within ``batch_bytes``.
    """
    out: list[list[int]] = []
    index = 0
    while index < len(values):
        batch = [index]
        size = len(values[index])
        index += 1
        while index < len(values) and size + len(values[index]) <= batch_bytes:
            size += len(values[index])
            batch.append(index)
            index += 1
        out.append(batch)
    return out


# A fixed key for --auth: the benchmark measures the MAC's cost, not its secrecy.
AUTH_KEY = bytes(range(32))


def run(args: argparse.Namespace, url: str) -> int:
    """Measures every row against the server at ``url`` and prints the table.

    Returns:
        The exit status (see `measure`).
    """
    num, bs, hidden = args.blocks, args.block_size, args.hidden
    dtype = torch.bfloat16
    namespace = f"bench-{os.getpid()}"
    payload = num * bs * hidden * dtype.itemsize
    # NOTE: a round's whole write is queued at once: the cap must not drop any of it.
    tier_kwargs: dict[str, Any] = {"max_pending_bytes": max(256 * 2**20, 2 * payload)}
    if args.batch_bytes:
        tier_kwargs["batch_bytes"] = args.batch_bytes
    if args.auth:
        tier_kwargs["auth_key"] = AUTH_KEY
    tier = RedisTier.from_url(
        url, namespace=namespace, socket_timeout_s=SOCKET_TIMEOUT_S, **tier_kwargs
    )
    raw = redis.Redis.from_url(
        url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=SOCKET_TIMEOUT_S
    )
    keys = [
        BlockHash(hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest())
        for i in range(num)
    ]
    names = [value_key(tier.prefix, tier.namespace, key, HIDDEN_STATES) for key in keys]
    try:
        return measure(args, tier, raw, keys, names)
    finally:
        # NOTE: on an existing server (--url) leave nothing behind, also on error.
        tier.close()
        with contextlib.suppress(redis.RedisError):
            raw.delete(*names)
        raw.close()


def measure(
    args: argparse.Namespace,
    tier: RedisTier,
    raw: redis.Redis,
    keys: list[BlockHash],
    names: list[str],
) -> int:
    """Checks, then times every row; prints the table.

    Args:
        args: The command line.
        tier: The tier under test.
        raw: A plain client of the same server.
        keys: A block key per block.
        names: The Redis key of each block's value.

    Returns:
        The exit status: 1 when the tier counted a fault or rejection, or
        when ``--check`` and a target is missed.
    """
    num, bs, hidden = args.blocks, args.block_size, args.hidden
    dtype = torch.bfloat16
    store = TensorStore(num, bs, hidden_size=hidden, hidden_dtype=dtype, tier=tier)
    entries = [store.entries[HIDDEN_STATES]]
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(num * bs, hidden, generator=gen).to(dtype)
    block_rows = src.view(num, bs, hidden)
    block_ids = list(range(num))
    auth_key = AUTH_KEY if args.auth else None
    values = [
        codec.encode(key, HIDDEN_STATES, block_rows[i], auth_key=auth_key)
        for i, key in enumerate(keys)
    ]
    raw_batches = [
        [(names[i], values[i]) for i in batch] for batch in batches(values, tier.batch_bytes)
    ]
    tier_blocks = [TierBlock(key, HIDDEN_STATES, block_rows[i]) for i, key in enumerate(keys)]
    payload = src.numel() * src.element_size()

    def drop_keys() -> None:
        raw.delete(*names)

    def flushed() -> None:
        if not tier.flush(timeout_s=60.0):
            raise SystemExit("RedisTier.flush: expected the queue drained within 60 s")

    # Each write variant returns (seconds, seconds the caller was held).
    def write_raw() -> tuple[float, float]:
        start = time.perf_counter()
        for batch in raw_batches:
            pipe = raw.pipeline(transaction=False)
            for name, value in batch:
                pipe.set(name, value)
            pipe.execute()
        seconds = time.perf_counter() - start
        return seconds, seconds

    def write_tier() -> tuple[float, float]:
        start = time.perf_counter()
        tier.put(tier_blocks)
        put_done = time.perf_counter()
        flushed()
        return time.perf_counter() - start, put_done - start

    def write_store() -> tuple[float, float]:
        start = time.perf_counter()
        store.write_blocks(HIDDEN_STATES, src, block_ids, block_keys=keys)
        written = time.perf_counter()
        flushed()
        return time.perf_counter() - start, written - start

    def read_raw() -> int:
        found = raw.mget(names)
        return sum(value is not None for value in found)

    def read_tier() -> int:
        return len(tier.get(keys, entries, bs))

    def read_store() -> int:
        return store.read_through(block_ids, keys)

    writes: dict[str, Callable[[], tuple[float, float]]] = {
        "raw SET": write_raw,
        "RedisTier put + flush": write_tier,
        "TensorStore write_blocks + flush": write_store,
    }
    reads: dict[str, Callable[[], int]] = {
        "raw MGET": read_raw,
        "RedisTier get": read_tier,
        "TensorStore read_through": read_store,
    }

    # Correctness before speed: every variant writes the same bytes, and every
    # read finds every block with the rows written.
    for name, write in writes.items():
        drop_keys()
        before = tier.stats.num_written_values
        write()
        if raw.mget(names) != values:
            raise SystemExit(f"write {name}: the stored values differ from codec.encode's")
        written = tier.stats.num_written_values - before
        if name != "raw SET" and written != num:
            raise SystemExit(f"write {name}: expected {num} values written, found {written}")
    run_rows = tier.get(keys, entries, bs)
    if len(run_rows) != num or not all(
        torch.equal(rows[HIDDEN_STATES], block_rows[i]) for i, rows in enumerate(run_rows)
    ):
        raise SystemExit(f"RedisTier.get: expected the {num} blocks written, found others")
    # Unkeyed zeros (not offered to the tier): the rows read back must come from it.
    store.write_blocks(HIDDEN_STATES, torch.zeros_like(src), block_ids)
    if read_store() != num or not torch.equal(
        store.read_blocks(HIDDEN_STATES, block_ids, keys), src
    ):
        raise SystemExit(f"read_through: expected the {num} blocks written, found others")
    del run_rows

    write_times: dict[str, list[float]] = {name: [] for name in writes}
    held_times: dict[str, list[float]] = {name: [] for name in writes}
    read_times: dict[str, list[float]] = {name: [] for name in reads}
    for rnd in range(args.reps):
        write_order = list(writes) if rnd % 2 == 0 else list(reversed(writes))
        for name in write_order:
            drop_keys()
            before = tier.stats.num_written_values
            seconds, held = writes[name]()
            written = tier.stats.num_written_values - before
            if name != "raw SET" and written != num:
                raise SystemExit(f"write {name}: expected {num} values written, found {written}")
            write_times[name].append(seconds)
            held_times[name].append(held)
        read_order = list(reads) if rnd % 2 == 0 else list(reversed(reads))
        for name in read_order:
            start = time.perf_counter()
            found = reads[name]()
            read_times[name].append(time.perf_counter() - start)
            if found != num:
                raise SystemExit(f"read {name}: expected {num} blocks found, found {found}")

    def vs(samples: list[float], reference: list[float]) -> float:
        return statistics.median(r / t for r, t in zip(reference, samples, strict=True))

    # label -> (seconds per round, the raw variant's seconds in the same rounds)
    samples: dict[str, tuple[list[float], list[float]]] = {
        **{f"write {name}": (times, write_times["raw SET"]) for name, times in write_times.items()},
        "write RedisTier put only": (held_times["RedisTier put + flush"], write_times["raw SET"]),
        **{f"read {name}": (times, read_times["raw MGET"]) for name, times in read_times.items()},
    }

    info = raw.info("server")
    print(
        f"RedisTier on loopback: {num} blocks x {bs} tokens x {hidden} "
        f"{codec.dtype_name(dtype)} ({payload // num // 1024} KiB per block, "
        f"{payload / 2**20:.0f} MiB per round), batch {tier.batch_bytes / 2**20:g} MiB, "
        f"median of {args.reps} rounds"
    )
    print(f"redis-server {info.get('redis_version', '?')}, {client_text(tier.client)}")
    print(f"{'operation':<40} {'ms/round':>9} {'GB/s':>7} {'vs raw':>7}")
    for label, (times, reference) in samples.items():
        seconds = statistics.median(times)
        print(
            f"{label:<40} {seconds * 1e3:9.1f} {payload / seconds / 1e9:7.2f} "
            f"{vs(times, reference):7.2f}"
        )

    stats = tier.stats
    problems = {
        "rejected": stats.num_rejected_values,
        "read errors": stats.num_read_errors,
        "write errors": stats.num_write_errors,
        "dropped": stats.num_dropped_values,
        "oversize": stats.num_oversize_values,
        "faults": stats.num_faults,
        "skipped": stats.num_skipped_calls,
    }
    print(
        f"tier stats: {stats.num_put_values} put, {stats.num_written_values} written, "
        f"{stats.num_hit_blocks}/{stats.num_get_blocks} blocks hit; "
        + ", ".join(f"{count} {what}" for what, count in problems.items())
        + ("  (ok)" if not any(problems.values()) else "  (NOT ok)")
    )
    write_ratio = vs(*samples["write RedisTier put + flush"])
    read_ratio = vs(*samples["read RedisTier get"])
    checks = [
        (f"tier write >= {WRITE_TARGET:.0%} of raw SET", write_ratio, write_ratio >= WRITE_TARGET),
        (f"tier get >= {READ_TARGET:.0%} of raw MGET", read_ratio, read_ratio >= READ_TARGET),
    ]
    for label, value, ok in checks:
        print(f"target {label:<36} {value:6.2f}  {'met' if ok else 'MISSED'}")
    healthy = not any(problems.values())
    return 1 if not healthy or (args.check and not all(ok for _, _, ok in checks)) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=11, help="rounds")
    parser.add_argument(
        "--batch-bytes", type=int, default=0, help="the tier's batch_bytes (0: its default)"
    )
    parser.add_argument(
        "--url", default=None, help="an existing server (default: start a private one)"
    )
    parser.add_argument(
        "--auth", action="store_true", help="the tier signs and checks values with an auth_key"
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    for what in ("blocks", "hidden", "block_size", "reps"):
        if getattr(args, what) < 1:
            parser.error(f"--{what.replace('_', '-')}: expected >= 1, found {getattr(args, what)}")
    if args.url is not None:
        return run(args, args.url)
    with private_server() as url:
        return run(args, url)


if __name__ == "__main__":
    sys.exit(main())
