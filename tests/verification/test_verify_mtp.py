"""Multi-token prediction on real gloo ranks: megatron's MTP layers with the loss on the model's last stage
(rank 1 under 1F1B, rank 0 under a V placement) match the unpartitioned reference in losses and every gradient,
the MTP layers' and the embedding copy's included, and ours equals megatron's own 1F1B bit for bit."""

from __future__ import annotations

from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.layer_split import LayerSplit
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec
from megatron_pp_ext.verification.verify import verify_schedule


def _verify(pool, name: str, model: TinyGPTSpec):
    report = verify_schedule(generate(name, 2, 4), pool, model=model, iterations=1)
    assert report.problems == []
    assert report.ok, report
    return report


def test_1f1b_with_mtp_equals_megatrons_own_1f1b(pool) -> None:
    report = _verify(pool, "1f1b", TinyGPTSpec(num_layers=2, mtp_num_layers=1))
    assert report.bitwise_megatron_1f1b is True


def test_v_placement_keeps_mtp_with_the_loss_on_rank_0(pool) -> None:
    # untied embeddings: only the MTP layers' embedding copy ties rank 0's two chunks; a layout string with m
    split = LayerSplit.from_layout("Ett|t|t|tmL")
    _verify(pool, "v-zb", TinyGPTSpec(num_layers=5, mtp_num_layers=1, tied_embeddings=False, split=split))
