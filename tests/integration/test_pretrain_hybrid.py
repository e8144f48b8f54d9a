"""End to end: scripts/pretrain_hybrid.py (megatron's training loop, a HybridModel) at PP=2 on CPU.

* ``--pipeline-schedule zb-h1`` against megatron's own 1F1B on the same pattern (the same placement, so the
  same initial weights and data): the first iteration's losses bit for bit (same weights, same forward), the
  later ones within the rounding of the split backward's reassociated weight-gradient sums;
* ``scripts/pretrain_gpt.py`` (megatron's deprecated GPTModel) still trains beside them;
* ``--pipeline-schedule v-zb``: each chunk holds the layer types of its model stage's segment (rank 0 the
  first and the last), read back from the trained weights.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from test_megatron_pretrain import FLAGS, ITERS, ROOT, results
from warm_launch import launch as warm_launch
from warm_launch import run_env

from megatron_pp_ext.runtime.hybrid_pattern import chunk_layer_types, hybrid_layer_split
from megatron_pp_ext.runtime.layer_map import chunk_layouts
from megatron_pp_ext.schedules.placement import v_placement

SCRIPTS = ROOT / "scripts"
PATTERN = "*-|-*"
V_PATTERN = "*-|-*|*E|-"
GPT_ONLY = ("--num-layers", "4")  # the hybrid runs take their layer count from the pattern


def _flags(extra: list[str]) -> list[str]:
    flags = list(FLAGS)
    i = flags.index(GPT_ONLY[0])
    return [*flags[:i], *flags[i + 2 :], *extra]


def launch(
    tmp: Path, name: str, script: str, flags: list[str], env_extra: dict[str, str] | None = None, torchrun: bool = False
):
    """``scripts/SCRIPT FLAGS`` on 2 ranks (the warm launcher; ``torchrun``: real torchrun), its exact losses in
    ``tmp/NAME.rank*``."""
    env = run_env(MEGATRON_PP_EXT_LOSS_FILE=str(tmp / name), **(env_extra or {}))
    return warm_launch(tmp, name, flags, env=env, script=SCRIPTS / script, torchrun=torchrun)


def wait_all(runs: dict) -> None:
    for name, (proc, log) in runs.items():
        try:
            code = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        assert code == 0, f"{name} run failed:\n{log.read_text()[-4000:]}"


@pytest.mark.gloo
def test_zb_h1_hybrid_matches_megatrons_1f1b_and_gpt_still_trains(tmp_path: Path) -> None:
    hybrid = ["--hybrid-layer-pattern", PATTERN]
    runs = {
        "megatron": launch(tmp_path, "megatron", "pretrain_hybrid.py", _flags(hybrid)),
        "zbh1": launch(tmp_path, "zbh1", "pretrain_hybrid.py", _flags([*hybrid, "--pipeline-schedule", "zb-h1"])),
        "gpt": launch(tmp_path, "gpt", "pretrain_gpt.py", [*FLAGS, "--pipeline-schedule", "zb-h1"]),
    }
    wait_all(runs)
    logged_m, losses_m = results(tmp_path, "megatron", runs["megatron"][1])
    _, losses_z = results(tmp_path, "zbh1", runs["zbh1"][1])
    _, losses_g = results(tmp_path, "gpt", runs["gpt"][1])
    assert [int(x[0]) for x in logged_m] == list(range(1, ITERS + 1))
    assert "HybridModel: pp_rank=1/2, vp_stage=0, segment_index=1/2" in runs["megatron"][1].read_text()
    assert "pipeline schedule 'zb-h1' replaces megatron's" in runs["zbh1"][1].read_text()
    per_iteration = len(losses_m) // ITERS
    assert len(losses_z) == len(losses_m) == len(losses_g) == ITERS * per_iteration
    assert losses_z[:per_iteration] == losses_m[:per_iteration]  # same weights: the same forward, bit for bit
    # Later iterations: B and W split reassociate the weight-gradient sums (last bits of the update); a wrong
    # schedule (a dropped or doubled gradient) moves the losses by O(lr) = 1e-3 relative, far beyond this.
    rounding = 64 * torch.finfo(torch.float32).eps
    for z, m in zip(losses_z, losses_m, strict=True):
        assert abs(float.fromhex(z) - float.fromhex(m)) <= rounding * abs(float.fromhex(m))
    values = [float.fromhex(x) for x in losses_g]
    assert all(v == v and abs(v) < float("inf") for v in values)  # the GPTModel path trains
    assert "GPTModel IS DEPRECATED" in runs["gpt"][1].read_text()  # megatron's warning, and it still trains
    assert "GPTModel IS DEPRECATED" not in runs["zbh1"][1].read_text()


@pytest.mark.gloo
def test_v_zb_chunks_hold_their_stages_segments(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    extra = ["--hybrid-layer-pattern", V_PATTERN, "--pipeline-schedule", "v-zb"]
    extra += ["--num-experts", "2", "--disable-bias-linear"]
    runs = {
        "vzb": launch(
            tmp_path, "vzb", "pretrain_hybrid.py", _flags(extra), {"MEGATRON_PP_EXT_WEIGHTS_FILE": str(weights)}
        )
    }
    wait_all(runs)
    placement = v_placement(2)
    split = hybrid_layer_split(V_PATTERN, placement, "v-zb")
    layers = len(V_PATTERN.replace("|", ""))
    for rank in range(2):
        names = list(torch.load(f"{weights}.rank{rank}"))
        for layout in chunk_layouts(placement, layers, rank, split):
            expected = chunk_layer_types(V_PATTERN, layout)
            assert _layer_types(names, layout.chunk) == expected, (rank, layout)


def _layer_types(names: list[str], chunk: int) -> list[str]:
    """The layer symbols of one chunk, read from its parameter names (``<chunk>.…decoder.layers.<i>.…``)."""
    kinds: dict[int, str] = {}
    for name in names:
        head, _, rest = name.partition(".")
        if int(head) != chunk or "decoder.layers." not in rest:
            continue
        index, _, sub = rest.split("decoder.layers.", 1)[1].partition(".")
        kind = "*" if sub.startswith(("self_attention", "input_layernorm")) else "E" if ".experts." in sub else "-"
        kinds[int(index)] = "E" if kinds.get(int(index)) == "E" else kind
    return [kinds[i] for i in sorted(kinds)]


@pytest.mark.gloo
def test_pattern_that_does_not_fit_stops_with_one_line(tmp_path: Path) -> None:
    """Two segments for v-zb's four stages: one line from rank 0, exit status 2, no megatron traceback."""
    extra = ["--hybrid-layer-pattern", PATTERN, "--pipeline-schedule", "v-zb"]
    proc, log = launch(tmp_path, "bad", "pretrain_hybrid.py", _flags(extra), torchrun=True)  # its exit status
    assert proc.wait(timeout=300) != 0
    text = log.read_text()
    errors = [line for line in text.splitlines() if "pretrain_hybrid.py: error:" in line]
    assert errors == [
        "pretrain_hybrid.py: error: argument --hybrid-layer-pattern: '*-|-*' has 2 segments; v-zb with p=2 "
        "needs 4 (2 per rank)"
    ], text[-3000:]
    assert "exitcode  : 2" in text and "initialize_model_parallel" not in text
    assert not any(line.startswith("[rank") and "Traceback" in line for line in text.splitlines()), text[-3000:]
