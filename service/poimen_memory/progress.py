"""Progress for long work: a tqdm bar on a terminal, plain periodic lines otherwise."""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TextIO

from tqdm import tqdm


class Progress:
    def __init__(
        self,
        total: int,
        desc: str,
        unit: str = "it",
        *,
        stream: TextIO | None = None,
        every_s: float = 5.0,
        enabled: bool = True,
    ) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.stream = stream or sys.stderr
        self.every_s = every_s
        self.enabled = enabled
        self.done = 0
        self._start = time.monotonic()
        self._last = self._start
        self._bar: tqdm[object] | None = None
        if enabled and self.stream.isatty():
            self._bar = tqdm(
                total=total, desc=desc, unit=unit, file=self.stream, dynamic_ncols=True
            )

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if self.enabled and now - self._last >= self.every_s:
            self._last = now
            self._line(now)

    def _line(self, now: float) -> None:
        rate = self.done / max(now - self._start, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        print(
            f"{self.desc}: {self.done}/{self.total} {self.unit} ({rate:.1f} {self.unit}/s, "
            f"ETA {eta:.0f}s)",
            file=self.stream,
            flush=True,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and self.done:
            self._line(time.monotonic())

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
