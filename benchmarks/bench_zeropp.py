"""ZeroPP: simulated iteration time, bubble, exposed FSDP time, gathers and memory of ``zeropp``
vs ``bfs``, ``bfs-zb``, ``1f1b`` and ``zb-h1`` with FSDP, for a GPT preset on 8-32 GPUs; U swept.

Cost assumptions (all from megatron_pp_ext.planner, no measurement):

* model ``zb-6.2b`` (30 layers, hidden 4096, seq 1024), micro-batch 1, bf16, A100-80GB preset, TP = 1;
  per-layer ``T_F, T_B, T_W`` from :class:`~megatron_pp_ext.planner.cost_model.CostModel` (ms); a stage of
  ``L / (p v)`` layers costs that many layers (fractional layers allowed: an idealisation that ignores
  the embedding and output layer, which the planner would place on the first and last stage);
  ``t_comm`` = the planner's p2p hop time.
* FSDP over ``dp`` ranks per stage across nodes (a pipeline packed into a node, its data-parallel peers on
  other nodes): the network's ``inter_gbps`` per GPU; a chunk's all-gather and gradient reduce-scatter move
  its bf16 parameters (``L/(p v)`` layers x 201M parameters x 2 bytes).
  ``zeropp`` reduce-scatters each chunk's gradients once per scheduling unit (its declared policy:
  ``v ceil(m/U)`` per rank and iteration, column "reduce-scatters / iter"), the others once per chunk.
* memory (worst rank) = peak live activations from the simulator (``layer_activation_bytes`` per layer and
  micro-batch, an activation held from F until its W) + the FSDP chunks gathered at once (the schedule's
  declared limit x one chunk's bf16 parameters). The sharded parameter, gradient and optimizer state
  (1/dp of the rank's) is the same for every schedule and left out.

    PYTHONPATH=. python benchmarks/bench_zeropp.py

``--planner``: the same comparison through the planner instead (``plan``'s cost model for every stage,
embedding and output layer included, FSDP as a candidate axis with its memory, zeropp's U as an axis,
replicated rows with the distributed optimizer) and ``auto``'s pick:

    PYTHONPATH=. python benchmarks/bench_zeropp.py --planner
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_pp_ext.analysis.zeropp_auto import choose_unit_size, measure_schedule
from megatron_pp_ext.planner import Planner, PlanRow, SearchSpace
from megatron_pp_ext.planner.auto import decide
from megatron_pp_ext.planner.cost_model import CostModel, get_device
from megatron_pp_ext.planner.memory import GIB, TrainingSetup, layer_activation_bytes, parameter_counts
from megatron_pp_ext.planner.models import get_model
from megatron_pp_ext.planner.plan_report import row_label
from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.costs import Costs
from megatron_pp_ext.schedules.schedule import Schedule

MODEL, DEVICE, MICRO_BATCH = "zb-6.2b", "A100-80GB", 1
SETTINGS = ((4, 2, 16), (8, 2, 32), (8, 4, 32))  # (p, dp, m): 8, 16 and 32 GPUs


@dataclass
class Row:
    name: str
    v: int
    unit: str
    time: float
    bubble: float
    exposed: float
    gathers: int
    reduces: int  # gradient reduce-scatters per iteration, worst rank (zeropp: per chunk and unit)
    memory: float  # GB


class Setting:
    def __init__(self, p: int, dp: int, m: int) -> None:
        model = get_model(MODEL)
        device = get_device(DEVICE)
        setup = TrainingSetup()
        cost = CostModel(model, device, setup)
        self.p, self.dp, self.m = p, dp, m
        self.layer = cost.layer_times(MICRO_BATCH, 1, "none")  # seconds
        self.t_comm = cost.p2p_time(MICRO_BATCH, 1, p, dp) * 1e3
        self.layers = model.num_layers
        self.layer_params = parameter_counts(model).layer
        self.layer_act = layer_activation_bytes(model, MICRO_BATCH, 1, setup)
        self.bandwidth = device.inter_gbps * 1e6  # bytes per ms

    def costs(self, v: int) -> Costs:
        per = self.layers / (self.p * v) * 1e3  # ms per layer-second x layers per stage
        return Costs(self.layer.f * per, self.layer.b * per, self.layer.w * per, None, self.t_comm)

    def chunk_bytes(self, v: int) -> float:
        return self.layers / (self.p * v) * self.layer_params * 2

    def run(self, schedule: Schedule, label: str) -> Row:
        v = schedule.chunks_per_rank
        got = measure_schedule(
            schedule,
            self.costs(v),
            dp=self.dp,
            dp_bandwidth=self.bandwidth,
            param_bytes=self.chunk_bytes(v),
            fsdp=True,
            activation_bytes=self.layers / (self.p * v) * self.layer_act,
        )
        assert got.memory_bytes is not None
        return Row(
            schedule.name,
            v,
            label,
            got.iteration_time,
            got.bubble,
            got.exposed,
            got.gathers,
            got.reductions,
            got.memory_bytes / 1e9,
        )


def table(setting: Setting, rows: list[Row], base: dict[str, Row]) -> None:
    print(
        "| schedule | v | U | iteration (ms) | vs 1f1b | vs best bfs | bubble (compute) | exposed FSDP (ms) "
        "| gathers / iter | reduce-scatters / iter | memory (GB) | <= 1f1b memory |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r.name} | {r.v} | {r.unit} | {r.time:.1f} | {base['1f1b'].time / r.time:.2f}x | "
            f"{base['bfs'].time / r.time:.2f}x | {r.bubble:.3f} | {r.exposed:.1f} | {r.gathers} | {r.reduces} | "
            f"{r.memory:.1f} | "
            f"{'yes' if r.memory <= base['1f1b'].memory + 1e-9 else 'no'} |"
        )


def main() -> None:
    print(f"model {MODEL}, micro-batch {MICRO_BATCH}, {DEVICE}, FSDP over the network; see the module doc\n")
    for p, dp, m in SETTINGS:
        s = Setting(p, dp, m)
        print(
            f"\n#### p={p} x dp={dp} = {p * dp} GPUs, m={m}, t_comm={s.t_comm:.3f} ms, "
            f"layer F/B/W = {s.layer.f * 1e3:.2f}/{s.layer.b * 1e3:.2f}/{s.layer.w * 1e3:.2f} ms\n"
        )
        rows = [s.run(generate("1f1b", p, m), "-"), s.run(generate("zb-h1", p, m), "-")]
        for v in (2, 4):
            rows += [s.run(generate("bfs", p, m, v=v), "m"), s.run(generate("bfs-zb", p, m, v=v), "m")]
        base = {"1f1b": rows[0], "bfs": min((r for r in rows if r.name.startswith("bfs")), key=lambda r: r.time)}
        sweep, capped = [], []
        for v in (2, 4):
            for unit in [u for u in range(1, m + 1) if m % u == 0]:
                sweep.append(s.run(generate("zeropp", p, m, v=v, unit_size=unit, costs=s.costs(v)), str(unit)))
        for v in (2, 4):  # activations capped at 1F1B's (p M_a): a unit of U needs U M_a
            for unit in [u for u in range(1, p + 1) if m % u == 0]:
                schedule = generate("zeropp", p, m, v=v, unit_size=unit, costs=s.costs(v), memory_limit=p)
                capped.append(s.run(schedule, f"{unit}, act <= p"))
        table(s, rows + sweep + capped, base)
        for v in (2, 4):  # auto: memory budget = 1F1B's, FSDP costs
            auto_line(s, p, m, v, sweep + capped, base)


def auto_line(s: Setting, p: int, m: int, v: int, rows: list[Row], base: dict[str, Row]) -> None:
    """``unit_size="auto"`` under 1F1B's memory, and whether its pick is on the time/memory frontier."""
    choice = choose_unit_size(
        p,
        m,
        v=v,
        costs=s.costs(v),
        dp=s.dp,
        dp_bandwidth=s.bandwidth,
        param_bytes=s.chunk_bytes(v),
        fsdp=True,
        activation_bytes=s.layers / (p * v) * s.layer_act,
        memory_budget=base["1f1b"].memory * 1e9,
    )
    best = choice.best
    points = [(r.unit, r.time, r.memory) for r in rows if r.v == v]
    points += [(f"{c.unit_size} (auto cap)", c.iteration_time, (c.memory_bytes or 0) / 1e9) for c in choice.candidates]
    frontier = [pt for pt in points if not any(o[1] < pt[1] and o[2] <= pt[2] for o in points if o is not pt)]
    on = any(pt[0] == f"{best.unit_size} (auto cap)" for pt in frontier)
    print(
        f"\nauto (v={v}, memory budget = 1f1b's {base['1f1b'].memory:.1f} GB): U={best.unit_size}, "
        f"{best.iteration_time:.1f} ms ({base['1f1b'].time / best.iteration_time:.2f}x 1f1b), "
        f"{(best.memory_bytes or 0) / 1e9:.2f} GB. Time/memory frontier of every v={v} zeropp point above and "
        "auto's candidates: "
        + ", ".join(f"U={u} ({t:.1f} ms, {mem:.2f} GB)" for u, t, mem in sorted(frontier, key=lambda x: x[1]))
        + f"; auto's pick on the frontier: {'yes' if on else 'no'}"
    )
    print("\n```\n" + choice.table() + "\n```")


# ---- the planner's view (--planner): FSDP and U as candidate axes ---------------------------------------
PLANNER_SETTINGS = ((4, 2, 16), (8, 2, 32), (8, 4, 32))  # (p, dp, m) at micro-batch 1: 8, 16, 32 GPUs
PLANNER_SCHEDULES = ("1f1b", "zb-h1", "bfs", "bfs-zb", "zeropp")


def _planner(p: int, dp: int, m: int, budget_bytes: float | None = None) -> Planner:
    model = get_model(MODEL).with_overrides(untie_embeddings_and_output_weights=True)  # --pipeline-fsdp's rule
    cost = CostModel(model, get_device(DEVICE), TrainingSetup(distributed_optimizer=True))
    space = SearchSpace(
        tp=(1,), pp=(p,), micro_batch=(MICRO_BATCH,), recompute=("none",), virtual=(1, 2, 4),
        schedules=PLANNER_SCHEDULES, fsdp=(False, True), memory_limits=("p",),
    )  # fmt: skip
    planner = Planner(model, p * dp, dp * m * MICRO_BATCH, cost, space=space)
    if budget_bytes is not None:
        planner.budget_bytes = budget_bytes
    return planner


def _label(row: PlanRow) -> str:
    return row_label(row.config) + (" +fsdp" if row.config.fsdp else "")


def _frontier(rows: list[PlanRow]) -> set[str]:
    """Ids of the rows no other row beats in iteration time at no more memory."""
    return {
        r.config.id
        for r in rows
        if not any(o.iteration_time < r.iteration_time and o.peak_memory <= r.peak_memory for o in rows if o is not r)
    }


def planner_tables() -> None:
    print(f"model {MODEL} (untied embeddings), micro-batch {MICRO_BATCH}, {DEVICE}, bf16, distributed optimizer for "
          "replicated rows; FSDP rows shard parameters, gradients and optimizer state (--pipeline-fsdp)")  # fmt: skip
    for p, dp, m in PLANNER_SETTINGS:
        result = _planner(p, dp, m).run(progress=False)
        rows = result.rows
        frontier = _frontier(rows)
        best: dict[tuple[str, bool], PlanRow] = {}
        for r in rows:  # best per schedule and FSDP setting (over v, memory limit, U)
            best.setdefault((r.config.schedule, r.config.fsdp), r)
        base = best[("1f1b", False)]
        print(f"\n#### p={p} x dp={dp} = {p * dp} GPUs, m={m}, {len(rows)} candidates\n")
        print("| schedule | v | fsdp | iteration (ms) | vs 1f1b | bubble | exposed DP (ms) | gathers / iter | "
              "peak GiB | <= 1f1b memory | on frontier |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in sorted(best.values(), key=lambda r: r.iteration_time):
            c = r.config
            print(
                f"| {row_label(c)} | {c.chunks} | {'yes' if c.fsdp else 'no'} | {r.iteration_time * 1e3:.1f} | "
                f"{base.iteration_time / r.iteration_time:.3f}x | {r.sync_bubble_rate:.3f} | {r.dp_time * 1e3:.2f} | "
                f"{r.gathers if c.fsdp else '-'} | {r.peak_memory / GIB:.1f} | "
                f"{'yes' if r.peak_memory <= base.peak_memory else 'no'} | {'yes' if c.id in frontier else 'no'} |"
            )
        for ref in ("1f1b", "zb-h1", "bfs"):  # each schedule's best row at no more memory than ref's best
            limit = best[(ref, False)].peak_memory
            at = [r for r in rows if r.peak_memory <= limit]
            print(f"\nAt no more memory than {ref}'s best ({limit / GIB:.1f} GiB): "
                  + "; ".join(f"{sched}: {_best_of(at, sched)}" for sched in PLANNER_SCHEDULES))  # fmt: skip
        zrows = [r for r in rows if r.config.schedule == "zeropp" and r.config.fsdp and not r.config.memory_limit]
        for v in sorted({r.config.chunks for r in zrows}):
            print(
                f"\nzeropp +fsdp, v={v}, U swept (frontier = no candidate of this plan is faster at no more memory):\n"
            )
            print("| U | iteration (ms) | bubble | exposed DP (ms) | gathers / iter | activations GiB | peak GiB | "
                  "on frontier |")  # fmt: skip
            print("|---|---|---|---|---|---|---|---|")
            for r in sorted((r for r in zrows if r.config.chunks == v), key=lambda r: r.config.unit_size or 0):
                print(
                    f"| {r.config.unit_size} | {r.iteration_time * 1e3:.1f} | {r.sync_bubble_rate:.3f} | "
                    f"{r.dp_time * 1e3:.2f} | {r.gathers} | {max(x.activations for x in r.memory) / GIB:.2f} | "
                    f"{r.peak_memory / GIB:.2f} | {'yes' if r.config.id in frontier else 'no'} |"
                )
        for budget, what in ((None, "the device's"), (base.peak_memory, "1f1b's best")):
            decision = decide(_planner(p, dp, m, budget))
            chosen = decision.chosen
            if chosen is None:
                print(f"\nauto under {what} memory: nothing fits")
                continue
            print(
                f"\nauto under {what} memory ({decision.result.budget_bytes / GIB:.1f} GiB; every registered schedule, "
                f"FSDP on/off, every U): {_label(chosen)} v={chosen.config.chunks}, "
                f"{chosen.iteration_time * 1e3:.1f} ms, {chosen.peak_memory / GIB:.1f} GiB; on the frontier of "
                f"its own candidates: {'yes' if chosen.config.id in _frontier(decision.result.rows) else 'no'}\n"
            )
            table = [line for line in decision.table().splitlines() if not line.startswith("  dropped")]
            print("```\n" + "\n".join(table) + "\n```")  # (why the other schedules were dropped: left out)


def _best_of(rows: list[PlanRow], schedule: str) -> str:
    mine = [r for r in rows if r.config.schedule == schedule]
    if not mine:
        return "none fits"
    r = mine[0]
    return f"{_label(r)} v={r.config.chunks} {r.iteration_time * 1e3:.1f} ms ({r.peak_memory / GIB:.1f} GiB)"


if __name__ == "__main__":
    import sys

    planner_tables() if "--planner" in sys.argv[1:] else main()
