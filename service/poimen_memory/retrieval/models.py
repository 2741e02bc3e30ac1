"""What goes into the pipeline (the request: the contract's) and what it keeps of its own
work (the trace)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from poimen_memory.contract.query import QueryRequest

__all__ = ["QueryRequest", "Trace"]


@dataclass
class Trace:
    metrics: dict[str, Any] = field(default_factory=dict)
    degraded: list[dict[str, str]] = field(default_factory=list)
    engines: dict[str, str | None] = field(default_factory=dict)
    why: list[str] = field(default_factory=list)

    def timed(self, key: str, started: float) -> None:
        self.metrics[key] = round((time.monotonic() - started) * 1000, 3)
