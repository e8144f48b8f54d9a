"""Which layers of a hybrid layer pattern each model chunk holds under a schedule's placement.

Pure Python (no torch, no megatron). megatron-core's ``HybridModel`` takes a pattern such as
``"*-*-|*-*-"``: one symbol per layer (``*`` attention, ``-`` MLP, ``E`` MoE, ``M`` Mamba, ...) and
``|`` between pipeline stages. Megatron gives segment ``vp_stage * p + pp_rank`` to a chunk (its loop
placement, where that index is the chunk's model stage), and without any ``|`` splits the layers
evenly over the pipeline ranks (one chunk per rank only).

Here every placement follows the same rule through the model stage: the chunk holding model stage
``s`` (``Placement.model_slice_of``) builds segment ``s``. For a loop placement that is megatron's
own choice; a V placement's rank 0 holds stages 0 and 2p-1, so it builds the first and the last
segment; both copies of a bidirectional placement's model build the same segments. A multi-token
prediction part (``main/mtp/mtp``, megatron's syntax) is no segment: megatron builds it with the loss, on
the chunk holding the model's last stage (rank 0 under V), whatever the placement. A pattern whose
segment count differs from the placement's stage count is refused with one line naming the count
that would work (:class:`HybridPatternError`).
"""

from __future__ import annotations

import importlib.util

from ..schedules.layer_split import LayerSplit, LayerSplitError
from ..schedules.placement import Placement
from .layer_map import ChunkLayout

PIPE = "|"
MTP_SEPARATOR = "/"
# megatron-core 0.19.2's layer symbols (hybrid_layer_allocation.Symbols.VALID_LAYERS)
SYMBOLS = {"M": "Mamba", "G": "gated delta net", "*": "attention", "D": "DeepSeek sparse attention"}
SYMBOLS |= {"+": "multi-latent attention", "-": "MLP", "E": "MoE"}
MAMBA_KERNELS = ("mamba_ssm", "causal_conv1d")


class HybridPatternError(LayerSplitError):
    """A hybrid layer pattern that does not fit the schedule's placement, or cannot run here."""


def split_mtp(pattern: str, flag: str = "--hybrid-layer-pattern") -> tuple[str, str | None, int]:
    """``(main pattern, MTP pattern or None, MTP depths)`` of a pattern written ``main/mtp/mtp/...``.

    Megatron's own rules for the part after ``/`` (``hybrid_layer_allocation.parse_hybrid_pattern``): one
    layer pattern per prediction depth, every depth the same, and no ``|`` in it (the MTP layers are built
    with the loss, on the model's last stage, under every placement here)."""
    main, *depths = pattern.split(MTP_SEPARATOR)
    if not any(depths):  # megatron reads "main/" as no MTP
        return main, None, 0
    if any(not d for d in depths) or len(set(depths)) > 1:
        raise HybridPatternError(
            f"{flag} {pattern!r}: megatron needs one identical MTP pattern per prediction depth after '/' "
            "(e.g. '*-|*-/*-/*-' for 2 depths)"
        )
    if PIPE in depths[0]:
        raise HybridPatternError(f"{flag} {pattern!r}: megatron's MTP pattern (after '/') takes no '|'")
    return main, depths[0], len(depths)


def main_pattern(pattern: str) -> str:
    """The decoder's layers: the pattern before its first ``/`` (the MTP part is not a pipeline segment)."""
    return pattern.split(MTP_SEPARATOR, 1)[0]


def pattern_segments(pattern: str, flag: str = "--hybrid-layer-pattern") -> tuple[str, ...]:
    """The main pattern's ``|`` segments (one when it has no ``|``); refuses unknown symbols and an MTP part
    that breaks megatron's rules (:func:`split_mtp`)."""
    main, mtp, _ = split_mtp(pattern, flag)
    unknown = sorted({c for c in main + (mtp or "") if c != PIPE and c not in SYMBOLS})
    if unknown:
        raise HybridPatternError(
            f"{flag} {pattern!r}: unknown layer symbol(s) {' '.join(unknown)}; use {' '.join(SYMBOLS)}, '|' and '/'"
        )
    segments = tuple(main.split(PIPE))
    if not "".join(segments):
        raise HybridPatternError(f"{flag} {pattern!r} has no layers")
    return segments


def num_pattern_layers(pattern: str) -> int:
    """Decoder layers of the pattern (the main pattern's symbols without the ``|``; MTP layers not counted)."""
    return len(main_pattern(pattern).replace(PIPE, ""))


def hybrid_layer_split(
    pattern: str, placement: Placement, schedule: str, flag: str = "--hybrid-layer-pattern"
) -> LayerSplit:
    """The layers of each of ``placement``'s model stages under ``pattern`` (stage ``s``: segment ``s``).

    A pattern without ``|`` splits evenly over the ranks, as megatron does, and only where each rank
    holds one stage of the model; otherwise the pattern needs exactly one segment per model stage.
    """
    segments = pattern_segments(pattern, flag)
    p, stages = placement.num_ranks, placement.stages_per_replica
    per_rank = f"{stages // p} per rank" if stages % p == 0 else f"on {p} ranks"
    if len(segments) == 1 and stages > 1:
        layers = len(segments[0])
        if stages != p:
            raise HybridPatternError(
                f"{flag} {pattern!r} has no '|': {schedule} with p={p} runs {stages} model stages ({per_rank}); "
                f"write the pattern as {stages} segments separated by '|'"
            )
        if layers % p:
            raise HybridPatternError(
                f"{flag} {pattern!r}: {layers} layers do not split evenly over p={p} ranks; "
                f"separate the {p} stages with '|'"
            )
        return LayerSplit(counts=(layers // p,) * p)
    if len(segments) != stages:
        raise HybridPatternError(
            f"{flag} {pattern!r} has {len(segments)} segments; {schedule} with p={p} needs {stages} ({per_rank})"
        )
    return LayerSplit(counts=tuple(len(s) for s in segments))


def chunk_layer_types(pattern: str, layout: ChunkLayout) -> list[str]:
    """The decoder layer symbols of one chunk (its layers of the main pattern, ``|`` removed)."""
    flat = main_pattern(pattern).replace(PIPE, "")
    return list(flat[layout.layer_offset : layout.layer_offset + layout.num_layers])


def missing_mamba_kernels() -> list[str]:
    """Those of Mamba's kernel packages that are not installed here."""
    return [name for name in MAMBA_KERNELS if importlib.util.find_spec(name) is None]


def check_runnable(pattern: str, supported: str, where: str, flag: str = "--hybrid-layer-pattern") -> None:
    """Refuse layer symbols that cannot be built ``where`` (``supported``: the symbols that can)."""
    symbols = {c for c in pattern if c not in (PIPE, MTP_SEPARATOR)}
    if "M" in symbols and "M" not in supported:
        missing = missing_mamba_kernels()
        why = f"{' and '.join(missing)} do not import here" if missing else f"they are not built {where}"
        raise HybridPatternError(
            f"{flag} {pattern!r}: Mamba layers ('M') need the mamba_ssm and causal_conv1d kernels: {why}; "
            f"use {' '.join(repr(c) for c in supported)} {where}"
        )
    other = sorted(symbols - set(supported))
    if other:
        names = ", ".join(f"{c!r} ({SYMBOLS[c]})" for c in other)
        raise HybridPatternError(
            f"{flag} {pattern!r}: {names} cannot be built {where}; use {' '.join(repr(c) for c in supported)}"
        )
