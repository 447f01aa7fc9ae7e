"""OmniKVCacheManager over vLLM's real hybrid KV cache managers (0.32 and 0.33, scheduler side).

One configuration per kind of model vLLM prefix-caches: full attention only;
full attention beside sliding-window, chunked local attention or Mamba
layers; a full-attention group coarser than the hash blocks; and hash blocks
finer than the KV blocks with an aligned Mamba group, where vLLM hits partial
blocks and copies the shared tail on write. For each:

- the wrapper's hits and block tables equal those of vLLM's own manager
  driven with the same requests (where vLLM hits a partial block, the
  wrapper's hit is the one vLLM's lookup finds at the whole-block length);
- different images and different salts never share blocks past their
  common text;
- a randomized run (chunked prefill, decode, aborts, a small pool reused
  over and over, lookups interleaved with unwritten blocks) never serves a
  row that is not the recompute of its prefix, every hit is consistent
  across groups (each group's blocks hold the request's keys where vLLM's
  own rules need them), and adversarial reads get exact rows or a
  StaleBlockError.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
import torch
from test_vllm_integration import (
    BLUE_HEX,
    HIDDEN,
    IMAGE_TOKEN,
    NAMESPACE,
    RED_HEX,
    VLLM_MISSING,
    image_feature,
    recompute,
)

from omnicache.block_hash import BlockHash
from omnicache.integrations.vllm import OmniKVCacheManager, RequestBlockHasher, make_request
from omnicache.integrations.vllm.kv_cache import new_hybrid_kv_cache_manager
from omnicache.integrations.vllm.live_store import LiveStore
from omnicache.integrations.vllm.mirror import StoreMirror
from omnicache.integrations.vllm.step_plan import planned_slots
from omnicache.store import ScheduledRequest, StaleBlockError, TensorStore

pytestmark = pytest.mark.skipif(VLLM_MISSING is not None, reason=VLLM_MISSING or "")

if VLLM_MISSING is None:
    import vllm
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CrossAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.request import RequestStatus

HASH_BLOCK = 16
NULL = 0  # vLLM's null block: stands in every table for blocks a group skips


class Config(NamedTuple):
    name: str
    # (kind, block size, window or chunk) per group, in group order.
    groups: tuple[tuple[str, int, int], ...]
    num_blocks: int

    def specs(self) -> list[Any]:
        common = {"num_kv_heads": 1, "head_size": 8, "dtype": torch.float16}
        specs: list[Any] = []
        for kind, block_size, extent in self.groups:
            if kind == "full":
                specs.append(FullAttentionSpec(block_size=block_size, **common))
            elif kind == "sliding":
                specs.append(
                    SlidingWindowSpec(block_size=block_size, sliding_window=extent, **common)
                )
            elif kind == "chunked":
                specs.append(
                    ChunkedLocalAttentionSpec(
                        block_size=block_size, attention_chunk_size=extent, **common
                    )
                )
            else:
                assert kind == "mamba"
                specs.append(
                    MambaSpec(
                        block_size=block_size,
                        shapes=((2, 2),),
                        dtypes=(torch.float32,),
                        mamba_cache_mode="align",
                    )
                )
        return specs

    @property
    def store_block_size(self) -> int:
        return self.groups[0][1]


CONFIGS = [
    Config("full", (("full", 16, 0),), 40),
    Config("full+sliding", (("full", 16, 0), ("sliding", 16, 32)), 48),
    Config("full+chunked", (("full", 16, 0), ("chunked", 16, 32)), 48),
    Config("full+mamba", (("full", 16, 0), ("mamba", 16, 0)), 48),
    Config("full32+sliding16", (("full", 32, 0), ("sliding", 16, 32)), 48),
    Config("finer-hashes", (("full", 64, 0), ("mamba", 64, 0)), 32),
]
CONFIG_IDS = [config.name for config in CONFIGS]


def new_manager(config: Config) -> Any:
    return new_hybrid_kv_cache_manager(
        config.num_blocks, config.specs(), max_model_len=2048, hash_block_size=HASH_BLOCK
    )


def new_wrapper(config: Config) -> OmniKVCacheManager:
    store = TensorStore(
        config.num_blocks,
        config.store_block_size,
        hidden_size=HIDDEN,
        hidden_dtype=torch.float32,
    )
    store.register("codes", 2, torch.int64)
    return OmniKVCacheManager(new_manager(config), store)


def hasher() -> RequestBlockHasher:
    return RequestBlockHasher(HASH_BLOCK, namespace=NAMESPACE)


def group_keys(request: Any, block_size: int) -> list[BlockHash]:
    scale = block_size // HASH_BLOCK
    return list(request.block_hashes[scale - 1 :: scale])


# -- hits equal vLLM's own ---------------------------------------------------------------

TEXT = list(range(1, 65))  # 64 tokens of text
IMAGE = 64
SUFFIX = list(range(300, 324))  # 24 tokens: the prompt ends inside a 64-token block


def image_prompt(extra: int = 0) -> list[int]:
    return TEXT + [IMAGE_TOKEN] * IMAGE + SUFFIX + list(range(400, 400 + extra))


# (request id, image, salt, extra tokens after the prompt)
SCENARIO = [
    ("red", RED_HEX, None, 0),
    ("red-again", RED_HEX, None, 0),
    ("blue", BLUE_HEX, None, 0),
    ("red-salted", RED_HEX, "tenant-b", 0),
    ("red-longer", RED_HEX, None, 40),
    ("red-longer-again", RED_HEX, None, 40),
    ("blue-again", BLUE_HEX, None, 0),
]


def scenario_request(rid: str, image: str, salt: str | None, extra: int) -> Any:
    return make_request(
        rid,
        image_prompt(extra),
        hasher(),
        mm_features=[image_feature(image, len(TEXT), IMAGE)],
        cache_salt=salt,
    )


def vllm_whole_block_hit(manager: Any, request: Any, block_size: int) -> tuple[Any, int, int]:
    """vLLM's own hit; one ending inside a store block is vLLM's hit at the whole-block length.

    Returns the blocks, the hit and vLLM's first (possibly partial) hit.
    """
    blocks, num_hit, _ = manager.get_computed_blocks(request)
    first = num_hit
    if num_hit % block_size:
        length = num_hit - num_hit % block_size
        if vllm.__version__.startswith("0.33."):
            blocks, num_hit, _ = manager.get_computed_blocks(request, max_cache_hit_length=length)
        else:  # 0.32's manager takes no length: its coordinator does
            found, num_hit, _ = manager.coordinator.find_longest_cache_hit(
                request.block_hashes, length
            )
            blocks = manager.create_kv_cache_blocks(found)
    return blocks, num_hit, first


def prefill_chunks(request: Any, start: int) -> list[int]:
    """Chunk ends from ``start`` to the prompt's end, as vLLM's scheduler splits for Mamba.

    With an aligned Mamba group, vLLM keeps a reusable state only where a
    chunk ends: its scheduler ends prefill chunks at block boundaries and at
    the prompt's last hash boundary (the checkpoint a resend resumes at).
    Every configuration is driven so, for one request sequence throughout.
    """
    num_tokens = request.num_tokens
    checkpoint = (num_tokens - 1) // HASH_BLOCK * HASH_BLOCK
    ends = {num_tokens, checkpoint, *range(64, num_tokens, 64)}
    return sorted(end for end in ends if end > start)


def run_scenario_plain(config: Config) -> list[tuple[str, int, int, tuple[list[int], ...]]]:
    manager = new_manager(config)
    results = []
    for rid, image, salt, extra in SCENARIO:
        request = scenario_request(rid, image, salt, extra)
        manager.new_step_starts()
        blocks, num_hit, first = vllm_whole_block_hit(manager, request, config.store_block_size)
        start = num_hit
        for end in prefill_chunks(request, num_hit):
            if start == num_hit:
                assert manager.allocate_slots(request, end - start, num_hit, blocks)
                request.num_computed_tokens = num_hit
            else:
                manager.new_step_starts()
                assert manager.allocate_slots(request, end - start)
            request.num_computed_tokens = start = end
        results.append((rid, first, num_hit, manager.get_block_ids(rid)))
        request.status = RequestStatus.FINISHED_STOPPED
        manager.free(request)
    return results


def admit_and_compute(wrapper: OmniKVCacheManager, request: Any) -> int:
    """Lookup, then chunk by chunk: allocation, rows stored, merged with the hit (exact)."""
    rid = request.request_id
    wrapper.new_step_starts()
    blocks, num_hit, _ = wrapper.get_computed_blocks(request)
    rows = recompute(request)
    start = num_hit
    for end in prefill_chunks(request, num_hit):
        if start == num_hit:
            assert wrapper.allocate_slots(request, end - start, num_hit, blocks)
            request.num_computed_tokens = num_hit
        else:
            wrapper.new_step_starts()
            assert wrapper.allocate_slots(request, end - start)
        step = [ScheduledRequest(rid, end - start, start)]
        outputs = {
            "hidden_states": rows["hidden_states"][start:end],
            "multimodal_outputs": {"codes": rows["codes"][start:end]},
        }
        wrapper.write_outputs(step, **outputs)
        if start == num_hit:
            merged = wrapper.read_merged(step, **outputs)
            assert merged.misses == ()
            assert torch.equal(merged.hidden_states[rid], rows["hidden_states"][:end])
            assert torch.equal(merged.tensors["codes"][rid], rows["codes"][:end])
        request.num_computed_tokens = start = end
    return int(num_hit)


def run_scenario_wrapped(config: Config) -> list[tuple[str, int, tuple[list[int], ...]]]:
    wrapper = new_wrapper(config)
    results = []
    for rid, image, salt, extra in SCENARIO:
        request = scenario_request(rid, image, salt, extra)
        num_hit = admit_and_compute(wrapper, request)
        results.append((rid, num_hit, wrapper.get_block_ids(rid)))
        request.status = RequestStatus.FINISHED_STOPPED
        wrapper.free(request)
    assert wrapper.stats.num_capped_blocks == 0
    return results


# Per configuration: vLLM's first hit of each scenario request (before a
# partial block is dropped), then the hit the wrapper adopts.
EXPECTED_HITS = {
    "full": ([0, 144, 64, 0, 144, 176, 144], [0, 144, 64, 0, 144, 176, 144]),
    "full+sliding": ([0, 144, 64, 0, 144, 176, 144], [0, 144, 64, 0, 144, 176, 144]),
    "full+chunked": ([0, 144, 64, 0, 144, 176, 144], [0, 144, 64, 0, 144, 176, 144]),
    "full+mamba": ([0, 144, 64, 0, 144, 176, 144], [0, 144, 64, 0, 144, 176, 144]),
    # Hits land on the scheduler's 32-token blocks.
    "full32+sliding16": ([0, 128, 64, 0, 128, 160, 128], [0, 128, 64, 0, 128, 160, 128]),
    # vLLM hits into the 64-token block that holds the prompt's end; the
    # store serves whole blocks ("red-longer-again" resumes at 176, inside
    # the third block, so it gets two).
    "finer-hashes": ([0, 144, 64, 0, 144, 176, 144], [0, 128, 64, 0, 128, 128, 128]),
}


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_hits_and_block_tables_equal_vllms_own(config: Config) -> None:
    plain = run_scenario_plain(config)
    wrapped = run_scenario_wrapped(config)
    assert [(rid, hit, ids) for rid, _, hit, ids in plain] == wrapped
    first_hits, hits = EXPECTED_HITS[config.name]
    assert [first for _, first, _, _ in plain] == first_hits
    assert [hit for _, hit, _ in wrapped] == hits


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_other_images_and_salts_share_no_block_past_the_text(config: Config) -> None:
    wrapper = new_wrapper(config._replace(num_blocks=96))
    tables: dict[str, tuple[list[int], ...]] = {}
    for rid, image, salt, extra in SCENARIO[:4]:
        request = scenario_request(rid, image, salt, extra)
        admit_and_compute(wrapper, request)
        tables[rid] = wrapper.get_block_ids(rid)
    # All four are held at once: a block in two tables is shared by both.
    size = config.store_block_size
    red, red_again, blue, salted = (tables[rid] for rid, _, _, _ in SCENARIO[:4])
    hits = EXPECTED_HITS[config.name][1]
    for group_id in range(len(config.groups)):
        # Blocks of every group the hit reuses, from the first new block on: none shared.
        assert (set(salted[group_id]) - {NULL}).isdisjoint(red[group_id] + blue[group_id])
    text = len(TEXT) // size
    assert blue[0][:text] == red[0][:text] and set(blue[0][text:]).isdisjoint(red[0])
    assert red_again[0][: hits[1] // size] == red[0][: hits[1] // size]
    assert set(red_again[0][hits[1] // size :]).isdisjoint(red[0])


# -- hits consistent across groups -------------------------------------------------------


def holds_key(manager: Any, block: Any, key: BlockHash, group_id: int) -> bool:
    """Whether vLLM's table maps ``key`` in group ``group_id`` to ``block``."""
    pool = manager.block_pool
    return bool(
        pool.cached_block_hash_to_block.contain(
            make_block_hash_with_group_id(key, group_id), block.block_id
        )
    )


def check_hit(manager: Any, config: Config, request: Any, blocks: Any, num_hit: int) -> None:
    """Each group's hit blocks hold the request's keys where that group's rules need blocks."""
    for group_id, (kind, block_size, extent) in enumerate(config.groups):
        found = blocks.blocks[group_id] if num_hit else []
        keys = group_keys(request, block_size)
        real = [j for j, block in enumerate(found) if not block.is_null]
        for j in real:
            assert holds_key(manager, found[j], keys[j], group_id), (kind, j)
        if kind == "full":
            assert num_hit % block_size == 0
            assert len(found) == num_hit // block_size and real == list(range(len(found)))
        elif kind == "sliding":
            assert len(found) == num_hit // block_size
            needed = -(-(extent - 1) // block_size)
            assert real[-needed:] == list(range(len(found)))[-needed:]
        elif kind == "chunked":
            assert len(found) == num_hit // block_size
            first = num_hit // extent * extent // block_size
            assert real == list(range(first, len(found)))
        else:  # Mamba: the state at the hit's end
            assert num_hit % block_size == 0 and len(found) == num_hit // block_size
            assert real == ([len(found) - 1] if found else [])


# -- the randomized run --------------------------------------------------------------------


class SimRequest:
    def __init__(self, request: Any, max_len: int) -> None:
        self.request = request
        self.rid = request.request_id
        self.max_len = max_len
        self.scheduled = 0
        self.hit = 0
        self.first_step = True


class Sim:
    """Requests through the wrapper as vLLM's scheduler drives it, over a small pool."""

    def __init__(self, config: Config, seed: int) -> None:
        self.config = config
        self.rng = random.Random(seed)
        self.wrapper = new_wrapper(config)
        self.manager = self.wrapper.manager
        self.store = self.wrapper.store
        self.active: list[SimRequest] = []
        # Each store-group key ever seen -> (tokens, features, first position).
        self.registry: dict[BlockHash, tuple[list[int], list[Any], int]] = {}
        self.registry_keys: list[BlockHash] = []
        self.num_requests = 0
        self.counts = dict.fromkeys(
            (
                "hits",
                "hit_tokens",
                "capped_hits",
                "relooked_groups",
                "copies",
                "reads_ok",
                "reads_stale",
                "aborts",
                "finished",
                "refused",
            ),
            0,
        )
        rng = self.rng
        self.bases: list[tuple[list[int], list[tuple[str, int, int]]]] = []
        for b in range(4):
            text = [rng.randrange(1, 60) for _ in range(rng.randrange(8, 40))]
            image = (RED_HEX, BLUE_HEX)[b % 2]
            tokens = text + [IMAGE_TOKEN] * 40 + [rng.randrange(1, 60) for _ in range(60)]
            self.bases.append((tokens, [(image, len(text), 40)]))

    def remember_keys(self, sim: SimRequest) -> None:
        request = sim.request
        size = self.config.store_block_size
        for j, k in enumerate(group_keys(request, size)):
            if k not in self.registry:
                self.registry[k] = (list(request.all_token_ids), request.mm_features, j * size)
                self.registry_keys.append(k)

    def new_request(self) -> None:
        rng = self.rng
        tokens, items = rng.choice(self.bases)
        length = rng.randrange(2, len(tokens) + 1)
        prompt = tokens[:length] + [rng.randrange(1, 60) for _ in range(rng.choice((0, 0, 3)))]
        features = [
            image_feature(image, offset, size)
            for image, offset, size in items
            if offset + size <= len(prompt)
        ]
        if any(t == IMAGE_TOKEN for t in prompt) and not features:
            prompt = prompt[: items[0][1]] or [1]
        salt = rng.choice((None, None, "tenant"))
        waiting = [sim for sim in self.active if sim.scheduled]
        if waiting and rng.random() < 0.5:
            # A sibling of a request whose chunk has not run: vLLM has the
            # keys of its blocks, the store not their rows yet.
            twin = rng.choice(waiting).request
            prompt = list(twin.prompt_token_ids) + [rng.randrange(1, 60)] * rng.randrange(3)
            features, salt = list(twin.mm_features), twin.cache_salt
        request = make_request(
            f"r{self.num_requests}",
            prompt,
            hasher(),
            mm_features=features,
            cache_salt=salt,
            max_tokens=64,
        )
        self.num_requests += 1
        # vLLM's own lookup (no side effect), then the wrapper's.
        raw, vllm_hit, _ = self.manager.get_computed_blocks(request)
        blocks, num_hit, _ = self.wrapper.get_computed_blocks(request)
        check_hit(self.manager, self.config, request, blocks, num_hit)
        assert num_hit <= vllm_hit
        if num_hit < vllm_hit:
            self.counts["capped_hits"] += 1
            for group_id, (_, block_size, _) in enumerate(self.config.groups[1:], start=1):
                cut = list(raw.blocks[group_id][: num_hit // block_size])
                if list(blocks.blocks[group_id]) != cut:
                    # A cut list would have been wrong for this group.
                    self.counts["relooked_groups"] += 1
        chunk = self.chunk(request, num_hit)
        if self.wrapper.allocate_slots(request, chunk, num_hit, blocks) is None:
            # The scheduler would retry it later; here it is dropped, as an abort.
            self.counts["refused"] += 1
            request.status = RequestStatus.FINISHED_ABORTED
            self.wrapper.free(request)
            return
        request.status = RequestStatus.RUNNING
        sim = SimRequest(request, request.num_tokens + rng.randrange(1, 20))
        sim.hit = num_hit
        sim.scheduled = chunk
        request.num_computed_tokens = num_hit
        if num_hit:
            self.counts["hits"] += 1
            self.counts["hit_tokens"] += num_hit
        self.remember_keys(sim)
        self.active.append(sim)

    def chunk(self, request: Any, start: int) -> int:
        """Tokens of the next chunk: up to one of the next chunk ends vLLM's scheduler allows."""
        ends = prefill_chunks(request, start)
        return ends[min(self.rng.randrange(3), len(ends) - 1)] - start

    def schedule(self, sim: SimRequest) -> None:
        request = sim.request
        remaining = request.num_tokens - request.num_computed_tokens
        if remaining == 0:
            if request.num_tokens >= sim.max_len:
                self.finish(sim, RequestStatus.FINISHED_STOPPED)
                return
            # The next token is a function of the prefix: equal prefixes decode equally.
            rows = recompute(request)
            request.append_output_token_ids(int(rows["codes"][-1, 0]) % 60 + 1)
            self.remember_keys(sim)
            remaining = 1
        chunk = self.chunk(request, request.num_computed_tokens)
        if self.wrapper.allocate_slots(request, chunk) is None:
            self.finish(sim, RequestStatus.FINISHED_ABORTED)
            return
        sim.scheduled = chunk

    def execute(self, sim: SimRequest) -> None:
        request = sim.request
        start, n = request.num_computed_tokens, sim.scheduled
        rows = recompute(request)
        step = [ScheduledRequest(request.request_id, n, start)]
        outputs = {
            "hidden_states": rows["hidden_states"][start : start + n],
            "multimodal_outputs": {"codes": rows["codes"][start : start + n]},
        }
        self.wrapper.write_outputs(step, **outputs)
        if sim.first_step:
            merged = self.wrapper.read_merged(step, **outputs)
            assert merged.misses == ()
            rid = request.request_id
            assert torch.equal(merged.hidden_states[rid], rows["hidden_states"][: start + n])
            assert torch.equal(merged.tensors["codes"][rid], rows["codes"][: start + n])
            sim.first_step = False
        request.num_computed_tokens = start + n
        sim.scheduled = 0

    def finish(self, sim: SimRequest, status: Any) -> None:
        sim.request.status = status
        self.wrapper.free(sim.request)
        self.active.remove(sim)
        key = "aborts" if status == RequestStatus.FINISHED_ABORTED else "finished"
        self.counts[key] += 1

    def adversarial_read(self) -> None:
        rng = self.rng
        size = self.config.store_block_size
        block_id = rng.randrange(1, self.config.num_blocks)
        stamp = self.store.stamp_of("hidden_states", block_id)
        k = stamp if stamp is not None and rng.random() < 0.6 else rng.choice(self.registry_keys)
        try:
            got = self.store.read_blocks("hidden_states", [block_id], [k])
        except StaleBlockError as exc:
            assert exc.found != k
            self.counts["reads_stale"] += 1
        else:
            tokens, features, first = self.registry[k]
            source = SimpleNamespace(
                mm_features=features, num_tokens=len(tokens), all_token_ids=tokens
            )
            want = recompute(source)["hidden_states"][first : first + size]
            assert torch.equal(got, want), (block_id, first)
            self.counts["reads_ok"] += 1

    def step(self) -> None:
        rng = self.rng
        roll = rng.random()
        self.wrapper.new_step_starts()
        # The copies vLLM asked for ran with the last step: release what it retained.
        copies, retained = self.wrapper.take_kv_cache_block_copies()
        tables = {b for sim in self.active for b in self.wrapper.request_block_ids(sim.rid)}
        for copy in copies:
            # Copies only ever move another group's state: the store group's hits are whole.
            assert copy.src_block_id not in tables and copy.dst_block_id not in tables
        self.counts["copies"] += len(copies)
        self.manager.block_pool.free_blocks(retained)
        if not self.active or (len(self.active) < 6 and roll < 0.25):
            self.new_request()
        elif roll < 0.35 and self.registry_keys:
            self.adversarial_read()
        elif roll < 0.38:
            sim = rng.choice(self.active)
            if not sim.scheduled:
                self.finish(sim, RequestStatus.FINISHED_ABORTED)
        else:
            sim = rng.choice(self.active)
            if not sim.scheduled:
                self.schedule(sim)
            elif roll < 0.7:
                # Chunks wait while others are looked up: their blocks have
                # keys in vLLM and no rows in the store yet.
                self.execute(sim)


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_randomized_reuse_never_serves_a_stale_row(config: Config) -> None:
    sim = Sim(config, seed=20261201)
    for _ in range(6000):
        sim.step()
    counts, stats = sim.counts, sim.wrapper.stats
    assert stats.num_hit_blocks == counts["hit_tokens"] // config.store_block_size
    store_stats = sim.store.stats
    # The run exercised what it claims to (thresholds well below what this
    # seed gives): hits, hits capped to rows not written yet, reuse, stale
    # rows detected; in hybrid configurations, groups whose capped hit is not
    # a cut of vLLM's first one; with finer hashes, vLLM's copies on write.
    assert counts["hits"] > 25 and counts["finished"] > 50 and counts["aborts"] > 20
    assert counts["reads_ok"] > 200 and counts["reads_stale"] > 500
    assert counts["capped_hits"] >= 3 and store_stats.num_evicted_stamps > 100
    assert counts["relooked_groups"] >= (1 if len(config.groups) > 1 else 0)
    assert counts["copies"] > (10 if config.name == "finer-hashes" else -1)
    assert store_stats.num_stale_reads == counts["reads_stale"]


# -- a partial hit's tail copied on write; refusals --------------------------------------


def test_a_copied_tail_block_is_never_stamped_and_never_serves_a_hit() -> None:
    config = CONFIGS[-1]  # full attention in 64-token blocks, hashes of 16, aligned Mamba
    assert config.name == "finer-hashes"
    store = TensorStore(config.num_blocks, 64, hidden_size=HIDDEN, hidden_dtype=torch.float32)
    store.register("codes", 2, torch.int64)
    # Uncapped: the wrapper takes vLLM's partial hit as it is.
    wrapper = OmniKVCacheManager(new_manager(config), store, require_stored_outputs=False)
    red = scenario_request("red", RED_HEX, None, 0)
    admit_and_compute(wrapper, red)
    red_table = wrapper.request_block_ids("red")
    red.status = RequestStatus.FINISHED_STOPPED
    wrapper.free(red)
    again = scenario_request("red-again", RED_HEX, None, 40)
    keys = group_keys(again, 64)
    wrapper.new_step_starts()
    blocks, num_hit, _ = wrapper.get_computed_blocks(again)
    assert num_hit == 144  # two whole blocks and 16 tokens of red's third (its prompt's end)
    # As vLLM's scheduler splits it for Mamba: up to the prompt's checkpoint, then the rest.
    assert prefill_chunks(again, 144) == [176, 192]
    assert wrapper.allocate_slots(again, 32, num_hit, blocks)
    table = wrapper.request_block_ids("red-again")
    copies, retained = wrapper.take_kv_cache_block_copies()
    # vLLM copies red's shared tail block into a block of the request's own.
    assert table[:2] == red_table[:2] and table[2] not in red_table
    assert (red_table[2], table[2]) in {(c.src_block_id, c.dst_block_id) for c in copies}
    wrapper.manager.block_pool.free_blocks(retained)
    # The hit the store knows of is whole blocks; the copy starts without rows.
    assert wrapper.hit_blocks("red-again") == (tuple(red_table[:2]), tuple(keys[:2]))
    assert store.stamp_of("hidden_states", table[2]) is None
    rows = recompute(again)
    for start, end in ((144, 176), (176, 192)):
        if start == 176:
            wrapper.new_step_starts()
            assert wrapper.allocate_slots(again, end - start)
        step = [ScheduledRequest("red-again", end - start, start)]
        outputs = {
            "hidden_states": rows["hidden_states"][start:end],
            "multimodal_outputs": {"codes": rows["codes"][start:end]},
        }
        wrapper.write_outputs(step, **outputs)
        merged = wrapper.read_merged(step, **outputs)
        # Tokens 128..143 live only in vLLM's KV copy: no read has the hit's rows.
        assert merged.misses == ()
        assert torch.equal(merged.hidden_states["red-again"], rows["hidden_states"][start:end])
        again.num_computed_tokens = end
    # The copy is now full (192 tokens): vLLM keys it, the store never stamps
    # it (its rows began at offset 16), so a capped lookup would not hit it.
    wrapper.cache_blocks(again, again.num_tokens)
    assert holds_key(wrapper.manager, wrapper.manager.block_pool.blocks[table[2]], keys[2], 0)
    assert store.stamp_of("hidden_states", table[2]) is None
    assert store.probe(table, keys[:3]) == 2
    # Red's own tail block kept no stamp either: its rows never filled it.
    assert store.stamp_of("hidden_states", red_table[2]) is None


def test_configurations_the_store_cannot_follow_are_refused() -> None:
    common = {"num_kv_heads": 1, "head_size": 8, "dtype": torch.float16}
    sliding = SlidingWindowSpec(block_size=16, sliding_window=32, **common)
    chunked = ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=32, **common)
    full = FullAttentionSpec(block_size=16, **common)
    store = TensorStore(16, 16)
    for specs, found in (
        ([sliding], "['sliding window']"),
        ([sliding, chunked], "['sliding window', 'chunked local attention']"),
    ):
        manager = new_hybrid_kv_cache_manager(16, specs, max_model_len=512)
        with pytest.raises(ValueError) as info:
            OmniKVCacheManager(manager, store)
        assert str(info.value) == (
            "manager: expected a full-attention KV cache group (the only kind whose blocks "
            "hold every token of a prefix, which the store's rows follow), found groups " + found
        )
        # Refused before anything changed: vLLM's collector is its own.
        assert manager.block_pool.metrics_collector is None
    cross = CrossAttentionSpec(block_size=16, **common)
    with pytest.raises(ValueError, match=r"found CrossAttentionManager for group 1"):
        OmniKVCacheManager(new_hybrid_kv_cache_manager(16, [full, cross], max_model_len=512), store)
    hybrid = new_hybrid_kv_cache_manager(16, [full, sliding], max_model_len=512)
    with pytest.raises(ValueError) as info:
        OmniKVCacheManager(hybrid, store, kv_cache_group_id=1)
    assert str(info.value) == (
        "kv_cache_group_id: expected a full-attention group [0], found group 1 (sliding window)"
    )
    coarse = new_hybrid_kv_cache_manager(
        16, [FullAttentionSpec(block_size=32, **common), sliding], max_model_len=512
    )
    with pytest.raises(
        ValueError,
        match=r"store: expected block_size 32 \(vLLM's block size in "
        r"KV cache group 0, hash block size 16\), found 16",
    ):
        OmniKVCacheManager(coarse, store)
    wrapper = OmniKVCacheManager(coarse, TensorStore(16, 32))
    assert wrapper.manager is coarse


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_the_mirror_and_a_workers_store_follow_the_store_group(config: Config) -> None:
    """The StepListener contract in hybrid models: the mirror's plans stamp the worker's store."""
    wrapper = OmniKVCacheManager(
        new_manager(config), TensorStore(config.num_blocks, config.store_block_size)
    )
    mirror = StoreMirror(wrapper)
    worker = LiveStore(
        TensorStore(
            config.num_blocks,
            config.store_block_size,
            hidden_size=HIDDEN,
            hidden_dtype=torch.float32,
        ),
        max_results=8,
    )
    hits = []
    for rid, image, salt, extra in SCENARIO:
        request = scenario_request(rid, image, salt, extra)
        rows = recompute(request)["hidden_states"]
        wrapper.new_step_starts()
        blocks, num_hit, _ = wrapper.get_computed_blocks(request)
        hits.append(num_hit)
        start = num_hit
        for end in prefill_chunks(request, num_hit):
            if start == num_hit:
                assert wrapper.allocate_slots(request, end - start, num_hit, blocks)
                request.num_computed_tokens = num_hit
            else:
                wrapper.new_step_starts()
                assert wrapper.allocate_slots(request, end - start)
            prompt = {rid: request.num_tokens} if start == num_hit else {}
            plan = mirror.plan([(rid, start, end - start)], prompt, ())
            slots = planned_slots(plan.requests, config.store_block_size)
            assert slots is not None
            worker.apply(plan, [rid], rows[start:end], torch.from_numpy(slots))
            request.num_computed_tokens = start = end
        # The worker's prompt hidden states: the hit's stored rows, then the computed ones.
        assert torch.equal(worker.take([rid])[rid], rows)  # type: ignore[arg-type]
        request.status = RequestStatus.FINISHED_STOPPED
        wrapper.free(request)
        plan = mirror.plan((), {}, (rid,))
        worker.apply(plan)
    # The mirror's stamps are the worker's, block for block.
    for block_id in range(1, config.num_blocks):
        assert wrapper.store.stamp_of("hidden_states", block_id) == worker.store.stamp_of(
            "hidden_states", block_id
        )
    assert hits == EXPECTED_HITS[config.name][1]
    assert worker.stats.num_stale_hit_blocks == 0
