"""The module a warm rank pool of the test suite forks its workers after (``tests/warm_rank.py``, which sets up a CPU
rank when imported, so it is named here rather than imported)."""

WARM_MODULE = "tests.warm_rank"
