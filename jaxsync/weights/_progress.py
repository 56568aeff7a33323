"""A one-line progress bar on stderr for slow loads (no dependency; silent for fast ones)."""

from __future__ import annotations

import sys
import time


clock = time.monotonic  # module-level so tests can drive time
DELAY_S = 2.0  # a load that finishes sooner prints nothing
_REDRAW_S = 0.1
_WIDTH = 30


class Progress:
    """Counts loaded bytes; draws `\\r`-updated lines once the load has run for `DELAY_S`.

    Args:
      total: bytes the load will read.
      enabled: True draws, False never draws, None draws only when stderr is a terminal.
    """

    def __init__(self, total: int, enabled: bool | None):
        self.stream = sys.stderr
        isatty = getattr(self.stream, "isatty", lambda: False)
        self.enabled = isatty() if enabled is None else enabled
        self.total, self.done, self.tensors = max(total, 1), 0, 0
        self.start = clock()
        self.drawn_at: float | None = None

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        self.tensors += 1
        now = clock()
        if not self.enabled or now - self.start < DELAY_S:
            return
        if self.drawn_at is None or now - self.drawn_at >= _REDRAW_S:
            self._draw(now)

    def close(self) -> None:
        if self.drawn_at is not None:  # only a bar that was shown is finished (100%, newline)
            self._draw(clock())
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, now: float) -> None:
        self.drawn_at = now
        frac = self.done / self.total
        bar = "#" * int(frac * _WIDTH) + "-" * (_WIDTH - int(frac * _WIDTH))
        self.stream.write(
            f"\rloading weights [{bar}] {frac:4.0%} {self.done / 2**20:,.0f}/"
            f"{self.total / 2**20:,.0f} MiB, {self.tensors} tensors, {now - self.start:.1f} s"
        )
        self.stream.flush()
