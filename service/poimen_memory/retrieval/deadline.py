"""One wall-clock deadline per request, shared by every stage."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from poimen_memory.errors import DeadlineExceeded


@dataclass
class Deadline:
    budget_s: float
    started: float = field(default_factory=time.monotonic)
    # Stages in flight, and those the deadline's cancellation interrupted, so a request the
    # deadline ends can say what it was waiting for (by the time the timeout is handled,
    # the cancellation has already unwound every stage).
    running: Counter[str] = field(default_factory=Counter)
    interrupted: set[str] = field(default_factory=set)

    @property
    def at(self) -> float:
        return self.started + self.budget_s

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def remaining_ms(self) -> int:
        """Milliseconds left for a statement_timeout; never 0, which would mean 'no limit'."""
        return max(1, int(self.remaining() * 1000))

    def elapsed_ms(self) -> float:
        return (time.monotonic() - self.started) * 1000

    def budget(self, cap: float, reserve: float) -> float:
        """Time a stage may take: at most ``cap``, and never the last ``reserve`` seconds,
        which are kept for the fallback (lexical answer, fused order, Postgres BM25)."""
        return max(0.0, min(cap, self.remaining() - reserve))

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self.running[name] += 1
        try:
            yield
        except asyncio.CancelledError:
            # Only the deadline's own cut counts: a leg cancelled earlier on purpose (the
            # other leg failed, a fallback took over) is not what a timeout waited for.
            if self.remaining() <= 0:
                self.interrupted.add(name)
            raise
        finally:
            self.running[name] -= 1

    def waiting_for(self) -> str:
        """The stages still running or cut off by a cancellation, in a stable order
        ("lexical, semantic"), or ""."""
        running = {name for name, n in self.running.items() if n > 0}
        return ", ".join(sorted(running | self.interrupted))

    def check(self, stage: str) -> None:
        if self.remaining() <= 0:
            raise DeadlineExceeded(
                f"deadline of {self.budget_s:g}s passed during {stage}",
                hint="raise timeout_seconds (clamped to POIMEN_MAX_TIMEOUT_S)",
            )
