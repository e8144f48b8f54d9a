"""One module per schedule family; importing this package registers them all."""

from . import (
    baselines,  # noqa: F401
    bfs,  # noqa: F401
    bitpipe,  # noqa: F401
    dualpipev,  # noqa: F401
    interleaved_zb,  # noqa: F401
    vshape,  # noqa: F401
    zbv,  # noqa: F401
    zero_bubble,  # noqa: F401
    zeropp,  # noqa: F401
)
