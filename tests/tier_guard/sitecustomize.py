"""Python runs this at start-up in child interpreters of a guarded test (its folder is put first on their
``PYTHONPATH``): the guard of ``rank_guard.py`` holds in the child too. Does nothing without the guard's variable."""

import rank_guard

rank_guard.install_from_env()
