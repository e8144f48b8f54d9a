"""torch.distributed.pipelining's schedules next to ours, in our validator and simulator.

Imports torch's orders (Schedule1F1B, ScheduleInterleaved1F1B, ScheduleLoopedBFS,
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV, and ScheduleGPipe) from their
own ``pipeline_order``, runs them with our counterparts for p = 4, 8, 16, 32 and m = p, 2p, 3p, 4p under
unit and profiled costs, and writes the tables (and plots) into benchmarks/RESULTS.md. Same as
``megatron-pp bench``: ``megatron_pp_ext/analysis/peers.py`` builds the tables, the command writes them.

    python benchmarks/bench_peers.py   # = megatron-pp bench --write benchmarks/RESULTS.md --plots benchmarks/figures
    python benchmarks/bench_peers.py -p 4,8   # any megatron-pp bench options
"""

from __future__ import annotations

import sys

from megatron_pp_ext.cli import main

if __name__ == "__main__":
    argv = sys.argv[1:] or ["bench", "--write", "benchmarks/RESULTS.md", "--plots", "benchmarks/figures"]
    sys.exit(main(argv if argv[0] == "bench" else ["bench", *argv]))
