"""RedisTier: a `BlockTier` on Redis or Redis Cluster, shared by engine processes.

Block keys are content addressed and the same in every process, so an engine
that misses locally can take the blocks another engine computed. Each block's
entry is one Redis string (see `omnicache.tiers.codec` for the value)::

    {prefix}:{namespace}:{block key hex}:{entry}     e.g.
    omnicache:qwen2.5-omni-7b:3f9c...e1:hidden_states

Writes are behind: `put` copies each block's rows behind their header into a
reused buffer and queues it; a writer thread computes the checksums and sends
the values in pipelines of up to ``batch_bytes``, starting while `put` still
copies the rest. Reads go through: `get` asks for every entry of a run of
keys in one MGET (of about ``read_batch_bytes``, the next one only if this one
came back whole) and serves the leading blocks whose values all verify;
`count_held` asks only which leading blocks exist (``EXISTS``), for a
scheduler that decides what to load without moving the values.

Every value stands alone (no index, no set of members), so Redis may expire
(``ttl_s``) or evict (``maxmemory`` with an ``allkeys-*`` policy) any of them:
a block missing one entry is a miss, never part of an answer.

Faults. A command that fails (connection refused or reset, timed out, server
loading after a restart) is a miss for a read and a counted loss for a write;
the first fault of an outage logs a warning, and for ``retry_after_s`` the
tier answers misses without asking and holds its writes. The next call after that tries
again; redis-py opens new connections by itself, and the first success logs
that the tier is back. A write the server answers with an error (out of
memory under ``noeviction``, ...) is a counted loss with one warning, and no
fault: reads go on. Nothing raises into the caller, and nothing is served that
did not verify.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from omnicache.block_hash import BlockHash
from omnicache.checks import check_int, check_number, check_optional_int
from omnicache.store import EntrySpec, TierBlock
from omnicache.tiers import codec
from omnicache.tiers.base import TierStats, check_key_part, decode_run, value_key

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "omnicache.tiers.redis needs redis-py: pip install 'omnicache-mm[redis]'"
    ) from exc

__all__ = ["RedisTier"]

_log = logging.getLogger(__name__)

MiB = 1 << 20


class RedisTier:
    """Block values in Redis, written behind and read through.

    Args:
        client: A ``redis.Redis`` or ``redis.cluster.RedisCluster`` (see
            `from_url`, which sets timeouts fit for a serving path).
        namespace: Second part of every key: engines share blocks only
            within one namespace (a model, a deployment).
        prefix: First part of every key.
        ttl_s: Lifetime of each value in seconds (None: until evicted).
        max_value_bytes: Largest value written; larger ones are counted in
            ``num_oversize_values`` and never sent.
        max_pending_bytes: Cap on the bytes queued for writing; beyond it a
            value is counted in ``num_dropped_values`` and not queued.
        batch_bytes: Bytes per write pipeline.
        read_batch_bytes: Bytes of rows per MGET of a read.
        retry_after_s: After a fault, how long reads answer misses without
            asking and writes wait.
        auth_key: 32 secret bytes shared by the engines: values carry a keyed
            MAC, and only values whose MAC holds are served, so a client that
            can write to the server but lacks the key cannot plant rows.
        clock: Monotonic seconds (tests pass a fake one).
    """

    def __init__(
        self,
        client: Any,
        *,
        namespace: str,
        prefix: str = "omnicache",
        ttl_s: int | None = None,
        max_value_bytes: int = 16 * MiB,
        max_pending_bytes: int = 256 * MiB,
        batch_bytes: int = 8 * MiB,
        read_batch_bytes: int = 32 * MiB,
        retry_after_s: float = 1.0,
        auth_key: bytes | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not callable(getattr(client, "pipeline", None)):
            raise TypeError(
                f"client: expected redis.Redis or redis.cluster.RedisCluster, "
                f"found {type(client).__name__}"
            )
        self.namespace = check_key_part("namespace", namespace)
        self.prefix = check_key_part("prefix", prefix)
        check_optional_int("ttl_s", ttl_s, minimum=1)
        for what, value in (
            ("max_value_bytes", max_value_bytes),
            ("max_pending_bytes", max_pending_bytes),
            ("batch_bytes", batch_bytes),
            ("read_batch_bytes", read_batch_bytes),
        ):
            check_int(what, value, minimum=1)
        check_number("retry_after_s", retry_after_s, minimum=0)
        self._auth_key = codec.check_auth_key(auth_key)
        self.client = client
        self.ttl_s = ttl_s
        self.max_value_bytes = max_value_bytes
        self.max_pending_bytes = max_pending_bytes
        self.batch_bytes = batch_bytes
        self.read_batch_bytes = read_batch_bytes
        self.retry_after_s = float(retry_after_s)
        self._clock = clock
        # NOTE: plain Redis answers MGET for any keys; a cluster only for keys
        # of one slot, so there the client splits the keys by node.
        self._mget = getattr(client, "mget_nonatomic", None) or client.mget
        self._stats = TierStats()
        self._cv = threading.Condition()
        # (value key, value), oldest first.
        self._queue: deque[tuple[str, bytearray]] = deque()
        # Sent values' buffers by size, for reuse (at most max_pending_bytes).
        self._spare: dict[int, list[bytearray]] = {}
        self._spare_bytes = 0
        self._in_flight = 0
        self._closing = False
        # While clock() < _down_until, the tier does not ask the server.
        self._down_until = 0.0
        self._down = False
        # Whether the last batch had writes the server refused (writer thread only).
        self._refusing = False
        self._writer = threading.Thread(target=self._write_loop, name="omnicache-redis-writer")
        self._writer.daemon = True
        self._writer.start()
        # NOTE: a process that exits without close() still writes what is
        # queued (up to 5 s), rather than losing it uncounted with the thread.
        self._at_exit = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        namespace: str,
        socket_timeout_s: float = 0.5,
        cluster: bool = False,
        **kwargs: Any,
    ) -> RedisTier:
        """A tier on the server at ``url`` (``redis://host:port/db``).

        Args:
            url: The server (or, with ``cluster``, any node of the cluster).
            namespace: See `RedisTier`.
            socket_timeout_s: Connect and command timeout: how long a slow
                server may hold a request before it is served as a miss.
            cluster: Talk to a Redis Cluster.
            **kwargs: Other `RedisTier` arguments.

        Raises:
            ValueError: A malformed URL or argument.
            redis.exceptions.RedisClusterException: With ``cluster``, no node
                answered: the cluster's slot map is read here, once. (A plain
                server is first asked at the first read or write, and a
                server that is down then costs only misses.)
        """
        options: dict[str, Any] = {
            "socket_timeout": socket_timeout_s,
            "socket_connect_timeout": socket_timeout_s,
        }
        if cluster:
            from redis.cluster import RedisCluster

            client: Any = RedisCluster.from_url(url, **options)
        else:
            # NOTE: one immediate retry on a dropped connection (a restarted
            # server leaves the pooled ones dead), none on a timeout: a slow
            # server costs one socket_timeout_s and is then a miss, and the
            # tier's own back-off decides when to ask again.
            retry = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
            client = redis.Redis.from_url(url, retry=retry, **options)
        return cls(client, namespace=namespace, **kwargs)

    # -- BlockTier ------------------------------------------------------------

    def put(self, blocks: Sequence[TierBlock]) -> None:
        """Queues each block's rows for writing (see `BlockTier.put`); never raises.

        The values are built here (one copy of the rows, into a reused
        buffer) and handed to the writer a batch at a time, so it checksums
        and sends the first batch while this call builds the next.
        """
        num_dropped = 0
        num_queued = 0
        for block in blocks:
            try:
                name = value_key(self.prefix, self.namespace, block.key, block.name)
                value = codec.encode_into(
                    block.key,
                    block.name,
                    block.rows,
                    self._take_buffer,
                    sealed=False,
                    auth_key=self._auth_key,
                )
            except (TypeError, ValueError) as exc:
                # NOTE: rows the format cannot carry (a name or shape too long
                # for the header): this block is lost, the others are written.
                with self._cv:
                    self._stats.num_put_values += 1
                    self._stats.num_dropped_values += 1
                _log.warning("redis tier: could not encode a block, not written: %r", exc)
                continue
            size = len(value)
            with self._cv:
                stats = self._stats
                stats.num_put_values += 1
                if size > self.max_value_bytes:
                    stats.num_oversize_values += 1
                    self._give_buffer(value)
                    if stats.num_oversize_values == 1:
                        _log.warning(
                            "redis tier: a value of %d bytes exceeds max_value_bytes=%d; "
                            "such values are not written (num_oversize_values counts them)",
                            size,
                            self.max_value_bytes,
                        )
                    continue
                if self._closing or stats.num_pending_bytes + size > self.max_pending_bytes:
                    stats.num_dropped_values += 1
                    num_dropped += 1
                    self._give_buffer(value)
                    continue
                self._queue.append((name, value))
                stats.num_pending_bytes += size
                num_queued += size
                if num_queued >= self.batch_bytes:
                    num_queued = 0
                    self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()
        if num_dropped:
            _log.warning(
                "redis tier: %d values not written: write-behind queue full "
                "(max_pending_bytes=%d) or tier closed",
                num_dropped,
                self.max_pending_bytes,
            )

    def count_held(
        self, keys: Sequence[BlockHash], entries: Sequence[str], *, chunk_blocks: int = 256
    ) -> int:
        """How many leading blocks of ``keys`` have every entry in the server; never raises.

        Asks only whether the values exist (``EXISTS``, a few bytes a value),
        in pipelines of ``chunk_blocks`` blocks, the next one only if this one
        was held whole. A block held now may be gone (or fail to verify) when
        it is read: a count is a promise to try, never a hit.
        """
        check_int("chunk_blocks", chunk_blocks, minimum=1)
        with self._cv:
            self._stats.num_held_calls += 1
            if self._clock() < self._down_until:
                self._stats.num_skipped_calls += 1
                return 0
        if not keys or not entries:
            return 0
        held = 0
        for start in range(0, len(keys), chunk_blocks):
            chunk = keys[start : start + chunk_blocks]
            pipe = self.client.pipeline(transaction=False)
            for key in chunk:
                for name in entries:
                    # NOTE: one key a command: a cluster routes each to its slot.
                    pipe.exists(value_key(self.prefix, self.namespace, key, name))
            try:
                found = pipe.execute()
            except (redis.RedisError, OSError) as exc:
                self._fault(exc, "lookup")
                with self._cv:
                    self._stats.num_read_errors += 1
                return 0
            self._recovered()
            num = len(entries)
            whole = 0
            for index in range(len(chunk)):
                if not all(found[index * num : (index + 1) * num]):
                    break
                whole += 1
            held += whole
            if whole < len(chunk):
                break
        with self._cv:
            self._stats.num_held_blocks += held
        return held

    def get(
        self, keys: Sequence[BlockHash], entries: Sequence[EntrySpec], block_size: int
    ) -> list[Mapping[str, torch.Tensor]]:
        """The leading blocks of ``keys`` held whole (see `BlockTier.get`); never raises.

        Keys are asked for in MGETs of about ``read_batch_bytes`` of rows,
        one after another, until one comes back short: a long prompt neither
        builds one huge reply in the server nor fetches blocks past a miss.
        """
        with self._cv:
            self._stats.num_get_calls += 1
            self._stats.num_get_blocks += len(keys)
            if self._clock() < self._down_until:
                self._stats.num_skipped_calls += 1
                return []
        if not keys or not entries:
            return []
        block_bytes = sum(
            codec.layout(e.name, e.dtype, (block_size, *e.row_shape)).nbytes for e in entries
        )
        per_call = max(1, self.read_batch_bytes // max(1, block_bytes))
        run: list[Mapping[str, torch.Tensor]] = []
        for start in range(0, len(keys), per_call):
            chunk = keys[start : start + per_call]
            part = self._get_run(chunk, entries, block_size)
            run += part
            if len(part) < len(chunk):
                break
        with self._cv:
            self._stats.num_hit_blocks += len(run)
        return run

    def _get_run(
        self, keys: Sequence[BlockHash], entries: Sequence[EntrySpec], block_size: int
    ) -> list[Mapping[str, torch.Tensor]]:
        """One MGET: the leading blocks of ``keys`` that verify ([] on a fault)."""
        names = [value_key(self.prefix, self.namespace, k, e.name) for k in keys for e in entries]
        try:
            values = self._mget(names)
            if len(values) != len(names):
                raise redis.ResponseError(
                    f"MGET: expected {len(names)} values, found {len(values)}"
                )
        except (redis.RedisError, OSError) as exc:
            # NOTE: any failure of the server or the connection is a miss: a
            # serving path must not fail because its cache did.
            self._fault(exc, "read")
            with self._cv:
                self._stats.num_read_errors += 1
            return []
        self._recovered()
        num_entries = len(entries)
        rejected: list[tuple[int, EntrySpec, codec.Rejection]] = []

        def value_of(index: int, j: int) -> bytes | None:
            value: bytes | None = values[index * num_entries + j]
            return value

        def on_reject(index: int, spec: EntrySpec, why: codec.Rejection) -> None:
            rejected.append((index, spec, why))

        # NOTE: a value that does not verify is a rejection, not an error.
        run = decode_run(keys, entries, block_size, value_of, on_reject, self._auth_key)
        if rejected:
            with self._cv:
                self._stats.num_rejected_values += len(rejected)
            for index, spec, why in rejected:
                _log.warning(
                    "redis tier: value %s rejected (%s): served as a miss",
                    value_key(self.prefix, self.namespace, keys[index], spec.name),
                    why.value,
                )
        return run

    # -- life -----------------------------------------------------------------

    @property
    def stats(self) -> TierStats:
        """A snapshot of the counters."""
        with self._cv:
            return replace(self._stats)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Waits until every queued value is written or lost.

        Returns:
            Whether the queue drained within ``timeout_s`` (None: no limit).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            self._cv.notify_all()
            while self._queue or self._in_flight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(0.05 if left is None else min(left, 0.05))
            return True

    def close(self, timeout_s: float | None = 10.0) -> None:
        """Flushes (up to ``timeout_s``), then stops the writer.

        Values still queued after the timeout are counted in
        ``num_dropped_values``. Later `put` calls drop (and count) their values;
        `get` keeps working.
        """
        atexit.unregister(self._at_exit)
        self.flush(timeout_s)
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._writer.join()

    def __enter__(self) -> RedisTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------

    def _fault(self, exc: BaseException, during: str) -> None:
        with self._cv:
            self._stats.num_faults += 1
            self._down_until = self._clock() + self.retry_after_s
            first = not self._down
            self._down = True
        if first:
            _log.warning(
                "redis tier: %s failed (%s: %s); serving misses, retrying in %.1f s",
                during,
                type(exc).__name__,
                exc,
                self.retry_after_s,
            )

    def _recovered(self) -> None:
        with self._cv:
            if not self._down:
                return
            self._down = False
            self._stats.num_reconnects += 1
        _log.warning("redis tier: server answers again; reads and writes resume")

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                batch = self._next_batch()
                if batch is None:
                    return
            num_written = self._send(batch)
            with self._cv:
                size = sum(len(value) for _, value in batch)
                self._stats.num_pending_bytes -= size
                for _, value in batch:
                    self._give_buffer(value)
                self._in_flight = 0
                self._stats.num_written_values += num_written
                self._stats.num_write_errors += len(batch) - num_written
                self._cv.notify_all()

    def _take_buffer(self, size: int) -> bytearray:
        """A buffer of ``size`` bytes: a spare one of that size, else a new one."""
        with self._cv:
            spares = self._spare.get(size)
            if spares:
                self._spare_bytes -= size
                return spares.pop()
        return bytearray(size)

    def _give_buffer(self, buf: bytearray) -> None:
        """Keeps a sent value's buffer for reuse (holding the lock).

        NOTE: spares never exceed max_pending_bytes, the memory the queue may
        hold anyway; values of one entry all have one size, so they recycle.
        """
        size = len(buf)
        if self._spare_bytes + size <= self.max_pending_bytes:
            self._spare.setdefault(size, []).append(buf)
            self._spare_bytes += size

    def _next_batch(self) -> list[tuple[str, bytearray]] | None:
        """Waits for values to send (holding the lock); None: closed and done."""
        while True:
            if self._closing and (not self._queue or self._clock() < self._down_until):
                # NOTE: close waited for the flush; what is left is dropped, counted.
                if self._queue:
                    num = len(self._queue)
                    self._stats.num_dropped_values += num
                    self._stats.num_pending_bytes -= sum(len(v[1]) for v in self._queue)
                    self._queue.clear()
                    _log.warning("redis tier: closed with %d values unwritten", num)
                    self._cv.notify_all()
                return None
            if not self._queue:
                self._cv.wait()
                continue
            wait = self._down_until - self._clock()
            if wait > 0:
                self._cv.wait(min(wait, 0.05))
                continue
            batch = [self._queue.popleft()]
            size = len(batch[0][1])
            while self._queue and size + len(self._queue[0][1]) <= self.batch_bytes:
                item = self._queue.popleft()
                size += len(item[1])
                batch.append(item)
            # NOTE: still counted in num_pending_bytes until sent.
            self._in_flight = len(batch)
            return batch

    def _send(self, batch: list[tuple[str, bytearray]]) -> int:
        """Writes a batch in one pipeline; returns how many values were stored."""
        try:
            pipe = self.client.pipeline(transaction=False)
            for name, value in batch:
                codec.seal(value, auth_key=self._auth_key)
                pipe.set(name, memoryview(value), ex=self.ttl_s)
            # NOTE: a refused command (OOM under maxmemory noeviction, ...)
            # comes back as its reply; a lost connection raises.
            replies = pipe.execute(raise_on_error=False)
        except (redis.RedisError, OSError) as exc:
            self._fault(exc, "write")
            return 0
        self._recovered()
        num_written = sum(1 for reply in replies if reply is True)
        refused = len(batch) - num_written
        if refused and not self._refusing:
            # NOTE: the server answered, so this is no outage: reads go on.
            # One warning until a batch is stored whole again.
            failed = next(reply for reply in replies if reply is not True)
            _log.warning(
                "redis tier: server refused %d of %d writes (%s); values not stored",
                refused,
                len(batch),
                failed,
            )
        self._refusing = refused > 0
        return num_written


def _close_at_exit(ref: weakref.ref[RedisTier]) -> None:
    tier = ref()
    if tier is not None:
        tier.close(timeout_s=5.0)
