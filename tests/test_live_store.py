"""LiveStore: a worker's store applied step by step from StepPlans (no engine, no vLLM)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import cast

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omnicache.block_hash import BlockHash
from omnicache.integrations.vllm.block_tables import WorkerTable
from omnicache.integrations.vllm.hits import ScoredHit
from omnicache.integrations.vllm.live_store import LiveStore
from omnicache.integrations.vllm.plan import (
    LoadOrder,
    PlannedRequest,
    StepPlan,
    planned_slots,
)
from omnicache.integrations.vllm.staged_steps import (
    MAX_STAGED_BYTES,
    MAX_STAGED_STEPS,
    default_max_staged_bytes,
)
from omnicache.store import HIDDEN_STATES, TensorStore

BS = 4  # tokens per block
HIDDEN = 3
K = [BlockHash(bytes([i]) * 32) for i in range(8)]


@pytest.fixture(params=[None, True], ids=["rows-as-computed", "copies"])
def copy_steps(request: pytest.FixtureRequest) -> bool | None:
    """How a staged step keeps its rows: the CPU's own rows and slot values, or copies (a GPU's)."""
    return cast("bool | None", request.param)


def new_live(
    max_results: int = 8,
    *,
    copy_steps: bool | None,
    num_blocks: int = 8,
    max_staged_bytes: int = MAX_STAGED_BYTES,
) -> LiveStore:
    return LiveStore(
        TensorStore(num_blocks, BS, hidden_size=HIDDEN, hidden_dtype=torch.float32),
        max_results=max_results,
        max_staged_bytes=max_staged_bytes,
        copy_steps=copy_steps,
    )


def rows(first: int, count: int) -> torch.Tensor:
    """Distinct rows: row i holds first + i in every column."""
    return torch.arange(first, first + count, dtype=torch.float32)[:, None].repeat(1, HIDDEN)


def slots_of(plan: StepPlan, order: list[str], padding: int = 0) -> torch.Tensor:
    by_id = {item.req_id: item for item in plan.requests}
    slots = planned_slots([by_id[req_id] for req_id in order], BS)
    assert slots is not None
    return torch.tensor(slots + [-1] * padding, dtype=torch.int64)


def run_step(
    live: LiveStore,
    plan: StepPlan,
    batch_order: Sequence[str],
    hidden_states: torch.Tensor,
    slot_mapping: torch.Tensor | None = None,
) -> dict[int, BlockHash]:
    """A step with a forward pass, as the worker applies it: a decode step's slot values
    read first (`LiveStore.decode_slot_values`, before the forward pass), then `apply`."""
    values = None if slot_mapping is None else live.decode_slot_values(plan, slot_mapping)
    return live.apply(plan, batch_order, hidden_states, slot_mapping, slot_values=values)


def numbered_decode(
    req_id: str, position: int, block: int, number: int, cleared: tuple[int, ...] = ()
) -> StepPlan:
    """A steady decode step of one request, numbered as the scheduler's mirror numbers its
    plans (`StepPlan.number`), clearing ``cleared``."""
    return StepPlan(
        caching=True,
        requests=(PlannedRequest(req_id, position, 1, (block,)),),
        cleared_block_ids=cleared,
        decode=True,
        number=number,
    )


def test_planned_slots() -> None:
    plan = [PlannedRequest("a", 2, 4, (5, 2)), PlannedRequest("b", 8, 1, (3,))]
    assert planned_slots(plan, BS) == [22, 23, 8, 9, 12]
    # From the middle of a block across two more; a request without tokens adds none.
    across = [PlannedRequest("c", 3, 6, (7, 1, 9)), PlannedRequest("d", 5, 0)]
    assert planned_slots(across, BS) == [31, 4, 5, 6, 7, 36]
    assert planned_slots([PlannedRequest("c", 3, 6, (7, 1))], BS) is None
    assert planned_slots([PlannedRequest("a", 0, 2)], BS) is None
    assert planned_slots([PlannedRequest("a", 0, 5, (1,))], BS) is None


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 7 * BS - 1), st.integers(1, 3 * BS + 2), st.booleans()),
        min_size=1,
        max_size=12,
    ),
    st.permutations(range(1, 8)),
)
def test_the_worker_table_stamps_and_fills_blocks_as_the_store_does(
    writes: list[tuple[int, int, bool]], table_order: list[int]
) -> None:
    # The scheduler's mirror of the worker's store: each write is a request's
    # tokens start..stop-1 in the blocks of its block table (table_order),
    # with or without the keys of those blocks.
    store = TensorStore(8, BS, hidden_size=HIDDEN, hidden_dtype=torch.float32)
    table = WorkerTable(8, BS)
    for start, num_new, keyed in writes:
        stop = min(start + num_new, len(table_order) * BS)
        block_ids = table_order[start // BS : (stop - 1) // BS + 1]
        keys = {block: K[block] for block in block_ids} if keyed else {}
        table.write_tokens(block_ids, start, stop, keys)
        slots = [table_order[p // BS] * BS + p % BS for p in range(start, stop)]
        store.write(HIDDEN_STATES, rows(start, len(slots)), slots, block_keys=keys)
        for block in range(8):
            assert table.stamps[block] == store.stamp_of(HIDDEN_STATES, block)
            assert table.filled[block] == store.filled_of(HIDDEN_STATES, block)


def test_a_hit_reads_the_stored_rows_then_the_steps_rows(copy_steps: bool | None) -> None:
    live = new_live(copy_steps=copy_steps)
    # Request "a": 9 prompt tokens in blocks 1, 2, 3; the first two blocks are full.
    first = StepPlan(
        caching=True,
        requests=(PlannedRequest("a", 0, 9, (1, 2, 3)),),
        block_keys={1: K[1], 2: K[2]},
        prompt_requests={"a": 9},
        result_keys={"a": "key-a"},
    )
    run_step(live, first, ["a"], rows(100, 11), slots_of(first, ["a"], padding=2))
    # Nothing reads its blocks yet: its rows wait, and its prompt's rows are gathered.
    assert live.stats.num_rows_written == 0 and live.store.stamp_of(HIDDEN_STATES, 1) is None
    # Request "b" hits blocks 1 and 2 and computes its last 2 prompt tokens in block 4,
    # in the same step as a decode token of "a".
    second = StepPlan(
        caching=True,
        requests=(
            PlannedRequest("a", 9, 1, (3,)),
            PlannedRequest("b", 8, 2, (4,), (1, 2), (K[1], K[2])),
        ),
        prompt_requests={"b": 10},
        result_keys={"b": "key-b"},
    )
    run_step(live, second, ["b", "a"], rows(500, 3), slots_of(second, ["b", "a"]))
    # b's hit is in blocks a's staged rows fill: they are written first, then the step's.
    assert [live.store.stamp_of(HIDDEN_STATES, block) for block in (1, 2, 3)] == [K[1], K[2], None]
    assert live.stats.num_rows_written == 12
    found = live.results.take({"a": "key-a", "b": "key-b", "c": "key-c"})
    assert sorted(found) == ["a", "b"]
    assert torch.equal(found["a"], rows(100, 9))  # type: ignore[arg-type]
    assert torch.equal(found["b"], torch.cat([rows(100, 8), rows(500, 2)]))  # type: ignore[arg-type]
    stats = live.stats
    assert (stats.num_hit_requests, stats.num_hit_blocks, stats.num_stale_hit_blocks) == (1, 2, 0)
    assert (stats.num_prompt_results, stats.num_rows_written, stats.num_pending_results) == (
        2,
        12,
        0,
    )
    assert live.results.take({"a": "key-a", "b": "key-b"}) == {}


def test_requests_sharing_hit_blocks_get_each_their_own_blocks_then_their_rows(
    copy_steps: bool | None,
) -> None:
    live = new_live(copy_steps=copy_steps)
    # Request "a" fills blocks 1, 2 and 3 (12 tokens, every block full).
    first = StepPlan(
        caching=True,
        requests=(PlannedRequest("a", 0, 12, (1, 2, 3)),),
        block_keys={1: K[1], 2: K[2], 3: K[3]},
    )
    run_step(live, first, ["a"], rows(100, 12), slots_of(first, ["a"]))
    # "b" hits blocks 1 and 2, "c" blocks 1 and 3: each block is read once, in
    # the batch's order (c's first), so b's are not next to each other there.
    second = StepPlan(
        caching=True,
        requests=(
            PlannedRequest("b", 8, 1, (4,), (1, 2), (K[1], K[2])),
            PlannedRequest("c", 8, 1, (5,), (1, 3), (K[1], K[3])),
        ),
        prompt_requests={"b": 9, "c": 9},
        result_keys={"b": "key-b", "c": "key-c"},
    )
    run_step(live, second, ["c", "b"], rows(500, 2), slots_of(second, ["c", "b"]))
    found = live.results.take({"b": "key-b", "c": "key-c"})
    assert torch.equal(found["b"], torch.cat([rows(100, 8), rows(501, 1)]))  # type: ignore[arg-type]
    assert torch.equal(  # type: ignore[arg-type]
        found["c"], torch.cat([rows(100, 4), rows(108, 4), rows(500, 1)])
    )
    assert live.store.stats.num_hit_blocks_read == 3
    assert (live.stats.num_hit_blocks, live.stats.num_prompt_results) == (4, 2)


def test_a_prompt_hit_no_other_request_needs_is_read_into_its_result_the_shared_ones_once(
    copy_steps: bool | None,
) -> None:
    live = new_live(copy_steps=copy_steps, num_blocks=16)
    # Request "a" fills blocks 1 to 6 (24 tokens, every block full).
    first = StepPlan(
        caching=True,
        requests=(PlannedRequest("a", 0, 24, (1, 2, 3, 4, 5, 6)),),
        block_keys={block: K[block] for block in range(1, 7)},
    )
    run_step(live, first, ["a"], rows(100, 24), slots_of(first, ["a"]))
    # "b" alone hits blocks 1 and 2; "c" and "d" share block 3; "e" hits blocks
    # 5 and 6 without asking; "f" hits block 6 under another key (stale).
    second = StepPlan(
        caching=True,
        requests=(
            PlannedRequest("b", 8, 1, (8,), (1, 2), (K[1], K[2])),
            PlannedRequest("c", 8, 2, (9,), (3, 4), (K[3], K[4])),
            PlannedRequest("d", 4, 1, (10,), (3,), (K[3],)),
            PlannedRequest("e", 8, 1, (11,), (5, 6), (K[5], K[6])),
            PlannedRequest("f", 4, 1, (12,), (6,), (K[7],)),
        ),
        prompt_requests={"b": 9, "c": 10, "d": 5, "f": 5},
        result_keys={"b": "key-b", "c": "key-c", "d": "key-d", "f": "key-f"},
    )
    order = ["f", "d", "c", "b", "e"]
    run_step(live, second, order, rows(500, 6), slots_of(second, order))
    found = live.results.take({"b": "key-b", "c": "key-c", "d": "key-d", "f": "key-f"})
    assert found["f"] is None
    assert torch.equal(found["d"], torch.cat([rows(108, 4), rows(501, 1)]))  # type: ignore[arg-type]
    assert torch.equal(found["c"], torch.cat([rows(108, 8), rows(502, 2)]))  # type: ignore[arg-type]
    assert torch.equal(found["b"], torch.cat([rows(100, 8), rows(504, 1)]))  # type: ignore[arg-type]
    # b's blocks, read into its result: its own memory, no more.
    b_rows = cast("torch.Tensor", found["b"])
    assert b_rows.untyped_storage().nbytes() == b_rows.numel() * b_rows.element_size()
    # Blocks 1 and 2 for "b", 3 and 4 for "c" and "d": each read once.
    assert live.store.stats.num_hit_blocks_read == 4
    stats = live.stats
    assert (stats.num_hit_requests, stats.num_hit_blocks, stats.num_stale_hit_blocks) == (5, 8, 1)
    assert (stats.num_prompt_results, stats.num_prompt_failures) == (3, 1)


def test_a_hit_on_a_cleared_block_is_counted_and_never_served(copy_steps: bool | None) -> None:
    live = new_live(copy_steps=copy_steps)
    plan = StepPlan(
        caching=True,
        requests=(PlannedRequest("a", 0, 8, (1, 2)),),
        block_keys={1: K[1], 2: K[2]},
    )
    run_step(live, plan, ["a"], rows(0, 8), slots_of(plan, ["a"]))
    hit = StepPlan(
        caching=True,
        requests=(PlannedRequest("b", 8, 1, (5,), (1, 2), (K[1], K[2])),),
        prompt_requests={"b": 9},
        result_keys={"b": "key-b"},
        cleared_block_ids=(2,),
    )
    run_step(live, hit, ["b"], rows(50, 1), slots_of(hit, ["b"]))
    assert live.results.take({"b": "key-b"}) == {"b": None}
    stats = live.stats
    assert (stats.num_stale_hit_blocks, stats.num_prompt_failures, stats.num_cleared_blocks) == (
        1,
        1,
        1,
    )
    # Found stale when verified: its rows were never read.
    assert (live.store.stats.num_stale_reads, live.store.stats.num_hit_blocks_read) == (0, 0)


def test_slots_other_than_planned_stamp_nothing(copy_steps: bool | None) -> None:
    live = new_live(copy_steps=copy_steps)
    plan = StepPlan(caching=True, requests=(PlannedRequest("a", 0, 4, (1,)),), block_keys={1: K[1]})
    run_step(live, plan, ["a"], rows(0, 4), torch.tensor([8, 9, 10, 11]))
    # A prefill step that only writes waits to be written, as a decode step does.
    assert live.stats.num_rows_written == live.stats.num_slot_mismatches == 0
    assert live.flush() == {}
    assert live.stats.num_slot_mismatches == 1
    assert live.store.stamp_of(HIDDEN_STATES, 1) is None
    assert live.store.stamp_of(HIDDEN_STATES, 2) is None
    assert live.store.filled_of(HIDDEN_STATES, 2) == BS


def test_prompt_across_chunks_results_capped_and_unfinished_dropped(
    copy_steps: bool | None,
) -> None:
    live = new_live(max_results=1, copy_steps=copy_steps)
    for req_id in ("a", "b"):
        plans = [
            StepPlan(
                False,
                (PlannedRequest(req_id, 0, 3),),
                prompt_requests={req_id: 5},
                result_keys={req_id: req_id},
            ),
            StepPlan(False, (PlannedRequest(req_id, 3, 2),)),
        ]
        for plan, part in zip(plans, (rows(0, 3), rows(3, 2)), strict=True):
            run_step(live, plan, [req_id], part)
    live.apply(
        StepPlan(
            False, (PlannedRequest("c", 0, 2),), prompt_requests={"c": 4}, result_keys={"c": "c"}
        ),
        ["c"],
        rows(0, 2),
    )
    live.apply(StepPlan(False, finished_req_ids=("c",)))
    assert list(live.results.take({"a": "a", "b": "b", "c": "c"})) == ["b"]
    stats = live.stats
    assert (stats.num_results_dropped, stats.num_incomplete_dropped, stats.num_rows_written) == (
        1,
        1,
        0,
    )


def test_rows_of_other_requests_than_planned_are_refused(copy_steps: bool | None) -> None:
    live = new_live(copy_steps=copy_steps)
    plan = StepPlan(caching=False, requests=(PlannedRequest("a", 0, 2),))
    with pytest.raises(RuntimeError, match=r"expected rows of the planned requests \['a'\]"):
        run_step(live, plan, ["b"], rows(0, 2))
    with pytest.raises(ValueError, match=r"max_results: expected"):
        LiveStore(
            TensorStore(8, BS, hidden_size=HIDDEN, hidden_dtype=torch.float32),
            max_results=0,
            copy_steps=copy_steps,
        )
    with pytest.raises(ValueError, match=r"store: expected an entry 'hidden_states', found \[\]"):
        LiveStore(TensorStore(8, BS), max_results=1, copy_steps=copy_steps)


def test_a_result_is_taken_with_its_key_only_and_within_the_size_asked(
    copy_steps: bool | None,
) -> None:
    live = new_live(copy_steps=copy_steps)
    plan = StepPlan(
        False, (PlannedRequest("a", 0, 5),), prompt_requests={"a": 5}, result_keys={"a": "k-a"}
    )
    run_step(live, plan, ["a"], rows(0, 5))
    # A forged key, or none of the right length, finds nothing and takes nothing.
    assert live.results.take({"a": "k-b"}) == {}
    assert live.results.take({"a": ""}) == {}
    # Over the size asked: its size, and it stays (5 rows x 3 float32 values).
    assert live.results.take({"a": "k-a"}, max_bytes=59) == {"a": 60}
    assert live.stats.num_pending_results == 1
    found = live.results.take({"a": "k-a"}, max_bytes=60)
    assert torch.equal(found["a"], rows(0, 5))  # type: ignore[arg-type]
    assert live.results.take({"a": "k-a"}) == {}
    with pytest.raises(TypeError, match=r"requests\['a'\]: expected str, found int"):
        live.results.take({"a": 1})  # type: ignore[dict-item]


def test_every_position_is_gathered_until_the_request_finishes_or_its_count_is_taken(
    copy_steps: bool | None,
) -> None:
    live = new_live(copy_steps=copy_steps)
    # "a": a prompt of 5 in two chunks, then 3 decode steps; "b" the same, finished later.
    for req_id in ("a", "b"):
        first = StepPlan(
            False,
            (PlannedRequest(req_id, 0, 3),),
            prompt_requests={req_id: 5},
            sequence_requests=frozenset({req_id}),
            result_keys={req_id: f"k-{req_id}"},
        )
        run_step(live, first, [req_id], rows(0, 3))
        for start, count in ((3, 2), (5, 1), (6, 1), (7, 1)):
            live.apply(StepPlan(False, (PlannedRequest(req_id, start, count),)), [req_id],
                       rows(start, count))  # fmt: skip
    # Finished for its caller before the worker hears of it: its count takes it.
    assert live.results.take({"a": "k-a"}) == {}
    assert live.results.take({"a": "k-b"}, num_positions={"a": 8}) == {}
    found = live.results.take({"a": "k-a"}, num_positions={"a": 8})
    assert torch.equal(found["a"], rows(0, 8))  # type: ignore[arg-type]
    assert live.results.take({"a": "k-a"}, num_positions={"a": 8}) == {}
    # Finished in the plan: complete; a count past its rows serves nothing.
    live.apply(StepPlan(False, finished_req_ids=("a", "b")))
    assert live.stats.num_incomplete_dropped == 0
    assert live.results.take({"b": "k-b"}, num_positions={"b": 9}) == {"b": None}
    with pytest.raises(ValueError, match=r"num_positions\['b'\]: expected int >= 0, found -1"):
        live.results.take({"b": "k-b"}, num_positions={"b": -1})


class Scores:
    """A scorer that scores every request in ``wanted`` by keeping the rows it was handed."""

    def __init__(self, wanted: set[str]) -> None:
        self.wanted = wanted
        self.scored: list[tuple[str, int, torch.Tensor | None]] = []
        self.num_rows: list[int] = []

    def wants(self, req_id: str) -> bool:
        return req_id in self.wanted

    def score(self, rows: torch.Tensor, block_size: int, prompts: Sequence[ScoredHit]) -> None:
        self.num_rows.append(len(rows))
        for prompt in prompts:
            mine = None
            if prompt.blocks is not None:
                mine = rows.view(-1, block_size, HIDDEN)[list(prompt.blocks)].flatten(0, 1)
                assert len(mine) == prompt.num_tokens
            self.scored.append((prompt.req_id, prompt.num_tokens, mine))


def test_the_scorer_gets_each_verified_hit_s_rows_once_and_none_for_a_stale_hit(
    copy_steps: bool | None,
) -> None:
    scorer = Scores({"b", "c", "d"})
    live = LiveStore(
        TensorStore(8, BS, hidden_size=HIDDEN, hidden_dtype=torch.float32),
        max_results=8,
        hit_logprobs=scorer,
        copy_steps=copy_steps,
    )
    first = StepPlan(
        caching=True,
        requests=(PlannedRequest("a", 0, 9, (1, 2, 3)),),
        block_keys={1: K[1], 2: K[2]},
    )
    run_step(live, first, ["a"], rows(100, 9), slots_of(first, ["a"]))
    # "b" hits both blocks and asks for its prompt's hidden states too (one
    # read serves both); "c" hits one block; "d" asks but has no hit; "e" hits
    # but does not ask.
    second = StepPlan(
        caching=True,
        requests=(
            PlannedRequest("b", 8, 2, (4,), (1, 2), (K[1], K[2])),
            PlannedRequest("c", 4, 1, (5,), (1,), (K[1],)),
            PlannedRequest("d", 0, 3, (6,)),
            PlannedRequest("e", 4, 1, (7,), (1,), (K[1],)),
        ),
        prompt_requests={"b": 10},
        result_keys={"b": "key-b"},
    )
    order = ["b", "c", "d", "e"]
    run_step(live, second, order, rows(500, 7), slots_of(second, order))
    assert [(req_id, num) for req_id, num, _ in scorer.scored] == [("b", 8), ("c", 4)]
    assert torch.equal(scorer.scored[0][2], rows(100, 8))  # type: ignore[arg-type]
    assert torch.equal(scorer.scored[1][2], rows(100, 4))  # type: ignore[arg-type]
    # Block 1 is in both hits, and the hidden states of "b" come from the same
    # read: each block is read once in the step.
    assert scorer.num_rows == [2 * BS]
    assert live.store.stats.num_hit_blocks_read == 2
    (b_rows,) = live.results.take({"b": "key-b"}).values()
    assert torch.equal(b_rows, torch.cat([rows(100, 8), rows(500, 2)]))  # type: ignore[arg-type]
    stats = live.stats
    assert (stats.num_scored_requests, stats.num_scored_tokens, stats.num_score_failures) == (
        2,
        12,
        0,
    )
    # Block 2 handed out again: a hit on it is scored with no rows, never old ones.
    third = StepPlan(
        caching=True,
        requests=(PlannedRequest("b", 8, 1, (6,), (1, 2), (K[1], K[2])),),
        cleared_block_ids=(2,),
    )
    run_step(live, third, ["b"], rows(900, 1), slots_of(third, ["b"]))
    assert scorer.scored[-1] == ("b", 8, None)
    assert scorer.num_rows == [2 * BS, 0]
    assert live.stats.num_score_failures == 1


def test_a_follower_keeps_the_first_ranks_stamps_without_its_rows_and_scores_its_rows(
    copy_steps: bool | None,
) -> None:
    from omnicache.integrations.vllm.live_store import follower_store

    shared: list[torch.Tensor] = []

    def broadcast(rows: torch.Tensor) -> torch.Tensor:  # the first rank's side
        shared.append(rows.clone())
        return rows

    def receive(buffer: torch.Tensor) -> torch.Tensor:  # a follower's side
        (sent,) = shared[-1:]
        assert buffer.shape == sent.shape and buffer.dtype == sent.dtype
        return buffer.copy_(sent)

    scorers = [Scores({"b"}), Scores({"b"})]
    leader = LiveStore(
        TensorStore(8, BS, hidden_size=HIDDEN, hidden_dtype=torch.float32),
        max_results=8,
        hit_logprobs=scorers[0],
        share=broadcast,
        copy_steps=copy_steps,
    )
    follower = LiveStore(
        follower_store(8, BS),
        max_results=8,
        hit_logprobs=scorers[1],
        share=receive,
        keeps_results=False,
        copy_steps=copy_steps,
    )
    assert follower.store.nbytes == 8 * BS  # one byte a row
    first = StepPlan(
        caching=True,
        requests=(PlannedRequest("a", 0, 12, (1, 2, 3)),),
        block_keys={1: K[1], 2: K[2], 3: K[3]},
        prompt_requests={"a": 12},
        result_keys={"a": "key-a"},
    )
    # "p" asks for its prompt's rows and hits block 3; "b" scores its hit on
    # blocks 1 and 2: the rows shared are b's blocks only, whatever the order.
    second = StepPlan(
        caching=True,
        requests=(
            PlannedRequest("p", 4, 1, (5,), (3,), (K[3],)),
            PlannedRequest("b", 8, 1, (4,), (1, 2), (K[1], K[2])),
        ),
        prompt_requests={"p": 5},
        result_keys={"p": "key-p"},
    )
    for plan, order, values in ((first, ["a"], rows(100, 12)), (second, ["p", "b"], rows(500, 2))):
        for live in (leader, follower):
            stamped = run_step(live, plan, order, values, slots_of(plan, order))
            # The first step's rows wait until the second reads their blocks.
            assert sorted(stamped) == ([] if plan is first else [1, 2, 3])
    for block_id in range(8):
        assert follower.store.stamp_of(HIDDEN_STATES, block_id) == leader.store.stamp_of(
            HIDDEN_STATES, block_id
        )
    assert len(shared) == 1 and torch.equal(shared[0], rows(100, 8))
    assert [(req_id, num) for req_id, num, _ in scorers[1].scored] == [("b", 8)]
    assert torch.equal(scorers[1].scored[0][2], rows(100, 8))  # type: ignore[arg-type]
    assert torch.equal(scorers[0].scored[0][2], rows(100, 8))  # type: ignore[arg-type]
    found = leader.results.take({"a": "key-a", "p": "key-p"})
    assert torch.equal(found["p"], torch.cat([rows(108, 4), rows(500, 1)]))  # type: ignore[arg-type]
    assert follower.results.take({"a": "key-a", "p": "key-p"}) == {}
    assert follower.stats.num_hit_blocks == leader.stats.num_hit_blocks == 3
    assert follower.stats.num_stale_hit_blocks == 0
    # A follower's store needs the first rank's rows: without a share it is refused.
    with pytest.raises(ValueError, match=r"a follower's store \(one byte a row\) expected with a"):
        LiveStore(follower_store(8, BS), max_results=8, keeps_results=False, copy_steps=copy_steps)


DecodeStep = Callable[[dict[str, tuple[int, int]], dict[int, BlockHash]], StepPlan]


@pytest.fixture(params=[False, True], ids=["slots-planned", "by-plan"])
def decode_step(request: pytest.FixtureRequest) -> DecodeStep:
    """A decode step's plan: per request, (position, block) of its one new token.

    Marked as a steady decode step's (`StepPlan.decode`, as the scheduler's
    mirror marks them: staged by its plan alone, its slots found later) or
    not (its slots found when it is staged): the store ends the same.
    """
    marked = cast(bool, request.param)

    def plan(tokens: dict[str, tuple[int, int]], keys: dict[int, BlockHash]) -> StepPlan:
        requests = tuple(PlannedRequest(r, pos, 1, (block,)) for r, (pos, block) in tokens.items())
        return StepPlan(caching=True, requests=requests, block_keys=keys, decode=marked)

    return plan


def test_decode_steps_write_their_rows_before_anything_reads_the_store(
    copy_steps: bool | None,
    decode_step: DecodeStep,
) -> None:

    # Blocks enough for MAX_STAGED_STEPS more decode steps of one request.
    live = new_live(copy_steps=copy_steps, num_blocks=8 + MAX_STAGED_STEPS // BS)
    # "a" decodes positions 4..7 into block 2 (completing it), "b" 0..3 into block 3.
    stamped: dict[int, BlockHash] = {}
    for step in range(BS):
        plan = decode_step(
            {"a": (4 + step, 2), "b": (step, 3)},
            {2: K[2], 3: K[3]} if step == BS - 1 else {},
        )
        stamped.update(
            run_step(live, plan, ["b", "a"], rows(10 * step, 2), slots_of(plan, ["b", "a"]))
        )
    # Nothing read the store yet: the rows wait, unwritten and unstamped.
    assert stamped == {}
    assert live.store.stamp_of(HIDDEN_STATES, 2) is None
    assert live.stats.num_steps == BS and live.stats.num_rows_written == 0
    # A step whose request hits block 2 writes them first, and reads them.
    hit = StepPlan(
        caching=True,
        requests=(PlannedRequest("c", 4, 1, (5,), (2,), (K[2],)),),
        prompt_requests={"c": 5},
        result_keys={"c": "key-c"},
    )
    assert run_step(live, hit, ["c"], rows(900, 1), slots_of(hit, ["c"])) == {2: K[2], 3: K[3]}
    a_rows = torch.cat([rows(10 * step + 1, 1) for step in range(BS)])
    (c_rows,) = live.results.take({"c": "key-c"}).values()
    assert torch.equal(c_rows, torch.cat([a_rows, rows(900, 1)]))  # type: ignore[arg-type]
    assert live.stats.num_stale_hit_blocks == 0
    assert live.stats.num_rows_written == 2 * BS + 1
    # Block 3 handed out again after deferred rows: they are written, then cleared.
    plan = decode_step({"a": (8, 4)}, {})
    run_step(live, plan, ["a"], rows(0, 1), slots_of(plan, ["a"]))
    assert live.store.filled_of(HIDDEN_STATES, 4) == 0
    live.apply(StepPlan(caching=True, cleared_block_ids=(3,)))
    assert live.store.filled_of(HIDDEN_STATES, 4) == 1
    assert live.store.stamp_of(HIDDEN_STATES, 3) is None
    # At most MAX_STAGED_STEPS wait; flush() writes the rest.
    for step in range(MAX_STAGED_STEPS + 1):
        plan = decode_step({"a": (9 + step, 2 + (9 + step) // BS)}, {})
        run_step(live, plan, ["a"], rows(step, 1), slots_of(plan, ["a"]))
    assert live.stats.num_rows_written == 2 * BS + 1 + 1 + MAX_STAGED_STEPS
    live.flush()
    assert live.stats.num_rows_written == 2 * BS + 1 + 1 + MAX_STAGED_STEPS + 1


def test_a_decode_step_with_rows_of_other_requests_is_refused_after_the_staged_rows(
    copy_steps: bool | None,
    decode_step: DecodeStep,
) -> None:
    live = new_live(copy_steps=copy_steps)
    # "a" decodes positions 4..7 into block 2, completing it.
    for position in range(4, 8):
        plan = decode_step({"a": (position, 2)}, {2: K[2]} if position == 7 else {})
        assert run_step(live, plan, ["a"], rows(position, 1), slots_of(plan, ["a"])) == {}
    plan = decode_step({"a": (8, 3)}, {})
    refused = r"expected rows of the planned requests \['a'\], found rows of \['b'\]"
    if not plan.decode:
        with pytest.raises(RuntimeError, match=refused):
            run_step(live, plan, ["b"], rows(8, 1), slots_of(plan, ["a"]))
    else:
        # Staged by its plan alone: refused once the staged steps are resolved
        # (here by the next step that is not a decode step), and the steps
        # after it are dropped with it, unwritten.
        assert run_step(live, plan, ["b"], rows(8, 1), slots_of(plan, ["a"])) == {}
        after = decode_step({"a": (9, 3)}, {})
        assert run_step(live, after, ["a"], rows(9, 1), slots_of(after, ["a"])) == {}
        with pytest.raises(RuntimeError, match=refused + r" \(a decode step staged by its plan\)"):
            live.apply(StepPlan(caching=True, cleared_block_ids=(6,)))
        assert live.store.filled_of(HIDDEN_STATES, 3) == 0
        assert live.stats.num_decode_steps == 4
        # The block the written steps stamped is reported (to the tier) with the next.
        assert live.flush() == {2: K[2]}
    # The staged steps were written first: block 2 holds a's rows, stamped.
    assert live.store.stamp_of(HIDDEN_STATES, 2) == K[2]
    assert torch.equal(live.store.read_blocks(HIDDEN_STATES, [2], [K[2]]), rows(4, 4))
    assert live.stats.num_rows_written == 4


def test_a_decode_step_is_marked_only_when_it_resets_invalidates_loads_and_asks_nothing(
    copy_steps: bool | None,
) -> None:
    step = (PlannedRequest("a", 4, 1, (1,)),)
    for name, value in (
        ("caching", False),
        ("requests", ()),
        ("prompt_requests", {"a": 6}),
        ("reset", True),
        ("invalidated_block_ids", (3,)),
        ("loads", (LoadOrder("w", (3,), (K[3],)),)),
    ):
        fields: dict[str, object] = {"caching": True, "requests": step, name: value}
        with pytest.raises(ValueError, match=r"^decode: expected a cached step of requests that"):
            StepPlan(decode=True, **fields)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=r"^decode: expected a cached step of requests that resets, invalidates, loads and "
        r"asks for nothing, found caching=True, 1 requests, prompt_requests=\[\], reset=True, "
        r"invalidated_block_ids=\(\), 0 loads$",
    ):
        StepPlan(caching=True, requests=step, reset=True, decode=True)
    # It may clear blocks (the scheduler's mirror marks it so only when no recent
    # plan wrote rows to them: `test_a_decode_step_clears_blocks_...`).
    assert StepPlan(caching=True, requests=step, cleared_block_ids=(3,), decode=True).decode
    # A request that is not one decode token in one block without a hit: refused
    # when the steps are resolved, after the steps staged before it are written.
    live = new_live(copy_steps=copy_steps)
    first = StepPlan(caching=True, requests=step, decode=True)
    assert run_step(live, first, ["a"], rows(4, 1), slots_of(first, ["a"])) == {}
    with_hit = PlannedRequest("a", 4, 1, (2,), (1,), (K[1],))
    for bad, refused in (
        (PlannedRequest("a", 6, 2, (1,)), r"2 new tokens in blocks \(1,\) and 0 hit"),
        (PlannedRequest("a", 6, 1, (1, 2)), r"1 new tokens in blocks \(1, 2\) and 0 hit"),
        (with_hit, r"1 new tokens in blocks \(2,\) and 1 hit"),
    ):
        plan = StepPlan(caching=True, requests=(bad,), decode=True)
        assert (
            run_step(live, plan, ["a"], rows(5, bad.num_new), torch.tensor([5] * bad.num_new)) == {}
        )
        with pytest.raises(
            RuntimeError,
            match=r"^decode: expected one new token in one block and no hit for each request of "
            r"a decode step, found request 'a' with " + refused,
        ):
            live.flush()
        assert live.store.filled_of(HIDDEN_STATES, 1) == 1
        assert live.stats.num_rows_written == 1 and live.stats.num_decode_steps == 1


def test_a_decode_step_keeps_the_slot_values_read_before_its_forward_pass(
    copy_steps: bool | None,
) -> None:
    live = new_live(copy_steps=copy_steps)
    # vLLM's slot mapping: a buffer it rewrites each step (with padding here).
    buffer = torch.full((6,), -1, dtype=torch.int64)

    def decode(position: int) -> StepPlan:
        return StepPlan(
            caching=True,
            requests=(
                PlannedRequest("a", position, 1, (1,)),
                PlannedRequest("b", 4 + position, 1, (2,)),
            ),
            block_keys={1: K[1], 2: K[2]} if position == BS - 1 else {},
            decode=True,
        )

    plain = replace(decode(0), decode=False)
    for position in range(BS):
        plan = decode(position)
        buffer[:2] = slots_of(plan, ["b", "a"])
        # Only a decode step's are read early, once an earlier step's rows
        # showed that the staged rows stay as they are (on the CPU, no copies).
        assert live.decode_slot_values(plain, buffer) is None
        values = live.decode_slot_values(plan, buffer)
        assert values == (None if copy_steps or position == 0 else buffer[:2].tolist())
        # The values stand for the buffer once read: the store keeps them, not
        # what the buffer holds when the rows come (here another step's slots).
        if values is not None:
            buffer[:2] = torch.tensor([7 * BS, 7 * BS + 1])
        computed = rows(10 * position, 2)
        assert live.apply(plan, ["b", "a"], computed, buffer, slot_values=values) == {}
    assert live.stats.num_steps == BS and live.stats.num_rows_written == 0
    assert live.flush() == {1: K[1], 2: K[2]}
    assert live.stats.num_slot_mismatches == 0 and live.stats.num_decode_steps == BS
    a_rows = torch.cat([rows(10 * position + 1, 1) for position in range(BS)])
    b_rows = torch.cat([rows(10 * position, 1) for position in range(BS)])
    assert torch.equal(
        live.store.read_blocks(HIDDEN_STATES, [1, 2], [K[1], K[2]]), torch.cat([a_rows, b_rows])
    )
    assert live.store.filled_of(HIDDEN_STATES, 7) == 0
    if copy_steps:
        return
    # A mapping with padding is cut to the step's requests; one without a slot
    # for each, or a step whose rows would take more than max_staged_bytes, is
    # not read early (`apply` then writes the step at once).
    plan = decode(0)
    assert live.decode_slot_values(plan, torch.tensor([4, 8, -1])) == [4, 8]
    assert live.decode_slot_values(plan, torch.tensor([4])) is None
    small = new_live(copy_steps=None, max_staged_bytes=2 * HIDDEN * 4 - 1)
    run_step(small, plan, ["a", "b"], rows(0, 2), slots_of(plan, ["a", "b"]))
    assert small.stats.num_rows_written == 2
    assert small.decode_slot_values(plan, slots_of(plan, ["a", "b"])) is None
    # While a prompt's rows are gathered, decode steps are staged with their
    # slots: none are read early.
    asks = StepPlan(
        caching=True,
        requests=(PlannedRequest("p", 0, 3, (3,)),),
        prompt_requests={"p": 6},
        result_keys={"p": "key-p"},
    )
    run_step(live, asks, ["p"], rows(100, 3), slots_of(asks, ["p"]))
    marked = StepPlan(caching=True, requests=(PlannedRequest("a", 4, 1, (4,)),), decode=True)
    assert live.decode_slot_values(marked, slots_of(marked, ["a"])) is None


def test_a_decode_step_that_clears_blocks_first_writes_the_rows_staged_plans_that_old_before(
    copy_steps: bool | None,
) -> None:
    # A decode step may clear blocks that no plan of the MAX_STAGED_STEPS before
    # it wrote rows to (`StepPlan.decode`): rows staged from older plans are
    # written first; the step is staged either way.
    live = new_live(copy_steps=copy_steps)
    live.store.write(HIDDEN_STATES, rows(50, BS), list(range(5 * BS, 6 * BS)), block_keys={5: K[5]})
    prefill = StepPlan(
        caching=True, requests=(PlannedRequest("a", 0, BS, (1,)),), block_keys={1: K[1]}
    )
    assert run_step(live, prefill, ["a"], rows(0, BS), slots_of(prefill, ["a"])) == {}

    # Plan 1 clears block 5: the staged rows wait on; block 5 loses its stamp.
    plan = numbered_decode("b", 0, 2, 1, (5,))
    assert run_step(live, plan, ["b"], rows(10, 1), slots_of(plan, ["b"])) == {}
    assert live.stats.num_rows_written == 0 and live.stats.num_cleared_blocks == 1
    assert live.store.stamp_of(HIDDEN_STATES, 5) is None
    # Plan MAX_STAGED_STEPS - 1 clears block 5 again: plan 0's rows still wait.
    plan = numbered_decode("b", 1, 2, MAX_STAGED_STEPS - 1, (5,))
    assert run_step(live, plan, ["b"], rows(11, 1), slots_of(plan, ["b"])) == {}
    assert live.stats.num_rows_written == 0
    # Plan MAX_STAGED_STEPS clears block 1, which plan 0 wrote: the staged rows
    # are written first (block 1 stamped), then block 1 is cleared.
    plan = numbered_decode("b", 2, 2, MAX_STAGED_STEPS, (1,))
    assert run_step(live, plan, ["b"], rows(12, 1), slots_of(plan, ["b"])) == {}
    assert live.stats.num_rows_written == BS + 2 and live.stats.num_cleared_blocks == 3
    assert live.store.stamp_of(HIDDEN_STATES, 1) is None
    assert live.store.filled_of(HIDDEN_STATES, 1) == 0
    assert live.flush() == {}
    assert live.stats.num_rows_written == BS + 3 and live.stats.num_decode_steps == 3
    assert torch.equal(
        live.store.cached_rows(HIDDEN_STATES)[2 * BS : 2 * BS + 3],
        torch.cat([rows(10 + position, 1) for position in range(3)]),
    )


def test_a_decode_step_staged_as_computed_has_its_rows_counted_before_they_are_written() -> None:
    # Staged right after the forward pass with its rows as they are (its slot
    # values read before it): the rows are cut to the step's slots (padding
    # after them), and a step with fewer rows than slots is refused before any
    # staged row is written.
    for padding in (1, -1):
        live = new_live(copy_steps=None)
        plans = [
            StepPlan(
                caching=True,
                requests=(
                    PlannedRequest("a", position, 1, (1,)),
                    PlannedRequest("b", position, 1, (2,)),
                ),
                decode=True,
            )
            for position in range(3)
        ]
        for position, plan in enumerate(plans):
            computed = rows(10 * position, 2 + (padding if position == 2 else 0))
            assert run_step(live, plan, ["a", "b"], computed, slots_of(plan, ["a", "b"])) == {}
        if padding > 0:
            assert live.flush() == {}
            assert live.stats.num_rows_written == 6
            assert torch.equal(
                live.store.cached_rows(HIDDEN_STATES)[BS : BS + 3],
                torch.cat([rows(10 * position, 1) for position in range(3)]),
            )
            assert live.store.filled_of(HIDDEN_STATES, 1) == 3
            continue
        with pytest.raises(
            RuntimeError,
            match=r"^step: expected a row for each of a staged step's 2 slots, found 1 rows; "
            r"the 3 staged steps are dropped, unwritten$",
        ):
            live.flush()
        assert live.flush() == {} and live.stats.num_rows_written == 0
        assert live.store.stats.num_writes == 0 and live.store.filled_of(HIDDEN_STATES, 1) == 0


def test_deferred_rows_at_slots_other_than_planned_stamp_nothing_of_their_step(
    copy_steps: bool | None,
    decode_step: DecodeStep,
) -> None:
    live = new_live(copy_steps=copy_steps)
    good = decode_step({"a": (3, 1)}, {1: K[1]})
    bad = decode_step({"b": (3, 2)}, {2: K[2]})
    for step, plan in enumerate(decode_step({"a": (s, 1)}, {}) for s in range(3)):
        run_step(live, plan, ["a"], rows(step, 1), slots_of(plan, ["a"]))
    for step, plan in enumerate(decode_step({"b": (s, 2)}, {}) for s in range(3)):
        run_step(live, plan, ["b"], rows(step, 1), slots_of(plan, ["b"]))
    run_step(live, good, ["a"], rows(3, 1), slots_of(good, ["a"]))
    # Block 2's last row lands in block 6 instead: that step is written without keys.
    run_step(live, bad, ["b"], rows(3, 1), torch.tensor([6 * BS + 3]))
    live.flush()
    assert live.stats.num_slot_mismatches == 1
    assert live.store.stamp_of(HIDDEN_STATES, 1) == K[1]
    assert live.store.stamp_of(HIDDEN_STATES, 2) is None
    assert live.store.filled_of(HIDDEN_STATES, 2) == 3
    assert live.stats.num_rows_written == 8


def test_a_decode_step_that_clears_blocks_writes_the_staged_rows_only_if_it_clears_theirs(
    copy_steps: bool | None,
    decode_step: DecodeStep,
) -> None:
    live = new_live(copy_steps=copy_steps, num_blocks=64)
    live.store.write_blocks(HIDDEN_STATES, rows(0, BS), [9], block_keys=[K[5]])
    live.store.write_blocks(HIDDEN_STATES, rows(0, BS), [10], block_keys=[K[6]])
    first = decode_step({"a": (0, 2)}, {})
    run_step(live, first, ["a"], rows(1, 1), slots_of(first, ["a"]))
    # Block 9 (old, stamped) handed out again: its stamp goes, "a"'s row stays staged.
    clears = replace(decode_step({"a": (1, 2)}, {}), cleared_block_ids=(9,), decode=False)
    run_step(live, clears, ["a"], rows(2, 1), slots_of(clears, ["a"]))
    assert live.store.stamp_of(HIDDEN_STATES, 9) is None
    assert live.store.stamp_of(HIDDEN_STATES, 10) == K[6]
    assert live.stats.num_rows_written == 0 and live.store.filled_of(HIDDEN_STATES, 2) == 0
    # Block 2, holding the staged rows, handed out again (its request preempted):
    # they are written first, then its stamp and rows cleared, as step by step.
    again = replace(decode_step({"b": (0, 10)}, {}), cleared_block_ids=(2, 10), decode=False)
    run_step(live, again, ["b"], rows(3, 1), slots_of(again, ["b"]))
    assert live.stats.num_rows_written == 2
    assert live.store.filled_of(HIDDEN_STATES, 2) == 0
    assert live.store.stamp_of(HIDDEN_STATES, 10) is None
    live.flush()
    assert live.stats.num_rows_written == 3
    assert live.store.filled_of(HIDDEN_STATES, 10) == 1


def test_staged_steps_of_changing_batch_and_padding_are_written_as_computed_on_every_rank(
    copy_steps: bool | None,
    decode_step: DecodeStep,
) -> None:
    from omnicache.integrations.vllm.live_store import follower_store

    leader = new_live(copy_steps=copy_steps)
    follower = LiveStore(
        follower_store(8, BS),
        max_results=8,
        share=lambda rows: rows,
        keeps_results=False,
        copy_steps=copy_steps,
    )
    steps = [
        (decode_step({"a": (0, 1), "b": (0, 2)}, {}), ["a", "b"]),
        (decode_step({"a": (1, 1), "b": (1, 2)}, {}), ["b", "a"]),  # another batch order
        (decode_step({"b": (2, 2)}, {}), ["b"]),  # another batch size
        (decode_step({"b": (3, 2)}, {2: K[2]}), ["b"]),
    ]
    for step, (plan, order) in enumerate(steps):
        # Two padding rows and slots after the step's own.
        values = torch.cat([rows(10 * step, len(order)), rows(-1, 2)])
        for live in (leader, follower):
            assert run_step(live, plan, order, values, slots_of(plan, order, padding=2)) == {}
    # Steps of another batch order and size wait alongside the others.
    assert leader.stats.num_rows_written == follower.stats.num_rows_written == 0
    assert leader.flush() == follower.flush() == {2: K[2]}
    # Two writes: the two steps of other batch orders, then b's two decode steps.
    assert leader.store.stats.num_writes == follower.store.stats.num_writes == 2
    assert leader.stats.num_rows_written == follower.stats.num_rows_written == 6
    block_2 = torch.tensor([1.0, 10.0, 20.0, 30.0])[:, None].repeat(1, HIDDEN)
    assert torch.equal(leader.store.read_blocks(HIDDEN_STATES, [2], [K[2]]), block_2)
    for live in (leader, follower):
        assert live.store.filled_of(HIDDEN_STATES, 1) == 2
        assert live.store.stamp_of(HIDDEN_STATES, 1) is None
        assert live.stats.num_slot_mismatches == 0


def test_a_staged_block_a_later_step_rewrites_at_unplanned_slots_is_not_reported_stamped(
    copy_steps: bool | None,
    decode_step: DecodeStep,
) -> None:
    live = new_live(copy_steps=copy_steps)
    for position in range(BS):
        plan = decode_step({"a": (position, 1)}, {1: K[1]} if position == BS - 1 else {})
        run_step(live, plan, ["a"], rows(position, 1), slots_of(plan, ["a"]))
    # Planned into block 3; its row lands at block 1's first slot.
    stray = decode_step({"b": (0, 3)}, {})
    run_step(live, stray, ["b"], rows(50, 1), torch.tensor([1 * BS]))
    assert live.flush() == {}
    assert live.stats.num_slot_mismatches == 1
    assert live.store.stamp_of(HIDDEN_STATES, 1) is None
    assert live.store.filled_of(HIDDEN_STATES, 1) == 1
    assert live.stats.num_rows_written == BS + 1


def test_staged_rows_are_written_once_they_take_max_staged_bytes_on_every_rank(
    copy_steps: bool | None,
    decode_step: DecodeStep,
) -> None:
    from omnicache.integrations.vllm.live_store import follower_store

    row_bytes = HIDDEN * 4  # float32
    live = new_live(copy_steps=copy_steps, max_staged_bytes=3 * row_bytes)
    # A follower keeps no rows, yet counts the model's: it writes at the same step.
    follower = LiveStore(
        follower_store(8, BS),
        max_results=8,
        share=lambda rows: rows,
        keeps_results=False,
        max_staged_bytes=3 * row_bytes,
        copy_steps=copy_steps,
    )
    written: dict[str, list[tuple[int, dict[int, BlockHash]]]] = {"live": [], "follower": []}
    for position in range(BS):
        plan = decode_step({"a": (position, 1)}, {1: K[1]} if position == BS - 1 else {})
        for name, store in (("live", live), ("follower", follower)):
            stamped = run_step(store, plan, ["a"], rows(position, 1), slots_of(plan, ["a"]))
            written[name].append((store.stats.num_rows_written, stamped))
    # The fourth step's rows would take more than the bytes: the three staged
    # are written first, and it waits.
    assert written["live"] == written["follower"] == [(0, {}), (0, {}), (0, {}), (3, {})]
    assert live.flush() == follower.flush() == {1: K[1]}
    assert torch.equal(live.store.read_blocks(HIDDEN_STATES, [1], [K[1]]), rows(0, BS))
    # A step whose rows alone would take more is written at once.
    plan = StepPlan(caching=True, requests=(PlannedRequest("b", 0, 4, (2,)),), block_keys={2: K[2]})
    for store in (live, follower):
        assert run_step(store, plan, ["b"], rows(7, 4), slots_of(plan, ["b"])) == {2: K[2]}
        assert store.stats.num_rows_written == 2 * BS
    assert torch.equal(live.store.read_blocks(HIDDEN_STATES, [2], [K[2]]), rows(7, BS))
    with pytest.raises(ValueError, match="max_staged_bytes"):
        LiveStore(live.store, max_results=8, max_staged_bytes=-1, copy_steps=copy_steps)


def test_start_forward_writes_before_the_forward_pass_the_staged_rows_apply_would_write(
    copy_steps: bool | None,
    decode_step: DecodeStep,
) -> None:

    row_bytes = HIDDEN * 4  # float32
    num_blocks = 4 + MAX_STAGED_STEPS // BS

    # The bytes bound: "a" decodes block 1; the fourth row would take the staged
    # rows past 3 rows. A store told before each forward pass (as on a GPU)
    # writes the three staged then; one told only after it, in `apply`.
    first, after = (
        new_live(copy_steps=copy_steps, num_blocks=num_blocks, max_staged_bytes=3 * row_bytes)
        for _ in range(2)
    )
    written: dict[str, list[tuple[int, int]]] = {"first": [], "after": []}
    for position in range(BS):
        plan = decode_step({"a": (position, 1)}, {1: K[1]} if position == BS - 1 else {})
        for name, live in (("first", first), ("after", after)):
            if live is first:
                live.start_forward(plan)
            before = live.stats.num_rows_written
            run_step(live, plan, ["a"], rows(position, 1), slots_of(plan, ["a"]))
            written[name].append((before, live.stats.num_rows_written))
    assert written["first"] == [(0, 0), (0, 0), (0, 0), (3, 3)]
    assert written["after"] == [(0, 0), (0, 0), (0, 0), (0, 3)]
    for live in (first, after):
        assert live.flush() == {1: K[1]}
        assert torch.equal(live.store.read_blocks(HIDDEN_STATES, [1], [K[1]]), rows(0, BS))
    # "a" goes on into block 2, its last row staged; then a step hits blocks 1
    # and 2: the staged row is written before that step's forward pass, then read.
    for position in range(BS, 2 * BS):
        plan = decode_step({"a": (position, 2)}, {2: K[2]} if position == 2 * BS - 1 else {})
        first.start_forward(plan)
        run_step(first, plan, ["a"], rows(50 + position, 1), slots_of(plan, ["a"]))
    assert first.stats.num_rows_written == BS + 3
    hit = StepPlan(
        caching=True,
        requests=(PlannedRequest("c", 2 * BS, 1, (3,), (1, 2), (K[1], K[2])),),
        prompt_requests={"c": 2 * BS + 1},
        result_keys={"c": "key-c"},
    )
    first.start_forward(hit)
    assert first.stats.num_rows_written == 2 * BS
    run_step(first, hit, ["c"], rows(90, 1), slots_of(hit, ["c"]))
    (got,) = first.results.take({"c": "key-c"}).values()
    want = torch.cat([rows(0, BS), rows(50 + BS, BS), rows(90, 1)])
    assert torch.equal(got, want)  # type: ignore[arg-type]
    assert first.stats.num_stale_hit_blocks == 0
    # The count bound: before the step that would be the MAX_STAGED_STEPS-th
    # staged, the others are written, and it waits.
    live = new_live(copy_steps=copy_steps, num_blocks=num_blocks)
    for step in range(MAX_STAGED_STEPS):
        position = BS + step
        plan = decode_step({"a": (position, 1 + position // BS)}, {})
        live.start_forward(plan)
        run_step(live, plan, ["a"], rows(step, 1), slots_of(plan, ["a"]))
    assert live.stats.num_rows_written == MAX_STAGED_STEPS - 1
    # Twice for one plan: the second does nothing.
    live.start_forward(plan)
    assert live.stats.num_rows_written == MAX_STAGED_STEPS - 1
    live.flush()
    assert live.stats.num_rows_written == MAX_STAGED_STEPS
    assert live.stats.num_slot_mismatches == 0


def test_a_staged_step_at_a_slot_outside_the_store_is_refused_before_any_write(
    copy_steps: bool | None,
    decode_step: DecodeStep,
) -> None:
    live = new_live(copy_steps=copy_steps)
    for position in range(2):
        plan = decode_step({"a": (position, 1)}, {})
        run_step(live, plan, ["a"], rows(position, 1), slots_of(plan, ["a"]))
    plan = decode_step({"a": (2, 1)}, {})
    run_step(live, plan, ["a"], rows(2, 1), torch.tensor([8 * BS]))
    found = r"found \[32\] \(planned \[6\]\) in staged step 3 of 3"
    with pytest.raises(IndexError, match=r"expected the forward pass's slots in 0\.\.31, " + found):
        live.flush()
    assert live.store.filled_of(HIDDEN_STATES, 1) == 0
    assert live.stats.num_rows_written == 0


def test_prefill_chunks_and_decode_tokens_wait_together_until_a_hit_reads_them(
    copy_steps: bool | None,
) -> None:
    live = new_live(copy_steps=copy_steps, num_blocks=16)
    # "a" prefills 10 tokens in two chunks (blocks 1, 2, 3) while "b" decodes
    # into block 5; the model runner's batch order is not the plan's.
    first = StepPlan(
        caching=True,
        requests=(PlannedRequest("a", 0, 6, (1, 2)), PlannedRequest("b", 4, 1, (5,))),
        block_keys={1: K[1]},
    )
    second = StepPlan(
        caching=True,
        requests=(PlannedRequest("a", 6, 4, (2, 3)), PlannedRequest("b", 5, 1, (5,))),
        block_keys={2: K[2]},
    )
    a_rows = rows(100, 10)
    assert (
        live.apply(
            first, ["b", "a"], torch.cat([rows(50, 1), a_rows[:6]]), slots_of(first, ["b", "a"])
        )
        == {}
    )
    # Padding after the second step's rows and slots.
    values = torch.cat([a_rows[6:], rows(51, 1), rows(-1, 3)])
    assert run_step(live, second, ["a", "b"], values, slots_of(second, ["a", "b"], padding=3)) == {}
    assert live.stats.num_rows_written == 0 and live.store.stamp_of(HIDDEN_STATES, 1) is None
    # "c" hits blocks 1 and 2 and asks for its prompt's rows: the staged rows
    # are written first (one write, every step's keys), then read.
    hit = StepPlan(
        caching=True,
        requests=(PlannedRequest("c", 8, 1, (6,), (1, 2), (K[1], K[2])),),
        prompt_requests={"c": 9},
        result_keys={"c": "key-c"},
    )
    writes = live.store.stats.num_writes
    assert run_step(live, hit, ["c"], rows(900, 1), slots_of(hit, ["c"])) == {1: K[1], 2: K[2]}
    assert live.store.stats.num_writes == writes + 2  # the staged steps', then c's
    (c_rows,) = live.results.take({"c": "key-c"}).values()
    assert torch.equal(c_rows, torch.cat([a_rows[:8], rows(900, 1)]))  # type: ignore[arg-type]
    assert live.stats.num_stale_hit_blocks == live.stats.num_slot_mismatches == 0
    assert live.stats.num_rows_written == 10 + 2 + 1
    assert live.store.filled_of(HIDDEN_STATES, 3) == 2
    assert torch.equal(live.store.cached_rows(HIDDEN_STATES)[5 * BS : 5 * BS + 2], rows(50, 2))
    assert torch.equal(live.store.cached_rows(HIDDEN_STATES)[3 * BS : 3 * BS + 2], a_rows[8:])


def test_a_staged_prefill_step_at_other_slots_than_planned_stamps_none_of_its_blocks(
    copy_steps: bool | None,
) -> None:
    live = new_live(copy_steps=copy_steps)
    good = StepPlan(caching=True, requests=(PlannedRequest("a", 0, 4, (1,)),), block_keys={1: K[1]})
    bad = StepPlan(
        caching=True, requests=(PlannedRequest("b", 0, 8, (2, 3)),), block_keys={2: K[2], 3: K[3]}
    )
    run_step(live, good, ["a"], rows(0, 4), slots_of(good, ["a"]))
    # The second half of b's rows lands in block 6 instead of block 3.
    found = torch.tensor([8, 9, 10, 11, 24, 25, 26, 27])
    run_step(live, bad, ["b"], rows(10, 8), found)
    assert live.flush() == {1: K[1]}
    assert live.stats.num_slot_mismatches == 1
    assert [live.store.stamp_of(HIDDEN_STATES, block) for block in (1, 2, 3, 6)] == [
        K[1],
        None,
        None,
        None,
    ]
    assert [live.store.filled_of(HIDDEN_STATES, block) for block in (2, 3, 6)] == [BS, 0, BS]
    assert live.stats.num_rows_written == 12


def test_steps_that_gather_finish_or_hit_other_blocks_wait_alike_on_every_rank(
    copy_steps: bool | None,
    decode_step: DecodeStep,
) -> None:
    from omnicache.integrations.vllm.live_store import FOLLOWER_DTYPE, follower_store

    leader = LiveStore(
        TensorStore(16, BS, hidden_size=HIDDEN, hidden_dtype=torch.float32),
        max_results=8,
        copy_steps=copy_steps,
    )
    follower = LiveStore(
        follower_store(16, BS),
        max_results=8,
        share=lambda rows: rows,
        keeps_results=False,
        copy_steps=copy_steps,
    )
    # Block 7 holds an earlier prompt's rows, stamped on both ranks.
    leader.store.write_blocks(HIDDEN_STATES, rows(70, BS), [7], block_keys=[K[7]])
    follower.store.write_blocks(
        HIDDEN_STATES, torch.zeros((BS, 1), dtype=FOLLOWER_DTYPE), [7], block_keys=[K[7]]
    )
    # "a" asks for its prompt's rows (4 tokens), "s" for every position's.
    asks = StepPlan(
        caching=True,
        requests=(PlannedRequest("a", 0, 4, (1,)), PlannedRequest("s", 0, 2, (2,))),
        block_keys={1: K[1]},
        prompt_requests={"a": 4, "s": 2},
        sequence_requests=frozenset({"s"}),
        result_keys={"a": "key-a", "s": "key-s"},
    )
    # "h" hits block 7 and asks for its prompt's rows, beside a's decode token.
    hit = StepPlan(
        caching=True,
        requests=(
            PlannedRequest("a", 8, 1, (4,)),
            PlannedRequest("h", 4, 1, (9,), (7,), (K[7],)),
        ),
        prompt_requests={"h": 5},
        result_keys={"h": "key-h"},
    )
    steps = [
        (asks, ["a", "s"]),
        (decode_step({"a": (4, 3), "s": (2, 2)}, {}), ["a", "s"]),
        (decode_step({"a": (5, 3)}, {}), ["a"]),
        (replace(decode_step({"a": (6, 3)}, {}), finished_req_ids=("z",)), ["a"]),
        (replace(decode_step({"a": (7, 3)}, {3: K[3]}), finished_req_ids=("s",)), ["a"]),
        (hit, ["a", "h"]),
    ]
    for step, (plan, order) in enumerate(steps):
        num = sum(item.num_new for item in plan.requests)
        for live in (leader, follower):
            assert run_step(live, plan, order, rows(10 * step, num), slots_of(plan, order)) == {}
            assert live.stats.num_rows_written == 0
    # Every result is there before the rows are written.
    taken = leader.results.take({"a": "key-a", "s": "key-s", "h": "key-h"})
    assert torch.equal(taken["a"], rows(0, 4))  # type: ignore[arg-type]
    assert torch.equal(taken["s"], torch.cat([rows(4, 2), rows(11, 1)]))  # type: ignore[arg-type]
    assert torch.equal(taken["h"], torch.cat([rows(70, BS), rows(51, 1)]))  # type: ignore[arg-type]
    assert leader.stats.num_hit_blocks == follower.stats.num_hit_blocks == 1
    assert leader.stats.num_stale_hit_blocks == follower.stats.num_stale_hit_blocks == 0
    assert leader.flush() == follower.flush() == {1: K[1], 3: K[3]}
    assert leader.stats.num_rows_written == follower.stats.num_rows_written == 13
    # Block 7's write, then three: the first two steps, a's three decode steps, h's step.
    assert leader.store.stats.num_writes == follower.store.stats.num_writes == 1 + 3


def test_a_hit_on_a_block_its_own_step_fills_writes_the_step_at_once(
    copy_steps: bool | None,
) -> None:
    live = new_live(copy_steps=copy_steps)
    plan = StepPlan(
        caching=True,
        requests=(
            PlannedRequest("a", 0, 4, (1,)),
            PlannedRequest("b", 4, 1, (2,), (1,), (K[1],)),
        ),
        block_keys={1: K[1]},
        prompt_requests={"b": 5},
        result_keys={"b": "key-b"},
    )
    assert run_step(live, plan, ["a", "b"], rows(0, 5), slots_of(plan, ["a", "b"])) == {1: K[1]}
    assert live.stats.num_rows_written == 5 and live.stats.num_stale_hit_blocks == 0
    (b_rows,) = live.results.take({"b": "key-b"}).values()
    assert torch.equal(b_rows, rows(0, 5))  # type: ignore[arg-type]


def test_on_the_cpu_a_step_of_more_than_max_host_step_bytes_is_written_at_once(
    copy_steps: bool | None,
) -> None:
    from omnicache.integrations.vllm.staged_steps import MAX_HOST_STEP_BYTES

    hidden, bs = 1024, 32  # float32: 4 KiB a row
    per_row = hidden * 4
    live = LiveStore(
        TensorStore(32, bs, hidden_size=hidden, hidden_dtype=torch.float32),
        max_results=8,
        copy_steps=copy_steps,
    )
    fits = MAX_HOST_STEP_BYTES // per_row  # 256 rows: 8 blocks
    written = []
    for req_id, first_block, num in (("a", 0, fits), ("b", 8, fits + bs)):
        block_ids = tuple(range(first_block, first_block + num // bs))
        plan = StepPlan(caching=True, requests=(PlannedRequest(req_id, 0, num, block_ids),))
        values = torch.arange(num * hidden, dtype=torch.float32).view(num, hidden)
        run_step(live, plan, [req_id], values, torch.tensor(planned_slots(plan.requests, bs)))
        written.append(live.stats.num_rows_written)
    # "a" waits; "b" (9 blocks, over the bytes) is written at once, "a" first.
    assert written == [0, fits + fits + bs]
    assert live.store.stats.num_writes == 2


def test_a_prefill_step_and_the_decode_steps_after_it_are_written_apart(
    copy_steps: bool | None,
    decode_step: DecodeStep,
) -> None:
    live = new_live(copy_steps=copy_steps, num_blocks=16)
    prefill = StepPlan(
        caching=True,
        requests=(PlannedRequest("a", 0, 4, (1,)), PlannedRequest("b", 0, 4, (2,))),
        block_keys={1: K[1], 2: K[2]},
    )
    assert run_step(live, prefill, ["a", "b"], rows(0, 8), slots_of(prefill, ["a", "b"])) == {}
    for step in range(3):
        plan = decode_step({"a": (4 + step, 3), "b": (4 + step, 4)}, {})
        assert (
            run_step(live, plan, ["b", "a"], rows(100 + 10 * step, 2), slots_of(plan, ["b", "a"]))
            == {}
        )
    assert live.stats.num_rows_written == 0
    # Two writes: the prefill step's rows, then the decode steps' request by request.
    assert live.flush() == {1: K[1], 2: K[2]}
    assert live.store.stats.num_writes == 2 and live.stats.num_rows_written == 14
    cached = live.store.cached_rows(HIDDEN_STATES)
    assert torch.equal(cached[BS : 3 * BS], rows(0, 8))
    decoded = torch.tensor([100.0, 110.0, 120.0])[:, None].repeat(1, HIDDEN)
    assert torch.equal(cached[3 * BS : 3 * BS + 3], decoded + 1)  # a's rows come second
    assert torch.equal(cached[4 * BS : 4 * BS + 3], decoded)
    assert [live.store.filled_of(HIDDEN_STATES, block) for block in (1, 2, 3, 4)] == [4, 4, 3, 3]


def test_staged_steps_of_more_runs_than_max_flush_writes_are_written_in_one(
    copy_steps: bool | None,
    decode_step: DecodeStep,
) -> None:
    from omnicache.integrations.vllm.staged_steps import MAX_FLUSH_WRITES

    live = new_live(copy_steps=copy_steps, num_blocks=16)
    # Runs of two decode steps, each run in the other batch order: one run more than
    # MAX_FLUSH_WRITES. "a" writes blocks 3.., "b" blocks 8...
    orders = (["a", "b"], ["b", "a"])
    num_steps = 2 * (MAX_FLUSH_WRITES + 1)
    for step in range(num_steps):
        plan = decode_step({"a": (step, 3 + step // BS), "b": (step, 8 + step // BS)}, {})
        order = orders[step // 2 % 2]
        values = rows(10 * step, 2)
        assert run_step(live, plan, order, values, slots_of(plan, order)) == {}
    assert live.flush() == {}
    assert live.store.stats.num_writes == 1 and live.stats.num_rows_written == 2 * num_steps
    cached = live.store.cached_rows(HIDDEN_STATES)
    for step in range(num_steps):
        first = 10.0 * step  # the row of the order's first request
        a, b = (first, first + 1) if step // 2 % 2 == 0 else (first + 1, first)
        assert cached[3 * BS + step, 0] == a and cached[8 * BS + step, 0] == b


def test_staged_runs_that_plan_a_slot_twice_are_refused_before_any_write(
    copy_steps: bool | None,
    decode_step: DecodeStep,
) -> None:
    live = new_live(copy_steps=copy_steps)
    # "a" prefills block 1, then two decode steps planned at its last two slots again.
    prefill = StepPlan(caching=True, requests=(PlannedRequest("a", 0, 4, (1,)),))
    steps = [(prefill, rows(0, 4))]
    steps += [(decode_step({"a": (position, 1)}, {}), rows(position, 1)) for position in (2, 3)]
    for plan, values in steps:
        assert run_step(live, plan, ["a"], values, slots_of(plan, ["a"])) == {}
    with pytest.raises(ValueError, match=r"expected distinct slots, found slot 6"):
        live.flush()
    assert live.store.stats.num_writes == 0 and live.stats.num_rows_written == 0
    assert live.store.filled_of(HIDDEN_STATES, 1) == 0


def test_on_the_cpu_a_model_that_reuses_its_output_is_refused_before_a_staged_row_is_written(
    decode_step: DecodeStep,
) -> None:
    # The model writes every step's rows into one buffer (as a replayed graph does).
    buffer = torch.zeros(2, HIDDEN)
    plans = [
        decode_step({"a": (position, 1)}, {1: K[1]} if position == 3 else {})
        for position in range(4)
    ]
    copying = new_live(copy_steps=True)
    for position, plan in enumerate(plans):
        buffer.copy_(rows(position, 2))
        run_step(copying, plan, ["a"], buffer[:1], slots_of(plan, ["a"]))
    # Copies: every step's rows as computed.
    assert copying.flush() == {1: K[1]}
    assert torch.equal(copying.store.read_blocks(HIDDEN_STATES, [1], [K[1]]), rows(0, 4))
    # The CPU's rows kept as computed: the second step's rows are where the first's
    # are, which they overwrote. Staged as they come (right after the forward
    # pass), they are refused before anything writes them: nothing staged is
    # ever written.
    live = new_live(copy_steps=None)
    buffer.copy_(rows(0, 2))
    assert run_step(live, plans[0], ["a"], buffer[:1], slots_of(plans[0], ["a"])) == {}
    buffer.copy_(rows(1, 2))
    assert run_step(live, plans[1], ["a"], buffer[:1], slots_of(plans[1], ["a"])) == {}
    with pytest.raises(
        RuntimeError,
        match=r"found a staged step's rows where a staged step's are: the model reuses its "
        r"output; the 2 staged steps' rows were overwritten and are dropped, unwritten$",
    ):
        live.flush()
    assert live.flush() == {}
    assert live.stats.num_rows_written == 0 and live.store.filled_of(HIDDEN_STATES, 1) == 0
    # So is a hit on their block, which writes them first.
    for plan in plans[:2]:
        run_step(live, plan, ["a"], buffer[:1], slots_of(plan, ["a"]))
    reads = StepPlan(caching=True, requests=(PlannedRequest("h", 4, 1, (3,), (1,), (K[1],)),))
    with pytest.raises(
        RuntimeError,
        match=r"found a staged step's rows where a staged step's are: the model reuses its "
        r"output; the 2 staged steps' rows were overwritten",
    ):
        run_step(live, reads, ["h"], rows(9, 1), slots_of(reads, ["h"]))
    assert live.flush() == {} and live.stats.num_rows_written == 0
    # A step written at once (it resets the store) is refused the same way.
    run_step(live, plans[0], ["a"], buffer[:1], slots_of(plans[0], ["a"]))
    hit = StepPlan(caching=True, requests=(PlannedRequest("a", 1, 1, (1,), (), ()),), reset=True)
    with pytest.raises(
        RuntimeError,
        match=r"found this step's rows where a staged step's are: the model reuses its "
        r"output; the 1 staged steps' rows were overwritten",
    ):
        run_step(live, hit, ["a"], buffer[:1], slots_of(hit, ["a"]))
    assert live.flush() == {} and live.stats.num_rows_written == 0
    with pytest.raises(TypeError, match="copy_steps: expected a bool or None, found int"):
        LiveStore(live.store, max_results=8, copy_steps=1)  # type: ignore[arg-type]


def test_a_step_computed_where_staged_rows_are_is_refused_before_it_writes_them(
    decode_step: DecodeStep,
) -> None:
    # The CPU's rows kept as computed. A step that writes the staged rows before
    # its own are staged checks its rows against theirs first: here the model
    # computed the third step's rows where the first step's are.
    first, second, third = (torch.zeros(1, HIDDEN) for _ in range(3))
    refused = (
        r"found this step's rows where a staged step's are: the model reuses its output; "
        r"the 2 staged steps' rows were overwritten and are dropped, unwritten$"
    )
    # A write the bytes force (max_staged_bytes: two rows).
    live = new_live(copy_steps=None, max_staged_bytes=2 * HIDDEN * 4)
    plans = [decode_step({"a": (position, 1)}, {}) for position in range(3)]
    for position, buffer in enumerate((first, second)):
        buffer.copy_(rows(position, 1))
        assert (
            run_step(live, plans[position], ["a"], buffer, slots_of(plans[position], ["a"])) == {}
        )
    first.copy_(rows(2, 1))
    with pytest.raises(RuntimeError, match=refused):
        run_step(live, plans[2], ["a"], first, slots_of(plans[2], ["a"]))
    assert live.flush() == {} and live.stats.num_rows_written == 0
    # A write a decode step's clears force (rows staged MAX_STAGED_STEPS plans
    # before it): refused before anything is cleared.
    live = new_live(copy_steps=None)
    live.store.write(HIDDEN_STATES, rows(50, BS), list(range(5 * BS, 6 * BS)), block_keys={5: K[5]})
    for number, buffer in ((0, first), (1, second), (MAX_STAGED_STEPS, first)):
        clears = (5,) if number == MAX_STAGED_STEPS else ()
        plan = numbered_decode("a", number % BS, 1, number, clears)
        buffer.copy_(rows(number, 1))
        if number < MAX_STAGED_STEPS:
            assert run_step(live, plan, ["a"], buffer, slots_of(plan, ["a"])) == {}
            continue
        with pytest.raises(RuntimeError, match=refused):
            run_step(live, plan, ["a"], buffer, slots_of(plan, ["a"]))
    assert live.flush() == {} and live.stats.num_rows_written == 0
    assert live.store.stamp_of(HIDDEN_STATES, 5) == K[5]
    # With other memory for each step's rows, the same steps are written.
    live = new_live(copy_steps=None)
    for number in (0, 1, MAX_STAGED_STEPS):
        clears = (5,) if number == MAX_STAGED_STEPS else ()
        plan = numbered_decode("a", number % BS, 1, number, clears)
        assert run_step(live, plan, ["a"], third + number, slots_of(plan, ["a"])) == {}
    assert live.stats.num_rows_written == 2 and live.stats.num_cleared_blocks == 1


def test_the_default_staged_bound_is_32_mib_or_a_sixteenth_of_the_budget() -> None:
    assert default_max_staged_bytes(64 * 2**20) == 4 * 2**20
    assert default_max_staged_bytes(16 * 32 * 2**20 - 16) == 32 * 2**20 - 1
    assert default_max_staged_bytes(16 * 32 * 2**20) == MAX_STAGED_BYTES == 32 * 2**20
    assert default_max_staged_bytes(2**40) == 32 * 2**20
    assert default_max_staged_bytes(15) == 0
    with pytest.raises(ValueError, match="budget: expected int >= 0, found -1"):
        default_max_staged_bytes(-1)
