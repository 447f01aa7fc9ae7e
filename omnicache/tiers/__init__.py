"""Tiers beside the `TensorStore`: blocks kept by content-addressed key.

A tier implements `omnicache.store.BlockTier`; the store offers it every block
it stamps and asks it on a local miss. Implementations:

- `omnicache.tiers.memory.MemoryTier`: a dict in this process (tests, several
  engines in one process).
- `omnicache.tiers.redis.RedisTier`: Redis or Redis Cluster, shared by engine
  processes and machines (needs ``pip install 'omnicache-mm[redis]'``).

Importing this package imports neither.
"""
