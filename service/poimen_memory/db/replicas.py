"""Read replicas: streaming standbys that serve GET /memory/query (docs/scaling.md).

A monitor checks every replica each POIMEN_REPLICA_CHECK_S, off the request path: is it up,
is it a standby, and how stale is it. A query goes to a replica that passed its last check;
otherwise to the primary, with a ``{"stage": "replica", ...}`` entry in ``degraded``.

Lag, in seconds, is measured on the standby against the primary's WAL position:

* the primary's ``pg_current_wal_lsn()`` is read first, then the standby's
  ``pg_last_wal_replay_lsn()``; when replay has reached that LSN the standby has everything
  the primary had a moment ago, so its lag is 0 (exact, whatever the clocks say, and right
  on an idle primary, where ``now() - pg_last_xact_replay_timestamp()`` grows for ever);
* otherwise the lag is ``clock_timestamp() - pg_last_xact_replay_timestamp()``: the age of
  the last commit it replayed, an upper bound on how stale its data is (it compares the
  primary's commit clock with the standby's, so keep both on NTP).

Without a primary answer the standby's own received WAL stands in for the primary's LSN, so
queries keep their replicas while the primary is away.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from poimen_memory.db.queries import q

log = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 1.0
RECHECK_AFTER_S = 0.05


@dataclass(frozen=True)
class ReplicaState:
    ok: bool
    reason: str | None = None
    """Why it is not used: ``unchecked``, ``unavailable``, ``not_a_standby``, ``lagging``,
    ``lag_unknown`` (nothing replayed yet and behind), ``failed`` (a query failed on it)."""
    lag_s: float | None = None
    behind_bytes: float | None = None
    paused: bool | None = None
    checked_at: float = -1e9


def describe(url: str) -> str:
    """host:port/dbname of a URL, never its password."""
    try:
        info = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "(unparsable URL)"
    return f"{info.get('host', '')}:{info.get('port', '5432')}/{info.get('dbname', '')}"


class Replica:
    def __init__(self, url: str, pool: AsyncConnectionPool[Any]) -> None:
        self.url, self.pool = url, pool
        self.name = describe(url)
        self.state = ReplicaState(ok=False, reason="unchecked")


class ReplicaSet:
    def __init__(
        self,
        primary: AsyncConnectionPool[Any],
        replicas: Sequence[Replica],
        *,
        max_lag_s: float,
        check_s: float,
    ) -> None:
        self.primary, self.replicas = primary, list(replicas)
        self.max_lag_s, self.check_s = max_lag_s, check_s
        self._turn = itertools.count()

    def choose(self) -> tuple[Replica | None, str | None]:
        """A replica that passed its last check (round robin), or None and why not."""
        ready = [r for r in self.replicas if r.state.ok]
        if ready:
            return ready[next(self._turn) % len(ready)], None
        reasons = {r.state.reason for r in self.replicas}
        return None, reasons.pop() if len(reasons) == 1 else "unavailable"

    def mark_failed(self, replica: Replica) -> None:
        """A query failed on it: keep queries away until the monitor's next check."""
        replica.state = ReplicaState(ok=False, reason="failed", checked_at=time.monotonic())

    async def refresh(self) -> None:
        primary_lsn = await self._primary_lsn()
        await asyncio.gather(*(self._check(r, primary_lsn) for r in self.replicas))

    async def run(self) -> None:
        """The monitor: check every replica each ``check_s``, for ever (cancel to stop)."""
        while True:
            await asyncio.sleep(self.check_s)
            try:
                await self.refresh()
            except Exception:  # the monitor must outlive anything a check can raise
                log.exception("replica check failed")

    def report(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [
            {
                "server": r.name,
                "ok": r.state.ok,
                "reason": r.state.reason,
                "lag_s": r.state.lag_s,
                "behind_bytes": r.state.behind_bytes,
                "replay_paused": r.state.paused,
                "checked_s_ago": round(now - r.state.checked_at, 3)
                if r.state.checked_at > 0
                else None,
            }
            for r in self.replicas
        ]

    async def _primary_lsn(self) -> str | None:
        try:
            async with asyncio.timeout(CHECK_TIMEOUT_S):
                async with self.primary.connection(timeout=CHECK_TIMEOUT_S) as conn:
                    row = await (await conn.execute(q("primary_wal_lsn"))).fetchone()
        except (TimeoutError, PoolTimeout, psycopg.Error):
            return None
        return None if row is None else str(row[0])

    async def _read_state(self, replica: Replica, primary_lsn: str | None) -> dict[str, Any]:
        async with asyncio.timeout(CHECK_TIMEOUT_S):
            async with (
                replica.pool.connection(timeout=CHECK_TIMEOUT_S) as conn,
                conn.cursor(row_factory=dict_row) as cur,
            ):
                await cur.execute(q("replica_state"), {"primary_lsn": primary_lsn})
                row: dict[str, Any] | None = await cur.fetchone()
        assert row is not None
        return row

    async def _check(self, replica: Replica, primary_lsn: str | None) -> None:
        try:
            row = await self._read_state(replica, primary_lsn)
            if row["behind_bytes"] and row["behind_bytes"] > 0:
                # WAL written a moment before the primary's LSN was read (a commit, or the
                # checkpointer's own records on an idle primary) is usually replayed within
                # milliseconds: look once more before calling the replica stale.
                await asyncio.sleep(RECHECK_AFTER_S)
                row = await self._read_state(replica, primary_lsn)
        except (TimeoutError, PoolTimeout, psycopg.Error) as exc:
            if replica.state.reason != "unavailable":
                log.warning("replica %s unavailable: %s", replica.name, exc)
            replica.state = ReplicaState(
                ok=False, reason="unavailable", checked_at=time.monotonic()
            )
            return
        replica.state = self._judge(row)

    def _judge(self, row: dict[str, Any]) -> ReplicaState:
        now = time.monotonic()
        if not row["in_recovery"]:
            # A promoted or mistaken server: its data may have diverged from the primary's.
            return ReplicaState(ok=False, reason="not_a_standby", checked_at=now)
        behind = max(float(row["behind_bytes"] or 0.0), 0.0)
        since = row["since_replay_s"]
        lag = 0.0 if behind == 0 else (None if since is None else max(float(since), 0.0))
        reason = None
        if lag is None:
            reason = "lag_unknown"
        elif lag > self.max_lag_s:
            reason = "lagging"
        return ReplicaState(
            ok=reason is None,
            reason=reason,
            lag_s=None if lag is None else round(lag, 3),
            behind_bytes=behind,
            paused=row["paused"],
            checked_at=now,
        )
