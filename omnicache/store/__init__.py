"""TensorStore: hidden states and per-token multimodal outputs by block, stamped.

A prefix hit lets a request skip the forward pass for its cached tokens, but a
multi-stage model still needs those tokens' hidden states and per-token
multimodal outputs (codec codes, embeddings, ...) for the next stage. The store
keeps them per KV block, in the same slots the KV cache uses, so a hit on
blocks ``[b0, b1, ...]`` finds its rows at the same block ids.

Layout of one entry (``dim`` values of ``dtype`` per token)::

    cache (num_blocks, block_size, dim)        flat (num_blocks * block_size, dim)
    block 0  [row 0 .. row block_size - 1]     slot = block_id * block_size + offset
    block 1  [row 0 .. row block_size - 1]
    ...
    per block, per entry:
      stamps[block_id]   the key whose rows the block holds, or None
      filled[block_id]   rows written in token order from offset 0 (-1: broken run)

Stamps. A block is stamped with key K for an entry only by a write that
completes the block (``filled`` reaches ``block_size``) while the caller names
K as the block's key; any other write that touches the block clears its stamp.
A read that expects K from a block not stamped K is a counted miss or a
`StaleBlockError`, never wrong data. When the block pool reuses a keyed block
it calls `TensorStore.on_block_evicted`, which clears the block's stamps and
fill counts for every entry.

Fill counts. A write at offset 0 starts a block's run (a new owner always
writes its first token there); a write that starts exactly at ``filled``
extends it; any other write (a gap, a rewrite in the middle) breaks the run
until the next offset-0 write, so such a block is never stamped.

NOTE: a block freed *without* a key and handed to a new owner produces no
eviction call. If the new owner skips an entry for the first rows of such a
block and starts it exactly where the previous owner stopped, the run would
continue across owners. Owners that write every entry for every token, from
offset 0, never do that; a caller that writes an entry for only some tokens
calls `TensorStore.invalidate` with each step's newly allocated block ids.

Small writes (a decode step: up to a few hundred rows) compute runs, fill
counts and stamps over Python ints instead of numpy arrays; they have the same
effects, results and errors as the general path, which handles every input the
small path declines (including every bad one, so that errors come from one
place).

Deferred entries are staged per request (on the device the rows came from)
and written into their blocks once, when the request finishes and its block
table is still known (`TensorStore.commit`), or dropped on abort
(`TensorStore.discard`). `TensorStore.write_step` takes a whole step: it
checks everything once, then writes the direct entries and stages the
deferred ones, all or nothing. A commit whose rows would land in a block that
changed hands since they were staged (handed out again, or written by another
request's step), or in another block than `write_step` staged them for, is
refused with `StaleCommitError` and counted, never written (see
`omnicache.store.deferred_rows`).

A merged read serves exactly or refuses: a request with hit blocks starts
right after them (``num_computed_tokens == len(hit_block_ids) *
block_size``, a ValueError otherwise). On a padded step, an output that looks
per-token but has fewer rows than the step's padded rows is not cached, but
counted (``StoreStats.num_unplaced_outputs``) and logged once per name.

A second tier (`BlockTier`: another process's memory, Redis, ...) sits beside
the store and knows blocks only by key. Every block a write stamps, and every
block `TensorStore.commit` stamps, is offered to the tier (write-behind: the
tier copies the rows and returns); `TensorStore.read_through` fills newly
allocated blocks with the rows the tier holds for their keys and stamps them
(read-through on a local miss). The store knows nothing of how a tier keeps
its blocks, and a tier that fails costs misses, never an exception.

Modules, one idea each (the store's API is what this package exports):

    specs         what callers hand in and get back: specs, requests,
                  results, counters, errors
    tensor_store  TensorStore: owns entries and counters, checks arguments
                  and delegates; construction, entries, inspection, writes
    deferred_rows rows of deferred entries, kept per request until commit,
                  and TensorStore's methods for them
    reads         block reads and merged reads, and TensorStore's read methods
    block_tier    the BlockTier interface, and the bridge to a tier
    writes        applying a checked write
    fill          the fill rule and the stamp rule, each written once
    copies        moving rows, and waiting for asynchronous copies
    entries       the layout; each entry's cache, stamps and fill counts
    outputs       a step's outputs: written, creating an entry, or passed through
    slots         slot mappings cut into runs (numpy, or Python ints when small)
    blocks        block ids, block keys and a step's requests, checked
"""

from omnicache.store.block_tier import BlockTier, TierBlock
from omnicache.store.specs import (
    HIDDEN_STATES,
    EntrySpec,
    MergedRead,
    ReadMiss,
    ScheduledRequest,
    StaleBlockError,
    StaleCommitError,
    StoreCapacityError,
    StoreStats,
    WriteResult,
)
from omnicache.store.tensor_store import TensorStore

__all__ = [
    "HIDDEN_STATES",
    "BlockTier",
    "EntrySpec",
    "MergedRead",
    "ReadMiss",
    "ScheduledRequest",
    "StaleBlockError",
    "StaleCommitError",
    "StoreCapacityError",
    "StoreStats",
    "TensorStore",
    "TierBlock",
    "WriteResult",
]
