"""What every tier shares: value keys, counters and the decode of a block run."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from omnicache.block_hash import BlockHash
from omnicache.checks import check_str
from omnicache.store import EntrySpec
from omnicache.tiers import codec

__all__ = ["TierStats"]

# Characters a prefix or namespace may not hold: ':' separates the parts of a
# value key, braces would make a Redis Cluster hash tag, whitespace breaks
# redis-cli and most tooling.
_FORBIDDEN = frozenset(":{} \t\r\n")


@dataclass(slots=True)
class TierStats:
    """Counters of a tier since it was created (``num_pending_bytes``: now)."""

    # Block values taken by `put` to be written.
    num_put_values: int = 0
    # Values the tier confirmed stored.
    num_written_values: int = 0
    # Values never stored: over ``max_value_bytes``.
    num_oversize_values: int = 0
    # Values never stored: the write-behind queue was full, or the tier closed.
    num_dropped_values: int = 0
    # Values lost to a failed write (server down, slow, restarted).
    num_write_errors: int = 0
    # `count_held` calls, and the leading blocks they found every entry of.
    num_held_calls: int = 0
    num_held_blocks: int = 0
    # `get` calls, the blocks they asked for, and the leading blocks found whole.
    num_get_calls: int = 0
    num_get_blocks: int = 0
    num_hit_blocks: int = 0
    # Values found but not served: damaged, cut short, or of another key,
    # entry, dtype, shape or format (each ends its run as a miss).
    num_rejected_values: int = 0
    # `get` calls that failed (server down, slow, restarted): a miss.
    num_read_errors: int = 0
    # `get` and `count_held` calls answered as a miss without asking: the tier was backing off
    # after a fault.
    num_skipped_calls: int = 0
    # Faults seen (reads and writes), and recoveries after them.
    num_faults: int = 0
    num_reconnects: int = 0
    num_pending_bytes: int = 0


def check_key_part(what: str, value: object) -> str:
    """A prefix or namespace: non-empty printable ASCII without ``: { }`` or spaces."""
    value = check_str(what, value)
    bad = sorted({c for c in value if c in _FORBIDDEN or not (c.isascii() and c.isprintable())})
    if not value or bad:
        raise ValueError(
            f"{what}: expected non-empty printable ASCII without ':', '{{', '}}' or "
            f"whitespace, found {value!r}"
        )
    return value


def value_key(prefix: str, namespace: str, key: bytes, name: str) -> str:
    """``{prefix}:{namespace}:{block key hex}:{entry}``: where one block's entry lives."""
    return f"{prefix}:{namespace}:{key.hex()}:{name}"


def decode_run(
    keys: Sequence[BlockHash],
    entries: Sequence[EntrySpec],
    block_size: int,
    value_of: Callable[[int, int], bytes | bytearray | memoryview | None],
    on_reject: Callable[[int, EntrySpec, codec.Rejection], None],
    auth_key: bytes | None = None,
) -> list[Mapping[str, torch.Tensor]]:
    """The leading blocks whose every entry decodes; stops at the first that does not.

    Args:
        keys: Block keys asked for, first block first.
        entries: Entries every block must hold.
        block_size: Rows per block.
        value_of: ``(block index, entry index)`` -> the stored value, or None.
        on_reject: Called for a value found but not served.
        auth_key: Serve only values whose MAC holds under this key (None:
            only values with a plain checksum).
    """
    if not entries:
        return []
    layouts = [
        codec.layout(spec.name, spec.dtype, (block_size, *spec.row_shape)) for spec in entries
    ]
    run: list[Mapping[str, torch.Tensor]] = []
    # NOTE: values come back as read-only bytes, which torch warns about once
    # per process; the rows are only read (and copied into the store).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        for index, key in enumerate(keys):
            rows: dict[str, torch.Tensor] = {}
            for j, spec in enumerate(entries):
                value = value_of(index, j)
                if value is None:
                    return run
                decoded = codec.decode_as(value, key, layouts[j], auth_key=auth_key)
                if decoded.rows is None:
                    assert decoded.rejection is not None
                    on_reject(index, spec, decoded.rejection)
                    return run
                rows[spec.name] = decoded.rows
            run.append(rows)
    return run
