"""Schedule agreement: before running a schedule, the pipeline ranks check they all run the same one.

Every rank builds its schedule on its own (from its flags, a file, a measured profile). Two ranks
that disagree (a different ``--pipeline-schedule``, a different file, a different re-plan) would
otherwise train silently wrong or hang. Before the first iteration of a schedule, and after every
re-plan, each rank all-gathers a fingerprint of the schedule over the pipeline group: a hash of
each part (this project's version, p, m, chunks per rank, placement, name and parameters such as
the building block or costs, the ops of every rank) plus a short description. On any difference
every rank raises :class:`ScheduleMismatchError` with one line naming the ranks and the parts that
differ. The all-gather has a bounded timeout (``MEGATRON_PP_AGREE_TIMEOUT`` seconds, default 300),
so a rank that never reaches the check does not hang the others either.

The same check, on a smaller fingerprint (the plugin configuration), runs over the whole world
before megatron builds its process groups (:func:`agree_on_config`), where ranks that disagree
on the placement would otherwise block in megatron's group set-up.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..schedules.schedule import Schedule

AGREE_TIMEOUT_ENV = "MEGATRON_PP_AGREE_TIMEOUT"
DEFAULT_AGREE_TIMEOUT_S = 300.0
_DESCRIPTION_BYTES = 160
_MAX_LISTED = 8  # ranks named in one message (a message stays one short line at any p)

# Parts of a schedule fingerprint, in a fixed order (the ops part is refined per rank row).
PARTS = (
    "project version",
    "pipeline size p",
    "micro-batches m",
    "chunks per rank v",
    "placement",
    "name/params",
    "ops",
)


class ScheduleMismatchError(RuntimeError):
    """The pipeline ranks do not run the same schedule (or one never reached the check)."""


def parse_timeout(text: str, name: str) -> float:
    """Seconds from an environment variable's text: a finite number > 0, else a one-line ValueError."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value < float("inf")):
        raise ValueError(f"{name}={text!r}: expected a number of seconds > 0 (finite), e.g. {name}=300")
    return value


def agree_timeout_s() -> float:
    text = os.environ.get(AGREE_TIMEOUT_ENV)
    return DEFAULT_AGREE_TIMEOUT_S if text is None else parse_timeout(text, AGREE_TIMEOUT_ENV)


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1  # fits int64


def _project_version() -> str:
    from .. import __version__

    return __version__


def schedule_parts(schedule: Schedule) -> list[str]:
    """The text of each fingerprint part (:data:`PARTS`), rows of ops last (one per rank)."""
    placement = schedule.placement
    params = ";".join(f"{k}={schedule.params[k]!r}" for k in sorted(schedule.params))
    return [
        _project_version(),
        str(schedule.num_ranks),
        str(schedule.num_microbatches),
        str(schedule.chunks_per_rank),
        f"{placement.style}|{placement.num_replicas}|{placement.locations}|{schedule.microbatch_replicas}",
        f"{schedule.name}|{params}",
        *(" ".join(map(str, row)) for row in schedule.ops),
    ]


def describe(schedule: Schedule) -> str:
    return (
        f"{schedule.name!r} p={schedule.num_ranks} m={schedule.num_microbatches} v={schedule.chunks_per_rank} "
        f"({schedule.placement.style})"
    )


def _gather(values: torch.Tensor, group: dist.ProcessGroup | None, timeout_s: float, what: str) -> list[torch.Tensor]:
    size = dist.get_world_size(group)
    if dist.get_backend(group) == "nccl":  # NCCL gathers device tensors only
        values = values.to(torch.device("cuda", torch.cuda.current_device()))
    out = [torch.zeros_like(values) for _ in range(size)]
    try:
        work = dist.all_gather(out, values, group=group, async_op=True)
        assert work is not None
        work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise ScheduleMismatchError(
            f"megatron_pp_ext: rank {dist.get_rank()}: {what}: not every rank of the group reached the check "
            f"within {timeout_s:g}s ({AGREE_TIMEOUT_ENV}) — a rank died, hangs, or runs another program: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        ) from None
    return [t.cpu() for t in out]


def _encode(description: str) -> torch.Tensor:
    raw = description.encode()[:_DESCRIPTION_BYTES].ljust(_DESCRIPTION_BYTES, b" ")
    return torch.tensor(list(raw), dtype=torch.int64)


def _decode(values: torch.Tensor) -> str:
    return bytes(int(x) for x in values.tolist()).decode(errors="replace").rstrip()


def _ranks_text(ranks: Sequence[int]) -> str:
    shown = ", ".join(map(str, ranks[:_MAX_LISTED]))
    more = f" and {len(ranks) - _MAX_LISTED} more" if len(ranks) > _MAX_LISTED else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{more}"


def check_agreement(
    parts: Sequence[str],
    description: str,
    group: dist.ProcessGroup | None,
    *,
    what: str = "pipeline schedule",
    part_names: Sequence[str] = PARTS,
    timeout_s: float | None = None,
    per_rank_rows: bool = True,
) -> None:
    """All-gather the digests of ``parts`` (the last ones are per-rank rows) and raise on any difference.

    ``part_names`` names the leading parts; parts beyond it are rows named ``{last name} of rank i``.
    Ranks are group ranks. Every rank reaches the same verdict (it sees the same gathered data).
    """
    timeout_s = agree_timeout_s() if timeout_s is None else timeout_s
    fixed = len(part_names) - 1
    head = [_digest(p) for p in parts[:fixed]] + [_digest("\n".join(parts[fixed:])), len(parts) - fixed]
    mine = torch.cat([torch.tensor(head, dtype=torch.int64), _encode(description)])
    gathered = _gather(mine, group, timeout_s, what)
    heads = [g[: len(head)].tolist() for g in gathered]
    if all(h == heads[0] for h in heads):
        return
    descriptions = [_decode(g[len(head) :]) for g in gathered]
    differing = [name for i, name in enumerate(part_names) if len({h[i] for h in heads}) > 1]
    own = [f"{name}={parts[i]}" for i, name in enumerate(part_names[:fixed]) if name in differing]
    if own and len(part_names) > 2:  # each rank's own values of the differing parts (a second, same-shaped gather)
        values = [_decode(t) for t in _gather(_encode(", ".join(own)), group, timeout_s, what)]
        if per_rank_rows:  # a schedule: its description, and what differs (parameters the description omits)
            descriptions = [f"{d} with {v}" for d, v in zip(descriptions, values, strict=True)]
        else:  # a configuration: the fields that differ say it all
            descriptions = values
            if part_names[-1] in differing:
                differing.remove(part_names[-1])
    if per_rank_rows and part_names[-1] in differing and len({h[-1] for h in heads}) == 1:
        # Same number of rows on every rank: find the rows that differ (a second, same-shaped gather).
        rows = torch.tensor([_digest(p) for p in parts[fixed:]], dtype=torch.int64)
        all_rows = [r.tolist() for r in _gather(rows, group, timeout_s, what)]
        bad_rows = [i for i in range(len(all_rows[0])) if len({r[i] for r in all_rows}) > 1]
        differing[differing.index(part_names[-1])] = f"{part_names[-1]} of {_ranks_text(bad_rows)}"
    # Group the ranks by fingerprint, largest group (or rank 0's) first.
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, h in enumerate(heads):
        groups.setdefault(tuple(h), []).append(rank)
    ordered = sorted(groups.values(), key=lambda ranks: (ranks[0] != 0, -len(ranks)))
    shown = "; ".join(f"{_ranks_text(r)}: {descriptions[r[0]]}" for r in ordered[:4])
    if len(ordered) > 4:
        shown += f"; and {len(ordered) - 4} more variants"
    raise ScheduleMismatchError(
        f"megatron_pp_ext: the ranks disagree on the {what}: {', '.join(differing)} differ — {shown}"
    )


_enabled = True


def set_enabled(enabled: bool) -> None:
    """Testing aid: switch the schedule agreement off (to provoke what it prevents)."""
    global _enabled
    _enabled = enabled


_agreed: dict[tuple[int, int], weakref.ref[Schedule]] = {}


def agree_on_schedule(schedule: Schedule, group: dist.ProcessGroup, *, timeout_s: float | None = None) -> None:
    """Check once per (schedule object, group) that every rank of ``group`` runs ``schedule``."""
    if not _enabled:
        return
    key = (id(schedule), id(group))
    ref = _agreed.get(key)
    if ref is not None and ref() is schedule:
        return
    check_agreement(schedule_parts(schedule), describe(schedule), group, timeout_s=timeout_s)
    _agreed[key] = weakref.ref(schedule)


def agree_on_config(config: Sequence[tuple[str, str]], *, timeout_s: float | None = None) -> None:
    """Before megatron builds its groups: every rank of the world has the same plugin configuration,
    given as ``(flag, value)`` fields; a disagreement names each rank's own values of the fields that differ."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    text = " ".join(f"{name}={value}" for name, value in config)
    check_agreement(
        [_project_version(), *(value for _, value in config), text],
        text[:_DESCRIPTION_BYTES],
        None,
        what="pipeline configuration (--pipeline-* flags)",
        part_names=("project version", *(name for name, _ in config), "pipeline configuration"),
        timeout_s=timeout_s,
        per_rank_rows=False,
    )
