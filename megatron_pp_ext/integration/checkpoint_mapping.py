"""Move the weights of a ``--ckpt-format torch`` checkpoint onto chunks placed differently.

A torch-format checkpoint holds, per pipeline rank, each chunk's state dict with chunk-local layer
numbers (``decoder.layers.0...`` is the chunk's first layer). Knowing the layout table the checkpoint
was saved with (:mod:`.checkpoint_layout`), every layer gets its global number back; a chunk of this
run then takes the layers it holds, renumbered from its own first layer, and the other entries by role:

* ``decoder.layers.<j>.<rest>`` of a saved chunk starting at layer ``o``: global layer ``o + j``;
* any other key (embedding, final norm, output layer, buffers): from a saved chunk with the same role
  (holds the embedding / holds the loss) as the chunk being filled, or held by every saved chunk.

Tensors are taken as they are (no copy, no arithmetic), so a mapped load is exact. Two copies of a
layer (a bidirectional placement's replicas) are equal in a saved checkpoint; the first is taken.
Only the model moves: the optimizer state of this format is a per-rank list of parameters in the
saving run's order. :func:`map_chunks` checks that every chunk gets exactly the keys the chunk
expects; anything missing or left over is an error, never a partial load.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from .checkpoint_layout import LayoutTable

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


class MappingError(ValueError):
    """The checkpoint's chunks cannot fill this run's chunks exactly."""


def map_chunks(
    saved_chunks: Sequence[Sequence[Mapping[str, Any]]],
    saved: LayoutTable,
    current: LayoutTable,
    rank: int,
    expected_keys: Sequence[set[str]] | None = None,
) -> list[dict[str, Any]]:
    """The state dicts of ``rank``'s chunks under ``current``, from every saved rank's chunk state dicts.

    ``saved_chunks[r][c]``: saved rank ``r``'s chunk ``c`` (laid out as ``saved[r][c]``);
    ``expected_keys[c]``: the keys this run's chunk ``c`` has (checked when given).
    """
    if [len(c) for c in saved_chunks] != [len(c) for c in saved]:
        raise MappingError(
            f"the checkpoint's files hold {[len(c) for c in saved_chunks]} chunks per rank, its layout record "
            f"{[len(c) for c in saved]}"
        )
    layers: dict[int, dict[str, Any]] = {}
    others: dict[str, tuple[Any, set[tuple[bool, bool]]]] = {}
    for chunks, layouts in zip(saved_chunks, saved, strict=True):
        for chunk, (offset, num_layers, pre, post) in zip(chunks, layouts, strict=True):
            for key, value in chunk.items():
                match = _LAYER.fullmatch(key)
                if match is None:
                    entry = others.setdefault(key, (value, set()))
                    entry[1].add((pre, post))
                    continue
                local = int(match.group(1))
                if local >= num_layers:
                    raise MappingError(f"saved key {key!r} is beyond the {num_layers} layer(s) of its chunk")
                layers.setdefault(offset + local, {}).setdefault(match.group(2), value)
    everywhere = {key for key in others if all(key in chunk for chunks in saved_chunks for chunk in chunks)}
    result = []
    for c, (offset, num_layers, pre, post) in enumerate(current[rank]):
        state: dict[str, Any] = {}
        for local in range(num_layers):
            if offset + local not in layers:
                raise MappingError(f"layer {offset + local} is in no chunk of the checkpoint")
            for rest, value in layers[offset + local].items():
                state[f"decoder.layers.{local}.{rest}"] = value
        for key, (value, roles) in others.items():
            if (pre, post) in roles or key in everywhere:
                state[key] = value
        if expected_keys is not None:
            _check_keys(c, state, expected_keys[c])
        result.append(state)
    return result


def _check_keys(chunk: int, state: Mapping[str, Any], expected: set[str]) -> None:
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or extra:
        raise MappingError(
            f"chunk {chunk} would get {len(missing)} key(s) too few {missing[:3]} and {len(extra)} too many {extra[:3]}"
        )
