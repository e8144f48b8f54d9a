"""A schedule: a placement plus, for every rank, its ordered list of compute ops.

Plain data. It prints as a per-rank table, round-trips to CSV and can be loaded
from a user's file.

CSV format (one row per rank, header lines start with ``#``)::

    # megatron_pp_ext schedule v1
    # name=1f1b
    # placement=loop            (or v, bidirectional, or a full spec from Placement.to_spec)
    # chunks=1                  (loop only: virtual stages per rank; default 1)
    # microbatches=8            (default: largest micro-batch index + 1)
    # replicas=0,0,1,1,...      (bidirectional only: replica of each micro-batch)
    0,F0.0,F0.1,F0.2,BW0.0,...
    1,F1.0,...,F1.4+BW6.1,...

The first cell of a row is the rank; the others are ops in ``<KIND><stage>.<mb>``
syntax (see :mod:`megatron_pp_ext.schedules.ir`). Empty cells are ignored. A cell
``<op>+<op>`` is an *overlap pair* (:attr:`Schedule.overlap_pairs`): two consecutive ops,
one forward and one backward, that the executor may run together (DualPipe).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from .ir import Op, OpKind, ScheduleSyntaxError
from .limits import MAX_FILE_BYTES, MAX_OPS
from .placement import Placement, make_placement

CSV_MAGIC = "megatron_pp_ext schedule v1"


@dataclass(frozen=True)
class Schedule:
    placement: Placement
    num_microbatches: int
    ops: tuple[tuple[Op, ...], ...]  # ops[rank] = ordered compute ops of that rank
    name: str = "custom"
    microbatch_replicas: tuple[int, ...] = ()  # empty = every micro-batch on replica 0
    params: dict[str, object] = field(default_factory=dict, compare=False)
    # overlap_pairs[rank]: index i of every overlap pair (ops i and i+1 of the rank, which the executor
    # may run together and the simulator times with its overlap factor); empty = no pairs anywhere
    overlap_pairs: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(tuple(row) for row in self.ops))
        if self.overlap_pairs:
            self._check_overlap_pairs()
        if len(self.ops) != self.placement.num_ranks:
            raise ScheduleSyntaxError(
                f"schedule has {len(self.ops)} rank rows but the placement has {self.placement.num_ranks} ranks"
            )
        if self.microbatch_replicas and len(self.microbatch_replicas) != self.num_microbatches:
            raise ScheduleSyntaxError(
                f"replicas lists {len(self.microbatch_replicas)} micro-batches, expected {self.num_microbatches}"
            )

    def _check_overlap_pairs(self) -> None:
        pairs = tuple(tuple(sorted(row)) for row in self.overlap_pairs)
        object.__setattr__(self, "overlap_pairs", pairs)
        if len(pairs) != len(self.ops):
            raise ScheduleSyntaxError(f"overlap_pairs has {len(pairs)} rank rows, the schedule {len(self.ops)}")
        for rank, (row, starts) in enumerate(zip(self.ops, pairs, strict=True)):
            for k, i in enumerate(starts):
                if not 0 <= i < len(row) - 1 or (k and starts[k - 1] + 1 >= i):
                    raise ScheduleSyntaxError(
                        f"rank {rank}: overlap pair at op {i} must start at 0..{len(row) - 2} and not share an op "
                        "with another pair"
                    )

    def with_overlap_pairs(self, pairs: Sequence[Iterable[int]]) -> Schedule:
        """This schedule with ``pairs[rank]`` (first op index of each pair) as its overlap pairs."""
        return replace(self, overlap_pairs=tuple(tuple(row) for row in pairs), params=dict(self.params))

    def pair_cells(self, rank: int) -> list[str]:
        """Rank ``rank``'s ops as text cells, an overlap pair as one ``<op>+<op>`` cell."""
        row = self.ops[rank]
        starts = set(self.overlap_pairs[rank]) if self.overlap_pairs else set()
        cells: list[str] = []
        for i, op in enumerate(row):
            if i - 1 in starts:
                cells[-1] += f"+{op}"
            else:
                cells.append(str(op))
        return cells

    # ---- shape ---------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return self.placement.num_ranks

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    @property
    def chunks_per_rank(self) -> int:
        return self.placement.chunks_per_rank

    def replica_of_microbatch(self, microbatch: int) -> int:
        return self.microbatch_replicas[microbatch] if self.microbatch_replicas else 0

    def stages_of_microbatch(self, microbatch: int) -> range:
        """Global stages a micro-batch passes through, in forward order."""
        first = self.placement.first_stage(self.replica_of_microbatch(microbatch))
        return range(first, first + self.placement.stages_per_replica)

    @property
    def splits_backward(self) -> bool:
        """Whether any backward is split into ``B`` and ``W`` (the weight-gradient store is needed)."""
        return any(op.kind in (OpKind.B, OpKind.W) for row in self.ops for op in row)

    def all_ops(self) -> Iterable[tuple[int, int, Op]]:
        for rank, row in enumerate(self.ops):
            for index, op in enumerate(row):
                yield rank, index, op

    # ---- text ----------------------------------------------------------------------------
    def table(self, max_ops: int | None = None) -> str:
        """A readable per-rank table (one line per rank)."""
        width = max((len(str(op)) for _, _, op in self.all_ops()), default=4)
        lines = [f"{self.name}: p={self.num_ranks} m={self.num_microbatches} stages={self.num_stages}"]
        for rank, row in enumerate(self.ops):
            shown = row if max_ops is None else row[:max_ops]
            cells = " ".join(str(op).ljust(width) for op in shown)
            more = f" ... (+{len(row) - len(shown)})" if len(shown) < len(row) else ""
            lines.append(f"rank {rank:>2}: {cells}{more}".rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_csv(self) -> str:
        out = io.StringIO()
        out.write(f"# {CSV_MAGIC}\n# name={self.name}\n# placement={self.placement.to_spec()}\n")
        out.write(f"# microbatches={self.num_microbatches}\n")
        if self.microbatch_replicas:
            out.write("# replicas=" + ",".join(map(str, self.microbatch_replicas)) + "\n")
        writer = csv.writer(out, lineterminator="\n")
        for rank in range(self.num_ranks):
            writer.writerow([rank, *self.pair_cells(rank)])
        return out.getvalue()

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_csv())

    @classmethod
    def from_csv(cls, text: str, source: str = "<csv>") -> Schedule:
        header: dict[str, str] = {}
        rows: dict[int, list[Op]] = {}
        pairs: dict[int, list[int]] = {}
        body = []
        num_ops = 0
        for lineno, line in enumerate(text.removeprefix("\ufeff").splitlines(), 1):  # a byte-order mark
            stripped = line.strip()
            if not stripped:
                continue
            if stripped.startswith("#"):
                key, sep, value = stripped.lstrip("#").strip().partition("=")
                if sep:
                    header[key.strip().lower()] = value.strip()
                continue
            body.append((lineno, line))
        for lineno, line in body:
            cells = next(csv.reader([line]))
            try:
                rank = int(cells[0])
            except ValueError:
                raise ScheduleSyntaxError(
                    f"{source}:{lineno}: first cell must be the rank number, got {cells[0][:40]!r}"
                ) from None
            if rank < 0:
                raise ScheduleSyntaxError(f"{source}:{lineno}: rank {rank} out of range: ranks are 0, 1, 2, ...")
            if rank in rows:
                raise ScheduleSyntaxError(f"{source}:{lineno}: rank {rank} has two rows")
            try:
                rows[rank], pairs[rank] = [], []
                for cell in filter(str.strip, cells[1:]):
                    parts = cell.split("+")
                    if len(parts) > 2:
                        raise ScheduleSyntaxError(f"an overlap pair has two ops, got {cell!r}")
                    if len(parts) == 2:
                        pairs[rank].append(len(rows[rank]))
                    rows[rank] += [Op.parse(part) for part in parts]
                    num_ops += len(parts)
                    if num_ops > MAX_OPS:
                        raise ScheduleSyntaxError(f"the file has more than {MAX_OPS:,} ops, the limit of a schedule")
            except ScheduleSyntaxError as exc:
                raise ScheduleSyntaxError(f"{source}:{lineno} (rank {rank}): {exc}") from None
        if not rows:
            raise ScheduleSyntaxError(f"{source}: no rank rows found")
        num_ranks = max(rows) + 1
        if num_ranks > len(rows):  # a gap: name the first few missing ranks (linear in the rows, any gap)
            shown = [r for r in range(min(num_ranks, len(rows) + 10)) if r not in rows][:10]
            more = f" ... ({num_ranks - len(rows)} in all)" if num_ranks - len(rows) > len(shown) else ""
            raise ScheduleSyntaxError(f"{source}: no row for rank(s) {shown}{more}")
        placement = _placement_from_header(header, num_ranks, source, sum(len(ops) for ops in rows.values()))
        if placement.num_ranks != num_ranks:
            raise ScheduleSyntaxError(
                f"{source}: placement has {placement.num_ranks} ranks but the file has {num_ranks} rows"
            )
        max_mb = max((op.microbatch for ops in rows.values() for op in ops), default=-1)
        try:
            num_mb = int(header.get("microbatches", max_mb + 1))
            replicas = tuple(int(x) for x in header["replicas"].split(",")) if "replicas" in header else ()
        except ValueError as exc:
            raise ScheduleSyntaxError(f"{source}: bad header value: {str(exc)[:200]}") from None
        _check_sizes(source, rows, num_mb, placement)
        return cls(
            placement=placement,
            num_microbatches=num_mb,
            ops=tuple(tuple(rows[r]) for r in range(num_ranks)),
            name=header.get("name", Path(source).stem if source != "<csv>" else "custom"),
            microbatch_replicas=replicas,
            overlap_pairs=tuple(tuple(pairs[r]) for r in range(num_ranks)) if any(pairs.values()) else (),
        )

    @classmethod
    def load(cls, path: str | Path) -> Schedule:
        """Read a schedule file of at most :data:`.limits.MAX_FILE_BYTES`, counted while reading (a device
        or pipe reports size 0, ``/dev/zero`` never ends), refusing binary data at the first NUL byte."""
        data = _read_capped(path)
        try:
            text = data.decode("utf-8-sig")  # spreadsheet programs write a byte-order mark first
        except UnicodeDecodeError as exc:
            raise ScheduleSyntaxError(
                f"schedule file {path} is not a text (UTF-8) schedule: binary data at byte {exc.start}"
            ) from None
        return cls.from_csv(text, source=str(path))


_READ_BLOCK = 1 << 16


def _read_capped(path: str | Path) -> bytes:
    """The file's bytes, read block by block: refused at the first NUL byte or past the size limit."""
    blocks: list[bytes] = []
    size = 0
    try:
        with open(path, "rb") as stream:
            while block := stream.read(_READ_BLOCK):
                if b"\0" in block:
                    where = size + block.index(b"\0")
                    raise ScheduleSyntaxError(
                        f"schedule file {path} is not a text (UTF-8) schedule: binary data at byte {where}"
                    )
                size += len(block)
                if size > MAX_FILE_BYTES:
                    raise ScheduleSyntaxError(
                        f"schedule file {path} has more than {MAX_FILE_BYTES} bytes ({MAX_FILE_BYTES >> 20} MiB, "
                        f"{MAX_FILE_BYTES // MAX_OPS} bytes per op of the {MAX_OPS:,}-op limit): not a schedule file"
                    )
                blocks.append(block)
    except OSError as exc:
        raise ScheduleSyntaxError(f"cannot read schedule file {path}: {exc.strerror or exc}") from None
    return b"".join(blocks)


def _check_sizes(source: str, rows: dict[int, list[Op]], num_mb: int, placement: Placement) -> None:
    """Cheap bounds before anything is sized by the file's numbers: a valid schedule has at least one
    op per (stage, micro-batch), so no micro-batch, micro-batch count or stage count can exceed the op
    count (smaller out-of-range numbers, and ops on unknown stages, are left to ``validate``, which
    says more about them and sizes nothing by them)."""
    total = max(sum(len(ops) for ops in rows.values()), 1)
    if not 1 <= num_mb <= total:
        raise ScheduleSyntaxError(
            f"{source}: microbatches={num_mb} out of range: must be 1..{total} (at most the number of ops in the file)"
        )
    if placement.num_stages > total:
        raise ScheduleSyntaxError(
            f"{source}: the placement has {placement.num_stages} stages but the file has only {total} ops"
        )
    for rank, ops in rows.items():
        for op in ops:
            if op.microbatch >= total:
                raise ScheduleSyntaxError(
                    f"{source} (rank {rank}): op {str(op)[:40]} out of range: the file has {total} ops, so no "
                    f"valid schedule in it names a micro-batch >= {total}"
                )


def _placement_from_header(header: dict[str, str], num_ranks: int, source: str, num_ops: int) -> Placement:
    spec = header.get("placement", "loop")
    if "|" in spec:
        return Placement.from_spec(spec)
    try:
        chunks = int(header.get("chunks", "1"))
    except ValueError:
        raise ScheduleSyntaxError(f"{source}: chunks must be an integer, got {header['chunks'][:40]!r}") from None
    if not 1 <= chunks <= max(num_ops, 1):
        limit = max(num_ops, 1)
        raise ScheduleSyntaxError(f"{source}: chunks={chunks} out of range: must be 1..{limit} (the op count)")
    return make_placement(spec, num_ranks, chunks)


def build_schedule(
    name: str,
    placement: Placement,
    num_microbatches: int,
    ops: Sequence[Sequence[Op]],
    microbatch_replicas: Sequence[int] = (),
    **params: object,
) -> Schedule:
    """Convenience constructor used by the generators."""
    return Schedule(
        placement=placement,
        num_microbatches=num_microbatches,
        ops=tuple(tuple(row) for row in ops),
        name=name,
        microbatch_replicas=tuple(microbatch_replicas),
        params=dict(params),
    )
