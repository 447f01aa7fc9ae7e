"""TensorStore write and merged-read bandwidth against a plain copy and the reference approach.

Workload: 8192 tokens x 4096 hidden bf16 (64 MiB) by default, written to
scattered whole blocks of 16 tokens (a pool after churn), and read back as a
step of 8 requests that each hit 63 blocks and bring 16 new tokens (8192
merged rows, 64 MiB).

Rows, measured in one process, each timed right after a copy_ of the same
bytes so that the shared machine's load hits both alike (ratios are medians
of these paired ratios; GB/s are medians of --reps):
  copy_ (ceiling)   dst.copy_(src) of the same bytes into an existing buffer
  reference         vllm-omni's approach: flat[slots] = hs to write;
                    cache[block_ids].reshape(-1, h) then torch.cat with the new
                    rows to read
  TensorStore       write(): validation, stamps and the data move;
                    read_merged(out=...): stamp checks and gathers into
                    preallocated buffers; read_merged() without out allocates

Targets: writes >= 85% of the ceiling; merged reads >= 70% of the ceiling and
>= 2x the reference. Usage:

    python benchmarks/bench_store.py [--tokens N] [--hidden H] [--reps R] [--check]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from omnicache.block_hash import BlockHash
from omnicache.store import HIDDEN_STATES, ScheduledRequest, TensorStore

WRITE_TARGET = 0.85
READ_TARGET = 0.70
READ_VS_REFERENCE = 2.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16, help="new rows per request")
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)

    tokens, hidden, bs, device = args.tokens, args.hidden, args.block_size, args.device
    if tokens % bs or tokens % args.requests:
        parser.error("--tokens must be a multiple of --block-size and of --requests")
    per_request = tokens // args.requests
    num_hit_blocks = (per_request - args.new_tokens) // bs
    if num_hit_blocks * bs + args.new_tokens != per_request:
        parser.error("tokens per request minus --new-tokens must be whole blocks")
    num_blocks = 2 * (tokens // bs)
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(0)

    store = TensorStore(num_blocks, bs, device=device, hidden_size=hidden, hidden_dtype=dtype)
    cache = store._entries[HIDDEN_STATES].cache  # the same layout the reference uses
    cache_ref = torch.zeros_like(cache)
    flat_ref = cache_ref.view(-1, hidden)
    # Touch every page once so that no row measures first-touch faults.
    cache.fill_(1)
    cache_ref.fill_(1)

    src = torch.randn(tokens, hidden, generator=gen).to(dtype).to(device)
    dst = torch.empty_like(src).fill_(0)
    block_ids = torch.randperm(num_blocks, generator=gen)[: tokens // bs]
    slots = (block_ids[:, None] * bs + torch.arange(bs)).reshape(-1)
    keys = {int(b): BlockHash(int(b).to_bytes(16, "little")) for b in block_ids}
    slots_dev = slots.to(device)

    # Read step: request i hits blocks block_ids[i*k:(i+1)*k] (written above)
    # and brings new_tokens rows of this step.
    k = num_hit_blocks
    new_rows = torch.randn(args.requests * args.new_tokens, hidden, generator=gen).to(dtype)
    new_rows = new_rows.to(device)
    requests = []
    for i in range(args.requests):
        ids = [int(b) for b in block_ids[i * k : (i + 1) * k]]
        requests.append(
            ScheduledRequest(f"r{i}", args.new_tokens, k * bs, ids, [keys[b] for b in ids])
        )
    read_ids = [block_ids[i * k : (i + 1) * k].to(device) for i in range(args.requests)]
    total_rows = args.requests * (k * bs + args.new_tokens)
    bufs = store.new_read_buffers(total_rows)
    bufs[HIDDEN_STATES].fill_(0)
    read_src = torch.randn(total_rows, hidden, generator=gen).to(dtype).to(device)
    read_dst = torch.empty_like(read_src).fill_(0)

    def write_ceiling() -> None:
        dst.copy_(src)

    def write_reference() -> None:
        flat_ref[slots_dev] = src

    def write_store() -> None:
        store.write(HIDDEN_STATES, src, slots, block_keys=keys)

    def read_ceiling() -> None:
        read_dst.copy_(read_src)

    def read_reference() -> dict[str, torch.Tensor]:
        merged = {}
        n = args.new_tokens
        for i, ids in enumerate(read_ids):
            cached = cache_ref[ids].reshape(-1, hidden)
            merged[f"r{i}"] = torch.cat([cached, new_rows[i * n : (i + 1) * n]], dim=0)
        return merged

    def read_store() -> None:
        store.read_merged(requests, hidden_states=new_rows, out=bufs)

    def read_store_alloc() -> None:
        store.read_merged(requests, hidden_states=new_rows)

    write_store()
    write_reference()
    # Correctness before speed: the store's merged rows equal the reference's.
    merged = store.read_merged(requests, hidden_states=new_rows, out=bufs)
    reference = read_reference()
    assert merged.misses == ()
    for req_id, rows in reference.items():
        if not torch.equal(merged.hidden_states[req_id], rows):
            raise SystemExit(f"merged rows of {req_id} differ from the reference")

    ceilings: dict[str, Callable[[], object]] = {"write": write_ceiling, "read": read_ceiling}
    variants: dict[str, dict[str, Callable[[], object]]] = {
        "write": {"reference": write_reference, "TensorStore": write_store},
        "read": {
            "reference": read_reference,
            "TensorStore out=": read_store,
            "TensorStore alloc": read_store_alloc,
        },
    }
    on_cuda = str(device).startswith("cuda")

    def timed(fn: Callable[[], object]) -> float:
        if on_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if on_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    # times[op][name]: seconds per rep; vs_copy[op][name]: paired ceiling/variant.
    times: dict[str, dict[str, list[float]]] = {op: {"copy_": []} for op in variants}
    vs_copy: dict[str, dict[str, list[float]]] = {op: {"copy_": []} for op in variants}
    for op, group in variants.items():
        ceilings[op]()
        for name, fn in group.items():
            fn()
            times[op][name] = []
            vs_copy[op][name] = []
    for _ in range(args.reps):
        for op, group in variants.items():
            for name, fn in group.items():
                t_copy = timed(ceilings[op])
                t_variant = timed(fn)
                times[op]["copy_"].append(t_copy)
                times[op][name].append(t_variant)
                vs_copy[op][name].append(t_copy / t_variant)

    nbytes = tokens * hidden * src.element_size()
    print(
        f"TensorStore bandwidth: {tokens} tokens x {hidden} {str(dtype).removeprefix('torch.')} "
        f"({nbytes / 2**20:.0f} MiB), block {bs}, {device}, {torch.get_num_threads()} threads, "
        f"median of {args.reps}"
    )
    print(f"{'operation':<24} {'GB/s':>7} {'vs copy_':>9} {'vs reference':>13}")
    ratios: dict[str, float] = {}
    for op in variants:
        ref_times = times[op]["reference"]
        for name, samples in times[op].items():
            gbps = nbytes / statistics.median(samples) / 1e9
            ratio = 1.0 if name == "copy_" else statistics.median(vs_copy[op][name])
            # Against the reference: the same rep's reference time over this one.
            pairs = zip(ref_times, samples, strict=False) if name != "copy_" else ()
            vs_ref = (
                statistics.median([r / t for r, t in pairs]) if name != "copy_" else float("nan")
            )
            ratios[f"{op} {name}"] = ratio
            ratios[f"{op} {name} vs reference"] = vs_ref
            vs_ref_text = "" if name == "copy_" else f"{vs_ref:13.2f}"
            print(f"{op + ' ' + name:<24} {gbps:7.2f} {ratio:9.2f} {vs_ref_text}")
    write_ratio = ratios["write TensorStore"]
    read_ratio = ratios["read TensorStore out="]
    read_vs_ref = ratios["read TensorStore out= vs reference"]
    checks = [
        (f"write >= {WRITE_TARGET:.0%} of copy_", write_ratio, write_ratio >= WRITE_TARGET),
        (f"merged read >= {READ_TARGET:.0%} of copy_", read_ratio, read_ratio >= READ_TARGET),
        (
            f"merged read >= {READ_VS_REFERENCE:.0f}x reference",
            read_vs_ref,
            read_vs_ref >= READ_VS_REFERENCE,
        ),
    ]
    for label, value, ok in checks:
        print(f"target {label:<30} {value:6.2f}  {'met' if ok else 'MISSED'}")
    return 1 if args.check and not all(ok for _, _, ok in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
