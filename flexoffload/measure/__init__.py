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


class Progress:
    """A long measurement's progress lines on `log`: how far it is, and the time to go extrapolated from the work
    done so far (an estimate from this machine and this model, whatever its size), at most one line a tenth."""

    def __init__(self, log, what: str, total: float, unit: str):
        import time

        self.log, self.what, self.total, self.unit = log, what, total, unit
        self.t0, self.shown = time.perf_counter(), 0

    def __call__(self, done: float) -> None:
        import time

        tenth = int(done * 10 // max(self.total, 1e-9))
        if tenth <= self.shown or done <= 0:
            return
        self.shown = tenth
        elapsed = time.perf_counter() - self.t0
        rest = elapsed / done * (self.total - done)
        self.log.info("%s: %d of %d %s in %.0f s%s", self.what, done, self.total, self.unit, elapsed,
                      f", {about(rest)} to go" if done < self.total else "")
