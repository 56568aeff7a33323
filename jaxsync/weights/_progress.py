"""The loader's progress bar on stderr (`tqdm`), shown only for loads slow enough to need one."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


clock = time.monotonic  # module-level so tests can drive time
DELAY_S = 2.0  # a load that finishes sooner prints nothing
_FORMAT = "{desc} [{bar:30}] {percentage:3.0f}% {n_fmt}/{total_fmt}, {postfix} {elapsed}"


class Progress:
    """Counts loaded bytes; shows a `tqdm` bar once the load has run for `DELAY_S`.

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
        self.bar: tqdm | None = None

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        self.tensors += 1
        if not self.enabled:
            return
        if self.bar is None:
            if clock() - self.start < DELAY_S:
                return  # started lazily: a fast load never shows a bar
            self.bar = tqdm(
                total=self.total,
                desc="loading weights",
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                bar_format=_FORMAT,
                ascii=" #",
                file=self.stream,
                mininterval=0.1,
            )
            nbytes = self.done  # the bytes read before the bar appeared count too
        self.bar.set_postfix_str(f"{self.tensors} tensors", refresh=False)
        self.bar.update(nbytes)

    def close(self) -> None:
        if self.bar is not None:  # only a bar that was shown is finished (100%, newline)
            self.bar.close()
