"""The per-request deadline: budgets that keep the fallback's reserve, and the stages it
names when it ends a request."""

from __future__ import annotations

import asyncio

import pytest

from poimen_memory.errors import DeadlineExceeded
from poimen_memory.retrieval.deadline import Deadline


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_budget_keeps_the_reserve_and_never_goes_negative() -> None:
    d = Deadline(10.0)
    assert 5.0 < d.budget(100.0, 0.5) <= 9.5
    assert d.budget(2.0, 0.5) == 2.0
    assert Deadline(0.1).budget(5.0, 0.5) == 0.0


def test_remaining_ms_is_never_zero() -> None:
    # 0 ms would be statement_timeout's "no limit".
    assert Deadline(0.0).remaining_ms() == 1


def test_check_raises_once_the_deadline_passed() -> None:
    Deadline(10.0).check("lexical")
    with pytest.raises(DeadlineExceeded, match="during lexical"):
        Deadline(0.0).check("lexical")


@pytest.mark.anyio
async def test_waiting_for_names_the_stages_still_running() -> None:
    d = Deadline(10.0)
    release = asyncio.Event()

    async def stage(name: str) -> None:
        with d.stage(name):
            await release.wait()

    tasks = [asyncio.create_task(stage(n)) for n in ("semantic", "lexical", "lexical")]
    await asyncio.sleep(0)
    assert d.waiting_for() == "lexical, semantic"
    release.set()
    await asyncio.gather(*tasks)
    assert d.waiting_for() == ""


@pytest.mark.anyio
async def test_a_cancelled_stage_is_still_named() -> None:
    # What an outer asyncio.timeout sees: by the time it is handled, the stages have
    # unwound, but the one it cut off is still what the request was waiting for.
    d = Deadline(0.01)

    async def hang() -> None:
        with d.stage("lexical"):
            await asyncio.sleep(10)

    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.02):
            await hang()
    assert d.running["lexical"] == 0
    assert d.waiting_for() == "lexical"


@pytest.mark.anyio
async def test_a_stage_cancelled_before_the_deadline_is_not_named() -> None:
    # A leg the pipeline cancels itself (its partner failed, a fallback answered) ends
    # long before the deadline: a later timeout did not wait for it.
    d = Deadline(10.0)

    async def leg() -> None:
        with d.stage("opensearch"):
            await asyncio.sleep(10)

    task = asyncio.create_task(leg())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert d.running["opensearch"] == 0
    assert d.waiting_for() == ""


def test_a_stage_that_fails_is_no_longer_running() -> None:
    d = Deadline(10.0)
    with pytest.raises(RuntimeError), d.stage("rerank"):
        raise RuntimeError("upstream down")
    assert d.waiting_for() == ""
