"""A randomized run of the worker's staged rows over vLLM's real KV cache manager (0.32, 0.33).

`test_vllm_hybrid_sim.py` writes each step's rows before the next (the
harness's flush). Here they wait as in a worker: the first rank's store and
a tensor-parallel follower's apply the same plans to rows in the model
runner's batch order (shuffled, with padding rows at slot -1), and their
staged steps are written only when a later step needs them (a hit on their
blocks, a clear of them, a bound) or a caller between steps asks. The
worker's calls are a CPU worker's (the slot values read before the forward
pass, then `apply`) or a device's (`start_forward` first, copies of the
rows). Requests of two tenants share prefixes (some are twins of a
running request, generated tokens too: their hits reach blocks it decoded),
prefill in chunks, decode, are preempted when the pool runs out (the last
running one first) or have their allocation taken back in its step
(priority scheduling), resume from their hit, finish or are aborted; as in
vLLM, a step that preempted admits no waiting request. An idle engine's
prefix cache is reset.

Checked: whenever a caller has the staged rows written, the scheduler's
table, the first rank's store and the follower's stamp the same blocks with
the same keys; every prompt's hidden states are the stand-in model's rows
computed from scratch for its tenant (every position's, for those that
ask for all, once the worker hears they ended), and so are the hit rows
each rank scores for the requests that ask for their prompt's outputs (the
follower gets the first rank's); no hit is stale, no slot unplanned, and
both ranks write the same rows. The engine goes idle in the last 30 steps
of every 300.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import pytest
import torch
from helpers import block_slots
from test_vllm_integration import VLLM_MISSING
from vllm_managers import new_kv_cache_manager

from omnicache.integrations.vllm import OmniKVCacheManager, RequestBlockHasher, make_request
from omnicache.integrations.vllm.hits import ScoredHit
from omnicache.integrations.vllm.live_store import LiveStore, follower_store
from omnicache.integrations.vllm.staged_steps import MAX_STAGED_BYTES
from omnicache.store import HIDDEN_STATES, TensorStore

pytestmark = pytest.mark.skipif(VLLM_MISSING is not None, reason=VLLM_MISSING or "")

if VLLM_MISSING is None:
    from vllm.v1.request import RequestStatus

BLOCK_SIZE = 4
HIDDEN = 4
ROW_BYTES = HIDDEN * 4  # float32
NAMESPACE = "org/staged-sim"
# Prompts start with a cut of one of these (4 blocks each), then a few tokens of their own.
PREFIXES = [list(range(1 + 16 * p, 17 + 16 * p)) for p in range(3)]
MAX_LEN = 28  # 7 blocks: a request alone always fits the smallest pool (9 blocks)


def model_rows(request: Any) -> torch.Tensor:
    """Every position's hidden states, as a model computes them from scratch.

    Row i depends on the request's tenant (its cache salt) and on every token
    up to i, and on nothing else; values are integers below 2**20, exact in
    float32.
    """
    salt = (request.cache_salt or "").encode()
    state = int.from_bytes(hashlib.blake2b(salt, digest_size=3).digest(), "little")
    values: list[list[int]] = []
    for token_id in request.all_token_ids:
        state = (state * 1_000_003 + token_id * 131 + 17) % (1 << 24)
        values.append([(state + 977 * d) % (1 << 20) for d in range(HIDDEN)])
    return torch.tensor(values, dtype=torch.float32)


def next_token(request: Any) -> int:
    """The token sampled after the request's tokens: equal prefixes decode equally."""
    return int(model_rows(request)[-1, 0]) % 47 + 1


class Config(NamedTuple):
    name: str
    # Blocks of the KV cache (vLLM's null block included): a small pool is
    # reused over and over, a large one lets staged rows wait longer.
    num_blocks: int
    # The worker's calls as on a device (`start_forward` before the forward pass).
    device: bool
    # `LiveStore.copy_steps`.
    copy_steps: bool | None
    # `LiveStore.max_staged_bytes`.
    max_staged_bytes: int
    # How often a caller between steps has the staged rows written (and the stamps compared).
    compare_rate: float


CONFIGS = [
    Config("cpu", 10, False, None, MAX_STAGED_BYTES, 0.2),
    Config("cpu-copies", 14, False, True, MAX_STAGED_BYTES, 0.2),
    Config("cpu-8-rows", 24, False, None, 8 * ROW_BYTES, 0.2),
    Config("cpu-rarely-asked", 64, False, None, MAX_STAGED_BYTES, 0.002),
    Config("device", 14, True, True, MAX_STAGED_BYTES, 0.2),
    Config("device-8-rows", 24, True, True, 8 * ROW_BYTES, 0.05),
    Config("device-rarely-asked", 64, True, True, MAX_STAGED_BYTES, 0.002),
    Config("written-at-once", 10, False, None, 0, 0.2),
]


class Scores:
    """A rank's scorer (`HitLogprobs`): each hit's stored rows it gets are the model's."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.num_scored = 0

    def wants(self, req_id: str) -> bool:
        return req_id in self.sim.scored

    def score(self, rows: torch.Tensor, block_size: int, prompts: Sequence[ScoredHit]) -> None:
        blocks = rows.view(-1, block_size, HIDDEN)
        for prompt in prompts:
            # NOTE: None: the hit's rows could not be read (a stale hit).
            assert prompt.blocks is not None, prompt.req_id
            got = blocks[list(prompt.blocks)].reshape(-1, HIDDEN)
            request = self.sim.requests[prompt.req_id]
            assert torch.equal(got, model_rows(request)[: prompt.num_tokens]), prompt.req_id
            self.num_scored += 1


class Sim:
    """Requests through vLLM's manager, the mirror and two ranks' stores, step by step."""

    def __init__(self, config: Config) -> None:
        self.config = config
        # NOTE: a string seed is hashed the same way in every process.
        self.rng = random.Random(f"staged-sim/{config.name}")
        self.num_blocks = config.num_blocks
        manager = new_kv_cache_manager(self.num_blocks, BLOCK_SIZE, max_model_len=MAX_LEN)
        self.wrapper = OmniKVCacheManager(manager)
        self.mirror = self.wrapper.attach_mirror()
        self.hasher = RequestBlockHasher(BLOCK_SIZE, namespace=NAMESPACE)
        store = TensorStore(
            self.num_blocks, BLOCK_SIZE, hidden_size=HIDDEN, hidden_dtype=torch.float32
        )
        options: dict[str, Any] = {
            "max_results": 64,
            "max_staged_bytes": config.max_staged_bytes,
            "copy_steps": config.copy_steps,
        }
        # NOTE: the ranks' broadcast of a step's scored hit rows: the first
        # rank applies each step first, the follower gets its rows.
        shared: list[torch.Tensor] = []

        def send(rows: torch.Tensor) -> torch.Tensor:
            shared[:] = [rows.clone()]
            return rows

        self.scores = (Scores(self), Scores(self))
        self.first = LiveStore(store, share=send, hit_logprobs=self.scores[0], **options)
        self.follower = LiveStore(
            follower_store(self.num_blocks, BLOCK_SIZE),
            share=lambda _: shared.pop(),
            hit_logprobs=self.scores[1],
            keeps_results=False,
            **options,
        )
        # Requests by id, and those that ask for their prompt's outputs (scored from the store).
        self.requests: dict[str, Any] = {}
        self.scored: set[str] = set()
        self.waiting: list[Any] = []
        self.running: list[Any] = []
        self.max_len: dict[str, int] = {}
        # Requests that ask for their prompt's hidden states; those the worker
        # has seen (a first step sends the ask), those whose prompt rows were
        # taken, and those finished since the last plan.
        self.asks: set[str] = set()
        # Those of them that ask for every position's (gathered until they end).
        self.every: set[str] = set()
        self.seen: set[str] = set()
        self.collected: set[str] = set()
        self.finished: list[str] = []
        self.num_requests = 0
        self.num_steps = 0
        self.counts = dict.fromkeys(
            (
                "twins",
                "hit_blocks",
                "preemptions",
                "taken_back",
                "resumed_hits",
                "aborts",
                "finished",
                "resets",
                "shuffled",
                "padded",
                "results",
                "every_position_results",
                "comparisons",
                "cleared_blocks",
            ),
            0,
        )

    # -- the scheduler -------------------------------------------------------------------

    def new_request(self) -> None:
        rng = self.rng
        if self.running and rng.random() < 0.3:
            # A twin of a running request, its generated tokens too: its hit
            # reaches the blocks that request decoded (staged, or written).
            twin = rng.choice(self.running)
            prompt = list(twin.all_token_ids)[: MAX_LEN - 2 - rng.randrange(3)]
            salt = twin.cache_salt
            self.counts["twins"] += 1
        else:
            prefix = rng.choice(PREFIXES)
            prompt = prefix[: rng.randrange(len(prefix) + 1)]
            prompt += [rng.randrange(1, 48) for _ in range(rng.randrange(1, 6))]
            salt = rng.choice((None, None, "tenant-b"))
        request_id = f"r{self.num_requests}"
        self.num_requests += 1
        request = make_request(request_id, prompt, self.hasher, cache_salt=salt)
        self.max_len[request_id] = min(MAX_LEN, len(prompt) + rng.randrange(1, 8))
        if rng.random() < 0.5:
            self.asks.add(request_id)
            if rng.random() < 0.3:
                self.every.add(request_id)
        if rng.random() < 0.3:
            self.scored.add(request_id)
        self.requests[request_id] = request
        self.waiting.append(request)

    def chunk(self, request: Any, start: int) -> int:
        """The tokens a step computes of the request: up to a chunk of 1 to 7."""
        return min(request.num_tokens - start, self.rng.randrange(1, 8))

    def preempt(self, request: Any) -> None:
        """As vLLM's scheduler: freed, its computed tokens forgotten, first to resume."""
        self.running.remove(request)
        self.wrapper.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.insert(0, request)
        self.counts["preemptions"] += 1

    def end(self, request: Any, status: Any) -> None:
        self.running.remove(request)
        request.status = status
        self.wrapper.free(request)
        self.finished.append(request.request_id)
        self.counts["aborts" if status == RequestStatus.FINISHED_ABORTED else "finished"] += 1

    def allocate(self, request: Any, num_new: int) -> bool:
        """A running request's slots for ``num_new`` more tokens; False: it was preempted.

        As vLLM's scheduler: the last running request (one not yet scheduled
        in this step, or this one) is preempted until the allocation fits.
        """
        while self.wrapper.allocate_slots(request, num_new) is None:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is request:
                return False
        return True

    def schedule(self) -> list[tuple[Any, int]]:
        """One step's allocations: running requests first, then waiting ones while they fit.

        As vLLM's scheduler (0.32, 0.33), a step that preempted a request
        admits no waiting one.
        """
        rng = self.rng
        scheduled: list[tuple[Any, int]] = []
        preemptions = self.counts["preemptions"]
        for request in list(self.running):
            if request not in self.running or rng.random() < 0.15:
                continue
            num_new = self.chunk(request, request.num_computed_tokens)
            if self.allocate(request, num_new):
                scheduled.append((request, num_new))
            if len(scheduled) > 1 and rng.random() < 0.03:
                # NOTE: vLLM's priority scheduling takes an allocation of this
                # step back (preempts a request it scheduled), before it looks
                # up the waiting requests: the mirror undoes it.
                taken, _ = scheduled.pop(rng.randrange(len(scheduled) - 1))
                self.preempt(taken)
                self.counts["taken_back"] += 1
        while self.counts["preemptions"] == preemptions and self.waiting and rng.random() < 0.8:
            request = self.waiting[0]
            blocks, num_hit, _ = self.wrapper.get_computed_blocks(request)
            num_new = self.chunk(request, num_hit)
            if self.wrapper.allocate_slots(request, num_new, num_hit, blocks) is None:
                break
            self.waiting.pop(0)
            if request.status == RequestStatus.PREEMPTED and num_hit:
                self.counts["resumed_hits"] += 1
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            self.running.append(request)
            scheduled.append((request, num_new))
            self.counts["hit_blocks"] += num_hit // BLOCK_SIZE
        return scheduled

    # -- the step ------------------------------------------------------------------------

    def step(self) -> None:
        rng = self.rng
        self.num_steps += 1
        # NOTE: no arrivals in the last 30 steps of every 300: the engine goes idle.
        for _ in range(0 if self.num_steps % 300 >= 270 else rng.choice((0, 0, 1, 2))):
            if len(self.waiting) + len(self.running) < 8:
                self.new_request()
        if not self.running and rng.random() < 0.3:
            # vLLM resets the prefix cache only while no block is in use.
            assert self.wrapper.reset_prefix_cache() is True
            self.counts["resets"] += 1
        if self.running and rng.random() < 0.02:
            self.end(rng.choice(self.running), RequestStatus.FINISHED_ABORTED)
        scheduled = self.schedule()
        items = [(r.request_id, r.num_computed_tokens, n) for r, n in scheduled]
        prompts = {
            r.request_id: r.num_prompt_tokens
            for r, _ in scheduled
            if r.request_id in self.asks and r.request_id not in self.seen
        }
        self.seen.update(prompts)
        # NOTE: the connector gives each result its key; here the request's id.
        every = [request_id for request_id in prompts if request_id in self.every]
        plan = replace(
            self.mirror.plan(items, prompts, self.finished, sequence_requests=every),
            result_keys={r: r for r in prompts},
        )
        self.finished = []
        self.counts["cleared_blocks"] += len(plan.cleared_block_ids)
        self.run_workers(plan, scheduled)
        for request, num_new in scheduled:
            request.num_computed_tokens += num_new
        if rng.random() < self.config.compare_rate:
            self.compare()
        for request, _ in scheduled:
            self.collect(request)
        for request_id in plan.finished_req_ids:
            self.collect_every(request_id)
        for request, _ in scheduled:
            if request.num_computed_tokens < request.num_tokens:
                continue
            if request.num_tokens >= self.max_len[request.request_id]:
                self.end(request, RequestStatus.FINISHED_LENGTH_CAPPED)
            else:
                request.append_output_token_ids(next_token(request))

    def run_workers(self, plan: Any, scheduled: list[tuple[Any, int]]) -> None:
        """Each rank's step: the rows of the model runner's batch, at their slots."""
        rng = self.rng
        batch = list(scheduled)
        if len(batch) > 1 and rng.random() < 0.3:
            rng.shuffle(batch)
            self.counts["shuffled"] += 1
        pad = rng.choice((0, 0, 0, 2)) if batch else 0
        self.counts["padded"] += bool(pad)
        parts: list[torch.Tensor] = []
        slots: list[int] = []
        for request, num_new in batch:
            start = request.num_computed_tokens
            parts.append(model_rows(request)[start : start + num_new])
            block_ids = self.wrapper.request_block_ids(request.request_id)
            slots += block_slots(block_ids, BLOCK_SIZE)[start : start + num_new]
        order = [request.request_id for request, _ in batch]
        for live in (self.first, self.follower):
            if self.config.device:
                live.start_forward(plan)
            if not batch:
                live.apply(plan)
                continue
            # NOTE: each rank's rows in memory of their own, as each computes them.
            rows = torch.cat([*parts, torch.zeros(pad, HIDDEN)])
            mapping = torch.tensor(slots + [-1] * pad, dtype=torch.int64)
            values = live.decode_slot_values(plan, mapping)
            live.apply(plan, order, rows, mapping, slot_values=values)

    # -- the checks ----------------------------------------------------------------------

    def collect(self, request: Any) -> None:
        """The prompt's hidden states once the worker has them all: exact, never refused."""
        request_id = request.request_id
        if (
            request_id not in self.asks
            or request_id in self.every
            or request_id in self.collected
            or request.num_computed_tokens < request.num_prompt_tokens
        ):
            return
        self.take_exact(request, request.num_prompt_tokens)
        self.collected.add(request_id)
        self.counts["results"] += 1

    def collect_every(self, request_id: str) -> None:
        """Every position's hidden states, once the worker heard the request ended: exact."""
        if request_id not in self.every or request_id not in self.seen:
            return
        request = self.requests[request_id]
        self.take_exact(request, request.num_computed_tokens)
        self.counts["every_position_results"] += 1

    def take_exact(self, request: Any, num_rows: int) -> None:
        """The request's result from the first rank: its model's first ``num_rows`` rows."""
        request_id = request.request_id
        rows = self.first.results.take({request_id: request_id})[request_id]
        assert isinstance(rows, torch.Tensor), (request_id, rows)
        assert torch.equal(rows, model_rows(request)[:num_rows]), request_id

    def compare(self) -> None:
        """A caller has both ranks' staged rows written: every stamp agrees with the table's."""
        self.first.flush()
        self.follower.flush()
        table = self.mirror.table.stamps
        for live in (self.first, self.follower):
            stamps = [live.store.stamp_of(HIDDEN_STATES, b) for b in range(self.num_blocks)]
            assert stamps == table
        self.counts["comparisons"] += 1


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_staged_rows_keep_every_stamp_exact_under_random_schedules(config: Config) -> None:
    sim = Sim(config)
    for _ in range(1500):
        sim.step()
    while sim.running:
        sim.end(sim.running[0], RequestStatus.FINISHED_ABORTED)
    sim.step()
    sim.compare()
    first, follower = sim.first.stats, sim.follower.stats
    assert (first.num_stale_hit_blocks, first.num_slot_mismatches) == (0, 0)
    assert (follower.num_stale_hit_blocks, follower.num_slot_mismatches) == (0, 0)
    assert first.num_prompt_failures == 0
    assert first.num_rows_written == follower.num_rows_written
    # Every rank scored each hit of a request that asks, from the first rank's rows.
    assert first.num_score_failures == follower.num_score_failures == 0
    assert sim.scores[0].num_scored == sim.scores[1].num_scored == first.num_scored_requests
    # The run exercised what it claims to (thresholds well below what each
    # configuration's seed gives).
    counts = sim.counts
    assert first.num_scored_requests > 50
    assert counts["every_position_results"] > 30
    assert counts["results"] > 100 and counts["twins"] > 50 and counts["hit_blocks"] > 300
    assert counts["aborts"] > 10 and counts["finished"] > 200 and counts["resets"] >= 10
    assert counts["preemptions"] > 50 and counts["resumed_hits"] > 40
    assert counts["taken_back"] > 15 and counts["cleared_blocks"] > 1000
    assert counts["shuffled"] > 200 and counts["padded"] > 200
    rare = config.compare_rate < 0.01
    assert counts["comparisons"] >= (1 if rare else 1500 * config.compare_rate / 2)
    assert first.num_decode_steps > (30 if config.max_staged_bytes else -1)
