"""What the fork server of the test suite's warm rank pools (``RankPool(n, warm_module=WARM_MODULE)``) does
once, on import.

A spawned pool worker pays for its imports (torch, megatron-core, this package: seconds of CPU each) at its
first run, and a pool of ``p`` workers pays ``p`` times. A warm pool's workers are forked from one process
that imported this module: it sets a rank up for the CPU as every CPU run does first
(``verification/rank_setup.py``'s ``prepare_device``: megatron's CPU shims, which cannot be undone) and
imports what such a run imports. A worker forked from it is in the state a spawned worker is in after its
first CPU run; its runs build their own process groups, models and optimizers as before.

No thread is started here (a forked child keeps only the forking thread): the imports and the shims start
none, and torch's intra-op pool is set to one thread without being started.
"""

from __future__ import annotations

import gc


def preload() -> None:
    """The CPU set-up and the imports of a verification run (idempotent)."""
    from megatron_pp_ext.verification.rank_setup import prepare_device

    prepare_device("cpu")
    import megatron.core.distributed
    import megatron.core.models.gpt
    import megatron.core.models.gpt.gpt_layer_specs
    import megatron.core.optimizer
    import megatron.core.parallel_state
    import megatron.core.pipeline_parallel
    import megatron.core.tensor_parallel.cross_entropy  # noqa: F401

    from megatron_pp_ext.runtime import executor, fsdp, replica_sync, te_wgrad, trace, wgrad_hooks  # noqa: F401
    from megatron_pp_ext.verification import breaks, host_staging, rank_run, tiny_gpt  # noqa: F401

    # What the imports made lives as long as the workers: out of the cycle collector's way (each run's teardown
    # collects, and looks through the live objects for modules: rank_setup.release_autograd_graphs).
    gc.freeze()


preload()
