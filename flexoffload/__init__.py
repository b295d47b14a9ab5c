"""flexoffload: run a GGUF model whose weights do not fit in the memory you give it.

A patched llama.cpp (see patches/) does the compute; this package reads the GGUF, plans what stays
resident under a memory budget, runs generation and benchmarks, and enforces budgets with cgroups.
"""

__version__ = "0.1.0"


class FlexoffloadError(Exception):
    """An error the user can act on. The CLI prints it as one line and exits non-zero."""


class BudgetTooSmall(FlexoffloadError):
    """A budget below what the run needs: its message names the minimum (serve retries fewer sequences on it)."""
