"""The two model copies of a bidirectional placement (BitPipe) under megatron's own training loop.

Under the ``bidirectional`` placement every model slice exists twice: the down replica's copy on
rank ``r`` and the up replica's copy on the mirror rank ``p-1-r``
(:mod:`megatron_pp_ext.runtime.replica_sync`). Megatron knows nothing of this; :func:`activate`
(called by :func:`megatron_pp_ext.install`) makes its training loop treat them as one model:

* **one replica group per mirror pair**, created right after megatron's own process groups
  (every rank takes part, in the same order);
* **same start**: after megatron builds the chunks, each up copy receives its down twin's
  weights (megatron seeds every pipeline rank differently, so the copies are built different);
* **same steps**: the executor runs the schedule's ``replica-sync`` collectives (the two copies'
  gradients summed) through :class:`ReplicaSyncForMegatron`; the up copies' parameters are marked
  ``shared`` (megatron's flag for a parameter that has another copy) so megatron's gradient norm
  and clipping count each weight once, as under any other schedule;
* **saved once**: in a distributed checkpoint (``--ckpt-format torch_dist``) the up copy maps to
  the same keys as the down copy, marked as a non-main replica: megatron writes the down copy
  only, and on load both copies read the same entries. Such a checkpoint has exactly the keys of
  one model, so it loads under any schedule (``1f1b`` included) and a ``1f1b`` checkpoint loads
  into both copies. (Megatron's per-rank ``torch`` format stores each rank's chunks as they are
  and only resumes under the same placement, for any non-loop schedule.)
"""

from __future__ import annotations

from typing import Any

from ..schedules.placement import Placement
from ._patching import Patcher

_STATE: dict[str, Any] = {}  # "placement", "group", "models"
MARK = "_megatron_pp_ext_up_copy"


def _unwrap(module: Any) -> Any:
    while hasattr(module, "module"):  # DDP, Float16Module
        module = module.module
    return module


def as_non_main_replica(state: Any) -> Any:
    """Mark every sharded entry of a (nested) sharded state dict as a non-main replica, in place."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    if isinstance(state, ShardedBase):
        rid = state.replica_id
        state.replica_id = rid + 1 if isinstance(rid, int) else (rid[0] + 1, *rid[1:])
    elif isinstance(state, dict):
        for value in state.values():
            as_non_main_replica(value)
    elif isinstance(state, list | tuple):
        for value in state:
            as_non_main_replica(value)
    return state


def _save_as_down_copy(module: Any) -> None:
    """Make ``module`` (an up copy) describe itself to dist checkpointing as a replica of its down twin."""
    if getattr(module, MARK, False):
        return
    original = module.sharded_state_dict

    def sharded_state_dict(*args: Any, **kwargs: Any) -> Any:
        return as_non_main_replica(original(*args, **kwargs))

    module.sharded_state_dict = sharded_state_dict
    setattr(module, MARK, True)


def prepare_copies(model: Any) -> None:
    """After megatron built this rank's chunks: give up copies their down twins' weights, mark them."""
    from megatron.core import parallel_state

    from ..runtime.replica_sync import copy_down_to_up

    placement: Placement | None = _STATE.get("placement")
    group = _STATE.get("group")
    if placement is None or group is None:
        return
    chunks = model if isinstance(model, list) else [model]
    rank = int(parallel_state.get_pipeline_model_parallel_rank())
    if len(chunks) != len(placement.stages_on_rank(rank)):
        return  # not the training model (e.g. one chunk built for inference)
    import torch

    with torch.no_grad():
        copy_down_to_up(placement, rank, chunks, group)
    for chunk, stage in zip(chunks, placement.stages_on_rank(rank), strict=True):
        if placement.replica_of(stage) == 1:
            for param in chunk.parameters():
                param.shared = True  # megatron's grad norm counts the down copy only
            _save_as_down_copy(_unwrap(chunk))
    _STATE["models"] = chunks


class ReplicaSyncForMegatron:
    """The executor's ``replica_sync`` for megatron's chunks: a :class:`~..runtime.replica_sync.ReplicaSync`
    over the chunks :func:`prepare_copies` saw, built at first use."""

    def __init__(self) -> None:
        self._sync: Any = None

    def _get(self) -> Any:
        if self._sync is None:
            from ..runtime.replica_sync import ReplicaSync

            if "models" not in _STATE or _STATE.get("group") is None:
                raise RuntimeError("bidirectional placement: the model was not built through megatron's builders")
            self._sync = ReplicaSync(_STATE["models"], _STATE["group"])
        return self._sync

    def launch(self, chunk: int) -> None:
        self._get().launch(chunk)

    def finish_chunk(self, chunk: int) -> None:
        self._get().finish_chunk(chunk)

    def finish(self) -> None:
        self._get().finish()


def _make_group(_: Any) -> None:
    from megatron.core import parallel_state

    from ..runtime.replica_sync import new_replica_group

    _STATE["group"] = new_replica_group(parallel_state.get_pipeline_model_parallel_group())


BUILDERS = (
    ("megatron.training.models.dist_utils", "build_virtual_pipeline_stages"),  # config-container path
    ("megatron.training.training", "get_model"),  # model_provider path
)


def activate(placement: Placement, patcher: Patcher) -> None:
    """Hook megatron for a two-replica placement (undone by ``patcher.restore()``)."""
    _STATE.clear()
    _STATE["placement"] = placement
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():  # install() after megatron's groups exist
        _make_group(None)
    else:
        patcher.call_after("megatron.core.parallel_state", "initialize_model_parallel", _make_group)
    for module, attr in BUILDERS:
        try:
            patcher.call_after(module, attr, prepare_copies)
        except ImportError:
            pass
    patcher.on_restore(_STATE.clear)
