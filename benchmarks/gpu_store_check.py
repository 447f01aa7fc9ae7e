"""TensorStore on a GPU machine: correctness first, then bandwidth. One script.

Checks every store configuration this machine has:
  cpu               CPU store fed from CPU tensors (always)
  cuda              CUDA store fed from CUDA tensors
  cuda<-cpu         CUDA store fed from CPU tensors
  pinned<-cuda      pinned CPU store fed from CUDA tensors (non_blocking copies,
                    one event per write)
Every check compares exactly (torch.equal, or bit patterns) against the rows
that were written; any mismatch is printed and the script exits 1. The
configurations with the store on the CPU also drive the worker's `LiveStore`
as the worker does (rows and slot mappings on the model's device: a prefill
and decode steps staged and written together, a hit asking for its rows;
on CUDA `LiveStore.start_forward` before each step, as the worker calls
it on a GPU; that path also runs with CPU rows, on every machine), and on
CUDA a timing shows whether a decode step's and a prefill step's store
work waits for the forward pass (CUDA events), and torch's sync debug mode
finds any synchronizing CUDA operation in it (a check: none in
`LiveStore.apply`, after the forward pass). Then it prints write and
merged-read bandwidth for the 8192 x 4096 bf16 workload on the fastest
device here, next to a plain copy_ and the reference approach
(flat[slots] = hs; cache[block_ids].reshape then torch.cat), each variant
timed right after its ceiling copy_ (medians of --reps).

Without CUDA it runs the cpu configuration only (CPU-only mode).

On the GPU machine the image lacks blake3, which omnicache's block keys
import (it lacks vLLM and soundfile too, which the script does not need:
`tests/test_gpu_store_check.py` runs it without them). From the repository
root here, once:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_17_x86_64 -d .whl blake3==1.0.11

then run it there with ``.whl`` carried:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \\
      && PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 python3 benchmarks/gpu_store_check.py --pytest

``--pytest`` first runs tests/test_store*.py (parametrized over the CUDA
configurations there, the reuse simulation among them) and the tier codec's tests.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch

from omnicache.block_hash import BlockHash
from omnicache.integrations.vllm.live_store import LiveStore
from omnicache.integrations.vllm.plan import PlannedRequest, StepPlan
from omnicache.reference import BlockPool
from omnicache.store import (
    HIDDEN_STATES,
    ReadMiss,
    ScheduledRequest,
    StaleBlockError,
    TensorStore,
)

ROOT = Path(__file__).resolve().parents[1]


class Config(NamedTuple):
    name: str
    store_device: str
    source_device: str


def configs() -> list[Config]:
    found = [Config("cpu", "cpu", "cpu")]
    if torch.cuda.is_available():
        found += [
            Config("cuda", "cuda", "cuda"),
            Config("cuda<-cpu", "cuda", "cpu"),
            Config("pinned<-cuda", "cpu", "cuda"),
        ]
    return found


def key(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def slots_of(block_ids: list[int], block_size: int) -> torch.Tensor:
    ids = torch.tensor(block_ids, dtype=torch.int64)
    return (ids[:, None] * block_size + torch.arange(block_size)).reshape(-1)


class Checker:
    def __init__(self) -> None:
        self.failures: list[str] = []
        self.num_checks = 0

    def expect(self, ok: bool, what: str) -> None:
        self.num_checks += 1
        if not ok:
            self.failures.append(what)
            print(f"  MISMATCH: {what}")

    def equal(self, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        ok = got.shape == want.shape and got.dtype == want.dtype
        ok = ok and torch.equal(got.detach().cpu(), want.detach().cpu())
        self.expect(ok, what)


# -- correctness ---------------------------------------------------------------


def check_config(cfg: Config, tokens: int, hidden: int, bs: int, chk: Checker) -> None:
    src_dev, dtype = cfg.source_device, torch.bfloat16
    gen = torch.Generator().manual_seed(1)
    num_blocks = 2 * tokens // bs
    store = TensorStore(num_blocks, bs, device=cfg.store_device)
    pool = BlockPool(num_blocks, bs)
    store.attach(pool)
    label = cfg.name

    # 1. A whole step into scattered whole blocks, keyed: the wide indexed path.
    rows = torch.randn(tokens, hidden, generator=gen).to(dtype)
    blocks = pool.allocate(tokens // bs)
    assert blocks is not None
    perm = torch.randperm(len(blocks), generator=gen).tolist()
    ids = [blocks[i].block_id for i in perm]
    keys = [key(b + 1000) for b in ids]
    ordered = [blocks[i] for i in perm]
    pool.cache_full_blocks(ordered, keys, 0, len(ordered))
    result = store.write_outputs(
        slots_of(ids, bs),
        hidden_states=rows.to(src_dev),
        block_keys=dict(zip(ids, keys, strict=True)),
    )
    chk.expect(
        result[HIDDEN_STATES].stamped_block_ids == tuple(ids), f"{label}: whole-block stamps"
    )
    chk.equal(store.read_blocks(HIDDEN_STATES, ids, keys), rows, f"{label}: whole-block rows")

    # 2. Merged read of 8 requests, each hit + new rows, into preallocated buffers.
    per = len(ids) // 8
    new = torch.randn(8 * 16, hidden, generator=gen).to(dtype)
    requests = [
        ScheduledRequest(
            f"r{i}", 16, per * bs, ids[i * per : (i + 1) * per], keys[i * per : (i + 1) * per]
        )
        for i in range(8)
    ]
    bufs = store.new_read_buffers(8 * (per * bs + 16))
    merged = store.read_merged(requests, hidden_states=new.to(src_dev), out=bufs)
    chk.expect(merged.misses == (), f"{label}: merged read misses")
    for i in range(8):
        want = torch.cat([rows[i * per * bs : (i + 1) * per * bs], new[i * 16 : (i + 1) * 16]])
        chk.equal(merged.hidden_states[f"r{i}"], want, f"{label}: merged rows of r{i}")

    # 3. Chunked writes by slot (partial blocks, odd chunk sizes) stamp on completion.
    store.register("codes", 8, torch.int64)
    codes = torch.randint(0, 2**31, (tokens, 8), generator=gen, dtype=torch.int64)
    all_slots = slots_of(ids, bs)
    start = 0
    for size in (1, 7, 1000, 333, tokens):
        stop = min(tokens, start + size)
        done = {ids[j]: keys[j] for j in range(start // bs, stop // bs)}
        store.write("codes", codes[start:stop].to(src_dev), all_slots[start:stop], block_keys=done)
        start = stop
    chk.expect(store.probe(ids, keys, ["codes"]) == len(ids), f"{label}: chunked stamps")
    chk.equal(store.read_blocks("codes", ids, keys), codes, f"{label}: chunked rows")

    # 4. Bit patterns (NaN payloads, -0, infinities) move unchanged.
    bits = torch.randint(-(2**15), 2**15, (tokens, hidden), generator=gen, dtype=torch.int16)
    bits[0, :6] = torch.tensor([0x7FC1, 0x7F81, -1, -32768, 0x7F80, -0x80], dtype=torch.int16)
    store.write(
        HIDDEN_STATES,
        bits.view(dtype).to(src_dev),
        slots_of(ids, bs),
        block_keys=dict(zip(ids, keys, strict=True)),
    )
    got = store.read_blocks(HIDDEN_STATES, ids, keys).cpu().view(torch.int16)
    chk.expect(torch.equal(got, bits), f"{label}: bf16 bit patterns")

    # 5. A CPU-side write after an asynchronous one to the same slots wins.
    first = torch.full((bs, hidden), 1.0, dtype=dtype)
    second = torch.full((bs, hidden), 2.0, dtype=dtype)
    store.write(HIDDEN_STATES, first.to(src_dev), slots_of(ids[:1], bs))
    store.write(HIDDEN_STATES, second, slots_of(ids[:1], bs), block_keys={ids[0]: keys[0]})
    chk.equal(store.read_blocks(HIDDEN_STATES, ids[:1], keys[:1]), second, f"{label}: write order")

    # 6. Deferred rows staged on the source device, committed with the block table.
    store.register("audio", 4, torch.float32, deferred=True)
    audio = torch.randn(3 * bs + 2, 4, generator=gen)
    store.stage("req", "audio", audio[:5].to(src_dev), token_start=0)
    store.stage("req", "audio", audio[5:].to(src_dev), token_start=5)
    commit = store.commit("req", ids[:4], keys[:3])
    chk.expect(commit["audio"].stamped_block_ids == tuple(ids[:3]), f"{label}: deferred stamps")
    chk.equal(
        store.read_blocks("audio", ids[:3], keys[:3]), audio[: 3 * bs], f"{label}: deferred rows"
    )

    # 7. Pool reuse evicts every key: reads are misses or StaleBlockError.
    pool.free(ordered[::-1])
    again = pool.allocate(num_blocks)
    chk.expect(again is not None and store.probe(ids, keys) == 0, f"{label}: eviction clears")
    miss = store.read_merged(requests[:1], hidden_states=new[:16].to(src_dev))
    chk.expect(
        miss.misses == (ReadMiss("r0", per, 0, HIDDEN_STATES),), f"{label}: miss after eviction"
    )
    try:
        store.read_blocks(HIDDEN_STATES, ids[:2], keys[:2])
    except StaleBlockError as exc:
        chk.expect(exc.block_id == ids[0] and exc.found is None, f"{label}: stale error fields")
    else:
        chk.expect(False, f"{label}: stale read returned rows")
    print(f"  {label}: ok so far ({chk.num_checks} checks, {len(chk.failures)} mismatches)")


# -- the worker's store: capture and staging ------------------------------------------


def check_live_store(
    cfg: Config, hidden: int, bs: int, chk: Checker, *, as_device: bool = False
) -> None:
    """`LiveStore` as the worker drives it: rows and slots from the model's device, the
    store on the CPU; a prefill and decode steps, staged, then a hit asking for its rows.

    On a device the worker's store keeps copies of each staged step's rows and slot
    mapping, and hears of each step before its forward pass (`LiveStore.start_forward`);
    ``as_device`` takes that path with CPU rows, so that its logic is checked on any
    machine."""
    dev, dtype = cfg.source_device, torch.bfloat16
    gen = torch.Generator().manual_seed(2)
    # NOTE: on a device the worker tells the store before each forward pass.
    forward_first = as_device or dev != "cpu"
    live = LiveStore(
        TensorStore(64, bs, hidden_size=hidden, hidden_dtype=dtype),
        max_results=8,
        copy_steps=True if forward_first else None,
    )
    label = f"live store, rows on {dev}{' kept as on a device' if as_device else ''}"
    prompt = 3 * bs  # "a": 3 full blocks, then decode steps filling block 4
    a_blocks = (1, 2, 3, 4)
    rows = torch.randn(prompt + bs, hidden, generator=gen).to(dtype)
    keys = {b: key(b + 5000) for b in a_blocks}
    first = StepPlan(
        caching=True,
        requests=(PlannedRequest("a", 0, prompt, a_blocks[:3]),),
        block_keys={b: keys[b] for b in a_blocks[:3]},
    )
    if forward_first:
        live.start_forward(first)
    live.apply(first, ["a"], rows[:prompt].to(dev), slots_of(list(a_blocks[:3]), bs).to(dev))
    for pos in range(prompt, prompt + bs):  # decode steps: staged with the prefill
        step = StepPlan(
            caching=True,
            requests=(PlannedRequest("a", pos, 1, (4,)),),
            block_keys={4: keys[4]} if pos == prompt + bs - 1 else {},
        )
        if forward_first:
            live.start_forward(step)
        live.apply(
            step, ["a"], rows[pos : pos + 1].to(dev), torch.tensor([4 * bs + pos % bs]).to(dev)
        )
    chk.expect(
        live.stats.num_rows_written == 0 and live.store.stamp_of(HIDDEN_STATES, 1) is None,
        f"{label}: prefill and decode rows staged",
    )
    hit = StepPlan(
        caching=True,
        requests=(
            PlannedRequest("b", 4 * bs, 1, (9,), a_blocks, tuple(keys[b] for b in a_blocks)),
        ),
        prompt_requests={"b": 4 * bs + 1},
        result_keys={"b": "key-b"},
    )
    new_row = torch.randn(1, hidden, generator=gen).to(dtype)
    if forward_first:
        # The hit reads staged blocks: their rows are written before its forward pass.
        live.start_forward(hit)
        chk.expect(
            live.stats.num_rows_written == prompt + bs, f"{label}: staged rows written first"
        )
    live.apply(hit, ["b"], new_row.to(dev), torch.tensor([9 * bs]).to(dev))
    (got,) = live.results.take({"b": "key-b"}).values()
    assert isinstance(got, torch.Tensor)
    chk.equal(got, torch.cat([rows, new_row]), f"{label}: hit rows (stored, staged, new)")
    # NOTE: where the staged rows were written before the hit's forward pass,
    # the hit's own row is staged in turn: written by the next step, or here.
    live.flush()
    stats = live.stats
    chk.expect(
        (stats.num_stale_hit_blocks, stats.num_slot_mismatches, stats.num_rows_written)
        == (0, 0, prompt + bs + 1),
        f"{label}: counters {stats}",
    )


@contextmanager
def host_syncs() -> Iterator[list[str]]:
    """The synchronizing CUDA operations run inside, as torch's sync debug mode reports
    them (warnings); the list is filled on leaving."""
    found: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found.extend(str(w.message) for w in caught if "synchroniz" in str(w.message))


def live_store_timing(hidden: int, bs: int, reps: int, chk: Checker) -> None:
    """Whether a step's store work waits for the GPU: a matmul stands for the forward pass,
    `LiveStore.start_forward` comes before it and `LiveStore.apply` after it on the host, as
    the worker calls them on a GPU; CUDA events time the forward pass. Decode steps (one
    row), then prefill steps (a 512-token chunk each, 8 of them staged at most: every
    eighth step writes the staged ones before its forward pass).

    Both calls run in torch's sync debug mode: `apply` must run no synchronizing CUDA
    operation (a check); `start_forward` runs one only in a step that writes the staged
    steps (their slots' one read), which is counted and printed."""
    dev, dtype = "cuda", torch.bfloat16
    live = LiveStore(
        TensorStore(4096, bs, hidden_size=hidden, hidden_dtype=dtype),
        max_results=8,
        max_staged_bytes=8 * 512 * hidden * 2,
    )
    weight = torch.randn(hidden, hidden, device=dev, dtype=dtype)
    x = torch.randn(8192, hidden, device=dev, dtype=dtype)
    chunk, first_block = 512, 2 + reps * 16 // bs + 1
    for kind in ("decode", "prefill"):
        first_ms: list[float] = []
        host_ms: list[float] = []
        gpu_ms: list[float] = []
        # Steps whose start_forward / apply ran a synchronizing CUDA operation; the first seen.
        synced_before, synced_after, first_sync = 0, 0, ""
        for step in range(reps * 16 if kind == "decode" else reps):
            if kind == "decode":
                pos, block = step % bs, 2 + step // bs
                planned = PlannedRequest("a", 64 + step, 1, (block,))
                slots = torch.tensor([block * bs + pos])
            else:
                blocks = [first_block + step * chunk // bs + i for i in range(chunk // bs)]
                planned = PlannedRequest(f"p{step}", 0, chunk, tuple(blocks))
                slots = slots_of(blocks, bs)
            plan = StepPlan(caching=True, requests=(planned,))
            slot_mapping = slots.to(dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with host_syncs() as before:
                began = time.perf_counter()
                live.start_forward(plan)
                first_ms.append(1e3 * (time.perf_counter() - began))
            start.record()
            out = x @ weight  # the step's forward pass
            end.record()
            with host_syncs() as after:
                began = time.perf_counter()
                live.apply(plan, [planned.req_id], out[: planned.num_new], slot_mapping)
                host_ms.append(1e3 * (time.perf_counter() - began))
            end.synchronize()
            synced_before += bool(before)
            synced_after += bool(after)
            first_sync = first_sync or (after + before + [""])[0]
            gpu_ms.append(start.elapsed_time(end))
        began = time.perf_counter()
        live.flush()  # the staged steps' one read of their slots: it waits for the device
        flush_ms = 1e3 * (time.perf_counter() - began)
        print(
            f"\nlive store, {kind} step on cuda (a {8192} x {hidden} matmul as the forward "
            f"pass): on the host, before it {statistics.median(first_ms):.3f} ms (median; "
            f"max {max(first_ms):.3f}, a step that writes the staged ones), apply after it "
            f"{statistics.median(host_ms):.3f} ms (max {max(host_ms):.3f}); forward "
            f"{statistics.median(gpu_ms):.3f} ms; apply waited for the forward pass if its "
            f"time is near the forward's. Then the write of the steps still staged: "
            f"{flush_ms:.3f} ms. Steps that ran a synchronizing CUDA operation (of "
            f"{len(gpu_ms)}): before the forward pass {synced_before}, after it "
            f"{synced_after}{'; first: ' + first_sync if first_sync else ''}"
        )
        chk.expect(
            synced_after == 0,
            f"live store {kind} steps on cuda: apply after the forward pass synchronized "
            f"with the device in {synced_after} of {len(gpu_ms)} steps ({first_sync})",
        )


# -- bandwidth -------------------------------------------------------------------


def timed(fn: Callable[[], object], cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def bandwidth(cfg: Config, tokens: int, hidden: int, bs: int, reps: int) -> None:
    dtype = torch.bfloat16
    cuda = "cuda" in (cfg.store_device, cfg.source_device)
    gen = torch.Generator().manual_seed(0)
    num_blocks = 2 * tokens // bs
    store = TensorStore(
        num_blocks, bs, device=cfg.store_device, hidden_size=hidden, hidden_dtype=dtype
    )
    cache = store._entries[HIDDEN_STATES].cache
    cache.fill_(1)
    cache_ref = torch.ones_like(cache)
    flat_ref = cache_ref.view(-1, hidden)
    src = torch.randn(tokens, hidden, generator=gen).to(dtype).to(cfg.source_device)
    # The ceiling moves the same bytes between the same devices.
    dst = torch.zeros(
        tokens, hidden, dtype=dtype, device=cfg.store_device, pin_memory=store.pin_memory
    )
    block_ids = torch.randperm(num_blocks, generator=gen)[: tokens // bs]
    slots = (block_ids[:, None] * bs + torch.arange(bs)).reshape(-1)
    keys = {int(b): key(int(b)) for b in block_ids}
    slots_dev = slots.to(cfg.store_device)
    src_on_store = src.to(cfg.store_device)
    k = (tokens // 8 - 16) // bs
    new_rows = torch.randn(8 * 16, hidden, generator=gen).to(dtype).to(cfg.source_device)
    requests = [
        ScheduledRequest(
            f"r{i}",
            16,
            k * bs,
            [int(b) for b in block_ids[i * k : (i + 1) * k]],
            [keys[int(b)] for b in block_ids[i * k : (i + 1) * k]],
        )
        for i in range(8)
    ]
    read_ids = [block_ids[i * k : (i + 1) * k].to(cfg.store_device) for i in range(8)]
    bufs = store.new_read_buffers(8 * (k * bs + 16))

    def reference_write() -> None:
        # The reference moves rows to the cache's device first, then scatters.
        flat_ref[slots_dev] = src.to(cfg.store_device)

    def reference_read() -> None:
        for i, ids in enumerate(read_ids):
            cached = cache_ref[ids].reshape(-1, hidden)
            torch.cat([cached, new_rows[i * 16 : (i + 1) * 16].to(cfg.store_device)])

    cases: dict[str, tuple[Callable[[], object], dict[str, Callable[[], object]]]] = {
        "write": (
            lambda: dst.copy_(src, non_blocking=store.pin_memory),
            {
                "reference": reference_write,
                "TensorStore": lambda: store.write(HIDDEN_STATES, src, slots, block_keys=keys),
            },
        ),
        "read": (
            lambda: dst.copy_(src_on_store),
            {
                "reference": reference_read,
                "TensorStore out=": lambda: store.read_merged(
                    requests, hidden_states=new_rows, out=bufs
                ),
            },
        ),
    }
    store.write(HIDDEN_STATES, src, slots, block_keys=keys)
    nbytes = tokens * hidden * 2
    size = f"{tokens} x {hidden} bf16 ({nbytes / 2**20:.0f} MiB)"
    print(f"\n{cfg.name}: {size}, block {bs}, median of {reps}")
    print(f"{'operation':<24} {'GB/s':>8} {'vs copy_':>9} {'vs reference':>13}")
    for op, (ceiling, variants) in cases.items():
        for fn in (ceiling, *variants.values()):
            fn()
        t_copy: list[float] = []
        t_var: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(reps):
            for name, fn in variants.items():
                t_copy.append(timed(ceiling, cuda))
                t_var[name].append(timed(fn, cuda))
        copy_med = statistics.median(t_copy)
        print(f"{op + ' copy_':<24} {nbytes / copy_med / 1e9:8.1f} {1.0:9.2f}")
        for name, samples in t_var.items():
            med = statistics.median(samples)
            vs_ref = statistics.median(t_var["reference"]) / med
            gbps = nbytes / med / 1e9
            print(f"{op + ' ' + name:<24} {gbps:8.1f} {copy_med / med:9.2f} {vs_ref:13.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--pytest", action="store_true", help="run the store tests first")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name() if cuda else "no CUDA: CPU-only mode"
    print(f"torch {torch.__version__}, {name}")
    rc = 0
    if args.pytest:
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_store*.py")),
            "tests/test_tier_codec.py",
        ]
        print("$", " ".join(cmd), flush=True)
        rc = subprocess.call(cmd)
    chk = Checker()
    for cfg in configs():
        print(f"checking {cfg.name}", flush=True)
        try:
            check_config(cfg, args.tokens, args.hidden, args.block_size, chk)
            if cfg.store_device == "cpu":  # the worker's store is on the CPU
                check_live_store(cfg, args.hidden, args.block_size, chk)
        except Exception:  # report it and keep checking the other configurations
            traceback.print_exc()
            chk.failures.append(f"{cfg.name}: raised")
    try:
        # The worker's store as on a device, with CPU rows: checked on every machine.
        check_live_store(configs()[0], args.hidden, args.block_size, chk, as_device=True)
    except Exception:
        traceback.print_exc()
        chk.failures.append("live store kept as on a device: raised")
    print(f"correctness: {chk.num_checks} checks, {len(chk.failures)} mismatches")
    for cfg in configs():
        if cuda and cfg.name == "cpu":
            continue
        bandwidth(cfg, args.tokens, args.hidden, args.block_size, args.reps)
    if cuda:
        live_store_timing(args.hidden, args.block_size, args.reps, chk)
    if chk.failures or rc:
        print("FAILED:", "; ".join(chk.failures) or f"pytest exit {rc}")
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
