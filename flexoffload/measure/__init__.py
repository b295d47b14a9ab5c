"""What is measured on this machine: disk and compute, operators, sensitivity, tuning, and the plans that need it.

A measurement that takes more than a few seconds says so before it starts, through the `flexoffload` logger (the
CLI prints its INFO records on stderr): what it measures, about how long here, that it is cached (and resumed where
it was interrupted), and how to do it ahead of time. Long ones say how far they are as they go.
"""


def about(seconds: float) -> str:
    """A duration as a user reads an estimate: about 40 s, about 3 min, about 2.5 h."""
    if seconds < 90:
        return f"about {max(seconds, 1):.0f} s"
    if seconds < 90 * 60:
        return f"about {seconds / 60:.0f} min"
    return f"about {seconds / 3600:.1f} h"
