"""A model step's outputs by name: which are cached, which create an entry, which pass through."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import NamedTuple

import torch

from omnicache.block_hash import BlockHash
from omnicache.checks import check_optional_int, type_name
from omnicache.store.entries import Entry, Layout, check_rows, make_spec
from omnicache.store.specs import HIDDEN_STATES, EntrySpec, StoreStats

# NOTE: the package's logger, whichever module logs: the name users configure.
_log = logging.getLogger("omnicache.store")


class DirectWrites(NamedTuple):
    """A step's checked writes of direct entries: applying them cannot fail."""

    # Entries the step's outputs create (checked to fit under max_bytes).
    new_specs: list[EntrySpec]
    # Each entry written, and its rows.
    todo: list[tuple[EntrySpec, torch.Tensor]]
    # Checked keys of blocks the writes may complete.
    block_keys: Mapping[int, BlockHash]
    # Outputs that look per-token but are not placed (see `direct_outputs`),
    # with their shapes; and the step's rows, and rows padding included.
    unplaced: list[tuple[str, tuple[int, ...]]]
    num_rows: int
    num_tokens_padded: int


def merge_outputs(
    hidden_states: torch.Tensor | None, multimodal_outputs: Mapping[str, object] | None
) -> dict[str, object]:
    """The step's outputs in one mapping, hidden states first."""
    outputs: dict[str, object] = {}
    if multimodal_outputs is not None and not isinstance(multimodal_outputs, Mapping):
        raise TypeError(
            f"multimodal_outputs: expected a mapping, found {type_name(multimodal_outputs)}"
        )
    if hidden_states is not None:
        if multimodal_outputs is not None and HIDDEN_STATES in multimodal_outputs:
            raise ValueError(
                f"multimodal_outputs: expected no {HIDDEN_STATES!r} key when hidden_states is given"
            )
        outputs[HIDDEN_STATES] = hidden_states
    if multimodal_outputs is not None:
        outputs.update(multimodal_outputs)
    return outputs


def padded_rows(num_tokens_padded: int | None, num_rows: int) -> int:
    """Rows the model produced, padding included: at least ``num_rows`` (None: ``num_rows``)."""
    padded = check_optional_int("num_tokens_padded", num_tokens_padded, minimum=num_rows)
    return num_rows if padded is None else padded


def direct_outputs(
    layout: Layout,
    entries: Mapping[str, Entry],
    outputs: Mapping[str, object],
    num_rows: int,
    num_tokens_padded: int,
) -> tuple[
    list[EntrySpec], list[tuple[EntrySpec, torch.Tensor]], list[tuple[str, tuple[int, ...]]]
]:
    """The outputs a step writes directly, checked, and the entries they create.

    An output is per-token, and cached, when it is a registered entry or a
    tensor with 2 or more dims whose first dim is ``num_tokens_padded``; such
    a tensor of an unknown name creates its entry. Deferred entries and
    everything else (1-D per-request metadata, lists, ...) are left out.

    Of those left out, a tensor of 2 or more dims with at least ``num_rows``
    but fewer than ``num_tokens_padded`` rows is unplaced: it looks
    per-token, but on a padded step its first dim may as well count requests
    (a decode step has one token per request), so no entry is created from
    it.

    Returns:
        The specs of the entries to create, (spec, rows) of each output to
        write, at least ``num_rows`` rows each, and the name and shape of
        each unplaced output.
    """
    new_specs: list[EntrySpec] = []
    todo: list[tuple[EntrySpec, torch.Tensor]] = []
    unplaced: list[tuple[str, tuple[int, ...]]] = []
    for name, value in outputs.items():
        existing = entries.get(name)
        if existing is not None:
            if existing.spec.deferred:
                continue
            todo.append((existing.spec, entry_output(name, value)))
        elif name == HIDDEN_STATES or _is_per_token(value, num_tokens_padded):
            # NOTE: hidden states are always cached: anything but a tensor
            # here is an error, never passed through as metadata.
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"outputs[{name!r}]: expected torch.Tensor, found {type_name(value)}"
                )
            if value.ndim < 2:
                raise ValueError(
                    f"outputs[{name!r}]: expected (tokens, hidden) rows, found "
                    f"shape {tuple(value.shape)}"
                )
            spec = make_spec(layout, name, tuple(value.shape[1:]), value.dtype, False)
            new_specs.append(spec)
            todo.append((spec, value))
        elif (
            isinstance(value, torch.Tensor)
            and value.ndim >= 2
            and num_rows <= value.shape[0] < num_tokens_padded
        ):
            unplaced.append((name, tuple(value.shape)))
    for spec, value in todo:
        check_rows(spec, value, num_rows)
    return new_specs, todo, unplaced


def report_unplaced(direct: DirectWrites, stats: StoreStats, logged: set[str]) -> None:
    """Counts a checked step's unplaced outputs; logs each name the first time only."""
    for name, shape in direct.unplaced:
        stats.num_unplaced_outputs += 1
        if name in logged:
            continue
        logged.add(name)
        _log.warning(
            "output %r: shape %s on a step of %d rows padded to %d: not cached (it has "
            "neither the padded rows of a per-token output nor an entry; register it to "
            "cache its first %d rows); logged once, counted in num_unplaced_outputs",
            name,
            shape,
            direct.num_rows,
            direct.num_tokens_padded,
            direct.num_rows,
        )


def deferred_outputs(
    entries: Mapping[str, Entry], outputs: Mapping[str, object], num_rows: int
) -> list[tuple[Entry, torch.Tensor]]:
    """The outputs of deferred entries, checked to hold at least ``num_rows`` rows."""
    todo: list[tuple[Entry, torch.Tensor]] = []
    for name, value in outputs.items():
        existing = entries.get(name)
        if existing is None or not existing.spec.deferred:
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"outputs[{name!r}]: expected torch.Tensor, found {type_name(value)}")
        check_rows(existing.spec, value, num_rows)
        todo.append((existing, value))
    return todo


def entry_output(name: str, value: object) -> torch.Tensor:
    """The output of registered entry ``name``: a tensor (its rows are checked apart)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"outputs[{name!r}]: expected torch.Tensor for a cached entry, found {type_name(value)}"
        )
    return value


def _is_per_token(value: object, num_tokens: int) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[0] == num_tokens
