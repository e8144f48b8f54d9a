"""What ``megatron-pp bench --emulate`` measured, as data: the checked settings, one row of figures per
schedule and the whole outcome, with the names of its section in a results file. Shared by the run
(:mod:`.emulate_bench`) and its report (:mod:`.emulate_report`); imports neither."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BASELINE = "1f1b"  # the schedule every gain is over
P2P_ROUNDS = 50  # round trips timed for the measured p2p time
SECTION = "Emulated compute on real ranks"
COMM_THREAD = "megatron-pp-comm-stream"  # the CPU communication stream's worker (integration/cpu_streams.py)
BLOCK = "emulated"  # the results file's block holding the section; one nested block per (p, m)


@dataclass(frozen=True)
class Settings:
    """Checked ``--emulate`` input."""

    p: int
    m: int
    schedules: tuple[str, ...]
    iterations: int
    warmup: int
    t_f: float
    t_b: float
    t_w: float
    comm_ms: float | None  # None: measured
    a2a_ms: float = 0.0  # one all-to-all of one MoE layer (emulate_a2a.py); 0: none
    moe_layers: int = 0  # MoE layers per 1F1B stage
    # a MoE model at EP = 2, every schedule without and with megatron's all-to-all overlap (emulate_moe.py)
    overlap: bool = False

    @property
    def ranks(self) -> int:
        """Rank processes: ``p``, twice that with the overlap (EP = 2)."""
        return 2 * self.p if self.overlap else self.p

    write: str | None = None
    plots: str | None = None
    command: str = ""


@dataclass
class Row:
    """One schedule's figures (times in ms)."""

    name: str
    v: int
    simulated: float
    overlap: bool = False  # run with megatron's all-to-all overlap (its combined step)
    measured: float = float("nan")
    sim_gain: float = float("nan")
    measured_gain: float = float("nan")
    native: str | None = None
    native_measured: float = float("nan")
    ours_vs_native: float = float("nan")  # median over iterations of ours / megatron's
    ranks: list[dict[str, Any]] = field(default_factory=list)  # per rank: median breakdown (ms)
    ops: int = 0  # padded ops traced (all ranks, timed iterations)
    short_ops: int = 0  # ops that ended before their pad (must be 0)
    over_pad: int = 0  # ops whose real compute exceeded their pad
    real_ms: dict[str, tuple[float, float]] = field(default_factory=dict)  # per kind: real compute, median and max
    native_ops: int = 0
    native_short_ops: int = 0
    native_over_pad: int = 0
    native_real_ms: dict[str, tuple[float, float]] = field(default_factory=dict)
    # padded all-to-alls of the timed and warm-up iterations, all ranks: (on the communication-stream worker, all)
    a2a_on_worker: tuple[int, int] = (0, 0)
    # simulated again with the hop time the baseline's run paid (Outcome.paid_hop_ms)
    simulated_paid_hop: float = float("nan")
    # ... and with the host time this run paid per op and per sending op (none with the overlap: a pair's nodes
    # are timed as host time there)
    simulated_host: float = float("nan")

    @property
    def label(self) -> str:
        """The schedule's name in a table, marked when the overlap is on."""
        return f"{self.name} + overlap" if self.overlap else self.name

    @property
    def ratio(self) -> float:
        return self.measured / self.simulated if self.simulated > 0 else float("nan")

    @property
    def ratio_paid_hop(self) -> float:
        return self.measured / self.simulated_paid_hop if self.simulated_paid_hop > 0 else float("nan")

    @property
    def ratio_host(self) -> float:
        return self.measured / self.simulated_host if self.simulated_host > 0 else float("nan")


@dataclass
class Outcome:
    settings: Settings
    comm_ms: float
    comm_fastest_ms: float | None  # measured: the fastest of the round trips, halved
    rows: list[Row]
    skipped: dict[str, str]
    load: tuple[float, float]  # 1-minute load average at start and end
    seconds: float
    paid_hop_ms: tuple[float, int] | None = None  # the baseline run's hop: median ms, messages timed
