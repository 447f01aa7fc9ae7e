"""A model step's outputs by name: which are cached, which create an entry, which pass through."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from omnicache.block_hash import BlockHash
from omnicache.checks import check_optional_int, type_name
from omnicache.store.entries import Entry, Layout, check_rows, make_spec
from omnicache.store.specs import HIDDEN_STATES, EntrySpec


class DirectWrites(NamedTuple):
    """A step's checked writes of direct entries: applying them cannot fail."""

    # Entries the step's outputs create (checked to fit under max_bytes).
    new_specs: list[EntrySpec]
    # Each entry written, and its rows.
    todo: list[tuple[EntrySpec, torch.Tensor]]
    # Checked keys of blocks the writes may complete.
    block_keys: Mapping[int, BlockHash]


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
) -> tuple[list[EntrySpec], list[tuple[EntrySpec, torch.Tensor]]]:
    """The outputs a step writes directly, checked, and the entries they create.

    An output is per-token, and cached, when it is a registered entry or a
    tensor with 2 or more dims whose first dim is ``num_tokens_padded``; such
    a tensor of an unknown name creates its entry. Deferred entries and
    everything else (1-D per-request metadata, lists, ...) are left out.

    Returns:
        The specs of the entries to create, and (spec, rows) of each output
        to write, at least ``num_rows`` rows each.
    """
    new_specs: list[EntrySpec] = []
    todo: list[tuple[EntrySpec, torch.Tensor]] = []
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
    for spec, value in todo:
        check_rows(spec, value, num_rows)
    return new_specs, todo


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
