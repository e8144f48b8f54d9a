"""``python -m megatron_pp_ext.cli``: the same as the ``megatron-pp`` command."""

import sys

from .main import main

if __name__ == "__main__":
    sys.exit(main())
