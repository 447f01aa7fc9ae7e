"""Randomized reuse simulation: TensorStore + the real BlockPool never serve stale rows.

Requests with shared prefixes are scheduled in chunks, interleaved, decoded,
finished, aborted; the pool hands blocks out again and again (lazy eviction,
keys registered at scheduling time before their rows are written, duplicate
keys left unregistered). Every row a token can have is a function of its
prefix, so any row from another sequence or an earlier owner is caught:

- every merged read of a prefix hit equals a recompute, exactly;
- adversarial reads of random (block, key, entry) triples return either the
  exact rows of that key or a StaleBlockError, never anything else.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

import torch

from omnicache.block_hash import BlockHash
from omnicache.reference.block_pool import BlockPool, CacheBlock
from omnicache.store import HIDDEN_STATES, ScheduledRequest, StaleBlockError, TensorStore

BLOCK_SIZE = 4
NUM_BLOCKS = 40
MIN_OPS = 100_000
MASK = (1 << 62) - 1
# Entries a prefix hit must hold; "tail" and "audio" are checked by adversarial reads.
HIT_ENTRIES = (HIDDEN_STATES, "codes")
ENTRIES = (HIDDEN_STATES, "codes", "tail", "audio")


def mix(prefix_hash: int, token: int) -> int:
    return ((prefix_hash * 0x9E3779B97F4A7C15) ^ (token * 0xBF58476D1CE4E5B9 + 1)) & MASK


def expected_rows(name: str, prefix_hashes: list[int], positions: list[int]) -> torch.Tensor:
    """The one row each position can hold in entry ``name``, given its prefix."""
    if name == HIDDEN_STATES:
        values = [
            [float(h & 0xFFFFFFFFFF), float(p)]
            for h, p in zip(prefix_hashes, positions, strict=True)
        ]
        return torch.tensor(values, dtype=torch.float64).view(-1, 2)
    if name == "codes":
        return torch.tensor([h >> 24 for h in prefix_hashes], dtype=torch.int64).view(-1, 1)
    if name == "tail":
        return torch.tensor([h ^ 0x2A2A for h in prefix_hashes], dtype=torch.int64).view(-1, 1)
    assert name == "audio"
    audio = [float((h >> 8) & 0xFFFFFFF) for h in prefix_hashes]
    return torch.tensor(audio, dtype=torch.float64).view(-1, 1)


@dataclass
class Req:
    rid: str
    tokens: list[int]
    prompt_len: int
    max_len: int
    # Writes "tail" only for generated tokens, so it invalidates its new blocks.
    tail_from_prompt_end: bool
    prefix_hashes: list[int] = field(default_factory=list)
    keys: list[BlockHash] = field(default_factory=list)
    blocks: list[CacheBlock] = field(default_factory=list)
    num_computed: int = 0
    num_registered: int = 0
    hit_block_ids: list[int] = field(default_factory=list)
    # Chunk scheduled (blocks allocated, keys registered) but not yet run.
    scheduled: int = 0
    staged: bool = False

    def extend_hashes(self) -> None:
        h = self.prefix_hashes[-1] if self.prefix_hashes else 0
        for token in self.tokens[len(self.prefix_hashes) :]:
            h = mix(h, token)
            self.prefix_hashes.append(h)

    def extend_keys(self, registry: dict[BlockHash, tuple[int, list[int]]]) -> list[BlockHash]:
        """Adds the keys of new full blocks; returns those ``registry`` did not know.

        ``registry`` maps a key to its block's first position and prefix hashes.
        """
        unseen: list[BlockHash] = []
        while (len(self.keys) + 1) * BLOCK_SIZE <= len(self.tokens):
            j = len(self.keys)
            parent = self.keys[-1] if self.keys else b"root"
            block_tokens = self.tokens[j * BLOCK_SIZE : (j + 1) * BLOCK_SIZE]
            digest = hashlib.blake2b(
                parent + b"".join(t.to_bytes(4, "little") for t in block_tokens), digest_size=16
            ).digest()
            k = BlockHash(digest)
            self.keys.append(k)
            if k not in registry:
                registry[k] = (
                    j * BLOCK_SIZE,
                    self.prefix_hashes[j * BLOCK_SIZE : (j + 1) * BLOCK_SIZE],
                )
                unseen.append(k)
        return unseen


class Sim:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE)
        self.store = TensorStore(NUM_BLOCKS, BLOCK_SIZE, hidden_size=2, hidden_dtype=torch.float64)
        self.store.register("codes", 1, torch.int64)
        self.store.register("tail", 1, torch.int64)
        self.store.register("audio", 1, torch.float64, deferred=True)
        self.store.attach(self.pool)
        self.active: list[Req] = []
        self.registry: dict[BlockHash, tuple[int, list[int]]] = {}
        self.registry_keys: list[BlockHash] = []
        self.bases = [
            [self.rng.randrange(50) for _ in range(self.rng.randrange(4, 28))] for _ in range(5)
        ]
        self.num_ops = 0
        self.num_requests = 0
        self.counts = dict.fromkeys(
            (
                "hit_reads",
                "hit_blocks",
                "adversarial_ok",
                "adversarial_stale",
                "commits",
                "discards",
                "alloc_failures",
                "resets",
            ),
            0,
        )

    # -- request lifecycle -------------------------------------------------------

    def extend_keys(self, req: Req) -> None:
        self.registry_keys.extend(req.extend_keys(self.registry))

    def new_request(self) -> None:
        rng = self.rng
        base = rng.choice(self.bases)
        prompt = base[: rng.randrange(1, len(base) + 1)]
        prompt = prompt + [rng.randrange(50) for _ in range(rng.choice((0, 0, 1, 3, 6)))]
        req = Req(
            rid=f"r{self.num_requests}",
            tokens=prompt,
            prompt_len=len(prompt),
            max_len=len(prompt) + rng.randrange(1, 9),
            tail_from_prompt_end=rng.random() < 0.5,
        )
        self.num_requests += 1
        req.extend_hashes()
        self.extend_keys(req)
        max_hit = (len(prompt) - 1) // BLOCK_SIZE
        cached = self.pool.find_longest_cache_hit(req.keys, max_hit)
        self.num_ops += 1
        ids = [b.block_id for b in cached]
        # The pool may hold keys whose rows are not written (yet): hit only
        # what the store can serve.
        num_hit = self.store.probe(ids, req.keys[: len(ids)], HIT_ENTRIES)
        self.num_ops += 1
        hit = cached[:num_hit]
        if hit:
            self.pool.touch(hit)
            self.num_ops += 1
        req.blocks = list(hit)
        req.hit_block_ids = [b.block_id for b in hit]
        req.num_registered = num_hit
        req.num_computed = num_hit * BLOCK_SIZE
        self.active.append(req)

    def schedule(self, req: Req) -> None:
        """Allocates blocks for the next chunk and registers its full blocks' keys."""
        rng = self.rng
        remaining = len(req.tokens) - req.num_computed
        n = min(remaining, rng.randrange(1, 11)) if req.num_computed < req.prompt_len else 1
        needed = -(-(req.num_computed + n) // BLOCK_SIZE) - len(req.blocks)
        if needed > 0:
            new = self.pool.allocate(needed)
            self.num_ops += 1
            if new is None:
                self.counts["alloc_failures"] += 1
                self.abort(req)
                return
            if req.tail_from_prompt_end:
                self.store.invalidate([b.block_id for b in new])
                self.num_ops += 1
            req.blocks.extend(new)
        # vLLM registers full blocks when it schedules them, before they run.
        num_full = min((req.num_computed + n) // BLOCK_SIZE, len(req.keys))
        if num_full > req.num_registered:
            self.pool.cache_full_blocks(req.blocks, req.keys, req.num_registered, num_full)
            self.num_ops += 1
            req.num_registered = num_full
        req.scheduled = n

    def execute(self, req: Req) -> None:
        """Runs the scheduled chunk: writes, stages, reads a hit, samples a token."""
        store = self.store
        start, n = req.num_computed, req.scheduled
        positions = list(range(start, start + n))
        hashes = req.prefix_hashes[start : start + n]
        slots = [
            req.blocks[p // BLOCK_SIZE].block_id * BLOCK_SIZE + p % BLOCK_SIZE for p in positions
        ]
        num_full_after = (start + n) // BLOCK_SIZE
        block_keys = {
            req.blocks[j].block_id: req.keys[j]
            for j in range(start // BLOCK_SIZE, min(num_full_after, len(req.keys)))
        }
        outputs = {name: expected_rows(name, hashes, positions) for name in ENTRIES}
        direct = {"codes": outputs["codes"], "ref_len": torch.full((n,), req.prompt_len)}
        if not req.tail_from_prompt_end:
            direct["tail"] = outputs["tail"]
        store.write_outputs(
            slots,
            hidden_states=outputs[HIDDEN_STATES],
            multimodal_outputs=direct,
            block_keys=block_keys,
        )
        self.num_ops += 1
        if req.tail_from_prompt_end and start + n > req.prompt_len:
            first = max(0, req.prompt_len - start)
            store.write("tail", outputs["tail"][first:], slots[first:], block_keys=block_keys)
            self.num_ops += 1
        store.stage_outputs(
            [ScheduledRequest(req.rid, n, start)], multimodal_outputs={"audio": outputs["audio"]}
        )
        req.staged = True
        self.num_ops += 1
        if req.hit_block_ids:
            # First step of a hit: cached rows then this step's rows.
            hit_keys = req.keys[: len(req.hit_block_ids)]
            merged = store.read_merged(
                [ScheduledRequest(req.rid, n, start, req.hit_block_ids, hit_keys)],
                hidden_states=outputs[HIDDEN_STATES],
                multimodal_outputs={"codes": outputs["codes"], "meta": [req.rid]},
            )
            self.num_ops += 1
            assert merged.misses == ()
            assert merged.passthrough == {"meta": [req.rid]}
            every = list(range(start + n))
            for name in HIT_ENTRIES:
                want = expected_rows(name, req.prefix_hashes[: start + n], every)
                assert torch.equal(merged.tensors[name][req.rid], want), (req.rid, name)
            self.counts["hit_reads"] += 1
            self.counts["hit_blocks"] += len(req.hit_block_ids)
            req.hit_block_ids = []
        req.num_computed += n
        req.scheduled = 0
        if req.num_computed == len(req.tokens) and len(req.tokens) < req.max_len:
            # Sample: the next token is a function of the prefix, so equal
            # prefixes decode equally and decode blocks are shared too.
            req.tokens.append(req.prefix_hashes[-1] % 50)
            req.extend_hashes()
            self.extend_keys(req)
        if req.num_computed == req.max_len:
            self.finish(req)

    def finish(self, req: Req) -> None:
        if req.staged:
            num_full = min(len(req.keys), len(req.blocks))
            self.store.commit(req.rid, [b.block_id for b in req.blocks], req.keys[:num_full])
            self.num_ops += 1
            self.counts["commits"] += 1
        self.pool.free(req.blocks[::-1])
        self.num_ops += 1
        self.active.remove(req)

    def abort(self, req: Req) -> None:
        if req.staged:
            self.store.discard(req.rid)
            self.num_ops += 1
            self.counts["discards"] += 1
        self.pool.free(req.blocks[::-1])
        self.num_ops += 1
        self.active.remove(req)

    # -- adversarial reads ---------------------------------------------------------

    def adversarial_read(self) -> None:
        """Reads a random block under a key it may or may not hold."""
        rng = self.rng
        block_id = rng.randrange(NUM_BLOCKS)
        name = rng.choice(ENTRIES)
        pool_key = self.pool.get_block_hash(block_id)
        stamp = self.store.stamp_of(rng.choice(ENTRIES), block_id)
        roll = rng.random()
        if pool_key is not None and roll < 0.5:
            k = pool_key
        elif stamp is not None and roll < 0.8:
            k = stamp
        else:
            k = rng.choice(self.registry_keys)
        try:
            got = self.store.read_blocks(name, [block_id], [k])
        except StaleBlockError as exc:
            assert exc.found != k
            self.counts["adversarial_stale"] += 1
        else:
            first, hashes = self.registry[k]
            want = expected_rows(name, hashes, list(range(first, first + BLOCK_SIZE)))
            assert torch.equal(got, want), (name, block_id)
            self.counts["adversarial_ok"] += 1
        self.num_ops += 1

    # -- driver --------------------------------------------------------------------

    def step(self) -> None:
        rng = self.rng
        roll = rng.random()
        if not self.active or (len(self.active) < 5 and roll < 0.15):
            if not self.active and rng.random() < 0.01:
                assert self.pool.reset()
                self.counts["resets"] += 1
                self.num_ops += 1
            self.new_request()
        elif roll < 0.35:
            self.adversarial_read()
        elif roll < 0.37:
            self.abort(rng.choice(self.active))
        else:
            req = rng.choice(self.active)
            if req.scheduled:
                self.execute(req)
            else:
                self.schedule(req)

    def run(self, min_ops: int) -> None:
        while self.num_ops < min_ops:
            self.step()


def test_reuse_simulation_never_serves_stale_rows() -> None:
    sim = Sim(seed=20240611)
    sim.run(MIN_OPS)
    counts = sim.counts
    stats = sim.store.stats
    assert sim.num_ops >= MIN_OPS
    # The run exercised what it claims to: reuse, hits, stale detections,
    # commits and discards (thresholds far below what this seed produces).
    assert sim.pool.num_evictions > 1000
    assert stats.num_evicted_stamps > 1000
    assert counts["hit_reads"] > 1000 and counts["hit_blocks"] > 2000
    assert counts["adversarial_ok"] > 1000 and counts["adversarial_stale"] > 1000
    assert counts["commits"] > 500 and counts["discards"] > 20 and counts["resets"] >= 1
    # Every stale detection was counted, and no merged read missed.
    assert stats.num_stale_reads == counts["adversarial_stale"]
    assert stats.num_hit_blocks_read == counts["hit_blocks"] + counts["adversarial_ok"]
