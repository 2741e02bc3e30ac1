"""The query explorer in a real browser: Debian's Chromium, driven by Playwright, against the
real server (its own uvicorn process) on a real database loaded with the demo corpus.

Chromium comes from scripts/setup-browser.sh (apt); Playwright never downloads a browser
here. POIMEN_EXPLORER_SCREENSHOT=path saves the main test's page as a PNG (the README's
docs/explorer.png is made that way).
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import psycopg
import pytest
from playwright.sync_api import Browser, Page, Playwright, expect, sync_playwright

from poimen_lab.live_server import live_server
from poimen_memory.db.cluster import Cluster
from service_client import make_key

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
QUESTION = "why did requests over 10KB fail"
TIMEOUT_MS = 20_000
# expect() waits have their own 5 s default, which set_default_timeout does not change.
expect.set_options(timeout=TIMEOUT_MS)


@pytest.fixture(scope="module")
def server(
    cluster: Cluster,
    admin: psycopg.Connection[Any],
    template_db: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    """One server for the module, on its own copy of the fixture database."""
    with served_copy(cluster, admin, template_db, tmp_path_factory) as (url, _):
        yield url


@contextmanager
def served_copy(
    cluster: Cluster,
    admin: psycopg.Connection[Any],
    template_db: str,
    tmp_path_factory: pytest.TempPathFactory,
    keyed: bool = False,
) -> Iterator[tuple[str, str | None]]:
    """A server on a copy of the fixture database, and (keyed) an API key made in it first:
    with a key in the database, every request needs one."""
    name = f"ui_{uuid.uuid4().hex[:12]}"
    admin.execute(f"CREATE DATABASE {name} TEMPLATE {template_db}")
    key = make_key(cluster.url(name), ["poimen"]) if keyed else None
    output = tmp_path_factory.mktemp("ui") / "server.log"
    try:
        with live_server({"POIMEN_DATABASE_URL": cluster.url(name)}, output) as url:
            yield url, key
    finally:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run scripts/setup-browser.sh (make setup-dev)")
    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    b = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
    yield b
    b.close()


@pytest.fixture
def page(browser: Browser, server: str) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    p = context.new_page()
    p.set_default_timeout(TIMEOUT_MS)
    outside: list[str] = []
    p.on("request", lambda r: outside.append(r.url) if not r.url.startswith(server) else None)
    yield p
    context.close()
    assert not outside, f"the page reached beyond its own server: {outside}"


def ui_url(server: str, **params: str) -> str:
    return f"{server}/ui?{urlencode(params)}"


def open_query(page: Page, url: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Open the explorer at ``url`` and return the JSON and headers the page rendered."""
    with page.expect_response(lambda r: "/memory/query?" in r.url) as info:
        page.goto(url)
    response = info.value
    assert response.status == 200, response.text()
    body: dict[str, Any] = response.json()
    expect(page.locator("#results > li.result")).to_have_count(len(body["results"]))
    return body, response.headers


def to_fixed(x: float, digits: int) -> str:
    """JavaScript's Number.prototype.toFixed: an exact tie rounds up (27.25 -> "27.3"), where
    Python's format rounds it to even ("27.2"); the server's 3-decimal metrics make such ties."""
    # toFixed drops the sign of -0 only: (-0).toFixed(1) is "0.0", (-0.01).toFixed(1) "-0.0".
    text = str(Decimal(x).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))
    return text.removeprefix("-") if x == 0 else text


def fmt(x: float | None) -> str:
    """The page's number format: three decimals, trailing zeros dropped; a dash for none."""
    return "—" if x is None else to_fixed(x, 3).rstrip("0").rstrip(".")


def ms(x: float) -> str:
    """The page's duration format: one decimal, two below a millisecond."""
    return f"{to_fixed(x, 2 if abs(x) < 1 else 1)} ms"


def test_number_formats_match_the_pages_javascript(page: Page, server: str) -> None:
    # Ties (exact in binary) and near-ties, where toFixed and Python's format part ways.
    values = [27.25, 27.75, 0.125, 0.375, 1.05, 2.5, 0.0005, 0.0, -0.0, -0.01, 12.3456, 999.95,
              0.995]  # fmt: skip
    page.goto(f"{server}/ui")
    got = page.evaluate("vs => vs.map(v => [v.toFixed(1), v.toFixed(2), v.toFixed(3)])", values)
    assert got == [[to_fixed(v, 1), to_fixed(v, 2), to_fixed(v, 3)] for v in values]


def bar_fraction(page: Page, stage: str) -> float:
    track = page.locator(f'.waterfall .stage[data-stage="{stage}"] .track')
    fill = track.locator(".bar")
    t, f = track.bounding_box(), fill.bounding_box()
    assert t and f and t["width"] > 0
    return float(f["width"] / t["width"])


def test_linked_query_renders_results_provenance_plan_and_timings(page: Page, server: str) -> None:
    body, headers = open_query(page, ui_url(server, query=QUESTION, project="poimen"))
    assert body["results"], "the demo question must find something"

    # The form is filled from the URL, so the answer is linked and opens ready.
    expect(page.locator("#query")).to_have_value(QUESTION)
    expect(page.locator("#project")).to_have_value("poimen")

    # Results, in the API's order, with each leg's rank and score and the fused score.
    results = page.locator("#results > li.result")
    for i, r in enumerate(body["results"]):
        item = results.nth(i)
        expect(item.locator(".result-text")).to_have_text(r["text"])
        expect(item.locator(".result-head .badge")).to_have_text(r["level"])
        expect(item.locator(".result-head .source")).to_have_text(r["source"])
        sem = item.locator('[data-leg="semantic"]')
        lex = item.locator('[data-leg="lexical"]')
        rank = r["semantic_rank"]
        expect(sem.locator(".leg-rank")).to_have_text(f"rank {rank}" if rank else "not in leg")
        rank = r["lexical_rank"]
        expect(lex.locator(".leg-rank")).to_have_text(f"rank {rank}" if rank else "not in leg")
        if r["lexical_score"] is None:
            expect(lex.locator(".leg-score")).to_have_count(0)
        else:
            expect(lex.locator(".leg-score")).to_have_text(f"score {fmt(r['lexical_score'])}")
        expect(sem.locator(".leg-score")).to_have_text(f"cosine {fmt(r['query_score'])}")
        expect(item.locator(".final-score")).to_have_text(fmt(r["final_score"]))
        expect(item.locator('[data-leg="fused"] .leg-rank')).to_have_text(r["fusion_method"])
    first = results.first
    expect(first.locator(".result-text")).to_contain_text("Requests with bodies over 10KB failed")

    # Provenance: collapsed at first; opened from the keyboard, it shows the L0 evidence with
    # its source and timestamp.
    l0 = body["results"][0]["parents"][0]
    assert l0["level"] == "L0"
    evidence = first.locator(f'.tree .node[data-level="L0"]:has-text("{l0["source"]}")')
    expect(evidence).to_be_hidden()
    first.locator(".provenance > summary").focus()
    page.keyboard.press("Enter")
    expect(evidence).to_be_visible()
    expect(evidence.locator(".node-text")).to_have_text(l0["text"])
    expect(evidence.locator(".ts")).to_have_text("2024-03-04 09:12 UTC")
    expect(evidence.locator(".badge")).to_have_text("L0")

    # An L2 synthesis: L2 -> L1 -> L0, two levels of the tree down.
    l2_index = next(i for i, r in enumerate(body["results"]) if r["level"] == "L2")
    l2 = results.nth(l2_index)
    l1 = body["results"][l2_index]["parents"][0]
    assert l1["level"] == "L1" and l1["parents"]
    deep = l1["parents"][0]
    l2.locator(".provenance > summary").click()
    l1_node = l2.locator(f'.tree .node[data-level="L1"]:has-text("{l1["source"]}")').first
    expect(l1_node).to_be_visible()
    deep_node = l1_node.locator(f'.node[data-level="L0"]:has-text("{deep["source"]}")')
    expect(deep_node).to_be_hidden()
    l1_node.locator("summary").first.click()
    expect(deep_node).to_be_visible()
    expect(deep_node.locator(".node-text")).to_have_text(deep["text"])

    # The evidence the answer cites: each turn with why it is there; the trees hold only these.
    cited = page.locator("#evidence > li.evidence-item")
    expect(cited).to_have_count(len(body["evidence"]))
    assert body["evidence"], "the demo question cites its incident"
    for i, e in enumerate(body["evidence"]):
        item = cited.nth(i)
        expect(item.locator(".rank")).to_have_text(f"E{e['rank']}")
        expect(item.locator(".result-text")).to_have_text(e["text"])
        why = item.locator(".evidence-why")
        expect(why).to_contain_text(f"score {fmt(e['score'])}")
        for r in e["cited_by"]:
            expect(why).to_contain_text(f"#{r}")
        if e["direct_rank"] is not None:
            expect(why).to_contain_text(f"direct match rank {e['direct_rank']}")
        if e["neighbour_score"] > 0:
            expect(why).to_contain_text(f"said beside a candidate +{fmt(e['neighbour_score'])}")
    limit = body["plan"]["evidence"]["budget"]
    expect(page.locator("#evidence-note")).to_contain_text(f"at most {limit}")

    # The plan.
    plan = body["plan"]
    expect(page.locator("#plan-body .strategy")).to_have_text(body["search_strategy"])
    expect(page.locator("#plan-body .question-type")).to_have_text(plan["question_type"])
    reasons = page.locator("#plan-body .reasons li")
    expect(reasons).to_have_count(len(plan["reasons"]) + len(plan["why"]))
    expect(reasons.first).to_have_text(plan["reasons"][0])
    expect(page.locator("#plan-body .engines")).to_contain_text("lexical: postgres-bm25")

    # The waterfall: one bar per stage that ran, its width the stage's share of the total.
    metrics = body["metrics"]
    ran = [
        s
        for s in ("embed", "lexical", "semantic", "fusion", "provenance")
        if (metrics[f"{s}_time_ms"] or 0) > 0  # null: it did not run
    ]
    assert {"lexical", "fusion", "provenance"} <= set(ran)
    for stage in ran:
        stage_row = page.locator(f'.waterfall .stage[data-stage="{stage}"]')
        expect(stage_row.locator(".stage-ms")).to_have_text(ms(metrics[f"{stage}_time_ms"]))
        share = metrics[f"{stage}_time_ms"] / metrics["total_time_ms"]
        assert bar_fraction(page, stage) == pytest.approx(max(share, 0.006), abs=0.01), stage
    assert bar_fraction(page, "total") == pytest.approx(1.0, abs=0.01)
    expect(page.locator('.waterfall .stage[data-stage="rerank"]')).to_have_count(0)
    expect(page.locator("#timings-body")).to_contain_text("Not run: rerank")

    # Degraded stages, shown plainly; the request id the server returned.
    expect(page.locator("#degraded")).to_be_visible()
    expect(page.locator("#degraded-list li")).to_have_text(["rerank — not_configured"])
    expect(page.locator("#status")).to_contain_text(f"request {headers['x-request-id']}")

    target = os.environ.get("POIMEN_EXPLORER_SCREENSHOT")
    if target:
        # The same question again, warm (cached embedding, hot buffers), as a user sees it.
        open_query(page, page.url)
        results.first.locator(".provenance > summary").click()
        results.nth(l2_index).locator(".provenance > summary").click()
        results.nth(l2_index).locator(".tree summary").first.click()
        page.locator("#query").focus()
        page.screenshot(path=target, full_page=True)


def test_keyboard_search_updates_the_url_and_history(page: Page, server: str) -> None:
    page.goto(f"{server}/ui")
    expect(page.locator("#status")).to_have_text("Type a query and press Enter.")
    expect(page.locator("#query")).to_be_focused()
    page.keyboard.type("kong body buffer")
    page.keyboard.press("Tab")
    expect(page.locator("#project")).to_be_focused()
    page.keyboard.type("poimen")
    with page.expect_response(lambda r: "/memory/query?" in r.url) as first:
        page.keyboard.press("Enter")
    assert first.value.status == 200
    assert re.search(
        r"/ui\?query=kong\+body\+buffer&project=poimen&level=L1%2CL2&limit=5$", page.url
    )
    expect(page.locator("#results > li.result").first).to_contain_text("Kong")

    # A second query with a forced strategy and only L0 evidence.
    page.locator("#query").fill("readiness probe 8080")
    page.locator("#strategy").select_option("LexicalOnly")
    page.locator('input[name="level"][value="L1"]').uncheck()
    page.locator('input[name="level"][value="L2"]').uncheck()
    page.locator('input[name="level"][value="L0"]').check()
    with page.expect_response(lambda r: "/memory/query?" in r.url) as second:
        page.locator("#query").press("Enter")
    body = second.value.json()
    assert body["search_strategy"] == "LexicalOnly" and body["level_filter"] == ["L0"]
    expect(page.locator("#results > li.result .result-head .badge")).to_have_text(
        ["L0"] * len(body["results"])
    )
    expect(page.locator("#plan-body .strategy")).to_have_text("LexicalOnly")
    expect(page.locator('.waterfall .stage[data-stage="semantic"]')).to_have_count(0)

    # Back restores the first query, from the URL alone.
    with page.expect_response(lambda r: "/memory/query?" in r.url):
        page.go_back()
    expect(page.locator("#query")).to_have_value("kong body buffer")
    expect(page.locator('input[name="level"][value="L1"]')).to_be_checked()
    expect(page.locator("#results > li.result").first).to_contain_text("Kong")

    # "/" jumps back to the query box from anywhere on the page.
    page.locator("#results-heading").focus()
    page.keyboard.press("/")
    expect(page.locator("#query")).to_be_focused()


def test_errors_are_shown_plainly(page: Page, server: str) -> None:
    with page.expect_response(lambda r: "/memory/query?" in r.url) as info:
        page.goto(ui_url(server, query=QUESTION, project="no-such-project"))
    assert info.value.status == 404
    expect(page.locator("#error")).to_be_visible()
    expect(page.locator("#error-text")).to_contain_text("404 unknown_project")
    expect(page.locator("#error-text")).to_contain_text('unknown project "no-such-project"')
    expect(page.locator("#results > li")).to_have_count(0)


@pytest.fixture(scope="module")
def keyed_server(
    cluster: Cluster,
    admin: psycopg.Connection[Any],
    template_db: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, str]]:
    """A server whose database has an API key (so every request needs one), and the key."""
    with served_copy(cluster, admin, template_db, tmp_path_factory, keyed=True) as (url, key):
        assert key is not None
        yield url, key


def test_an_api_key_is_sent_as_a_header_and_never_put_in_the_url(
    browser: Browser, keyed_server: tuple[str, str]
) -> None:
    """With keys made, the page asks for one: typed into the API key field it goes in the
    Authorization header of every call (the answer, a node's versions), never into the
    page's URL, and the tab keeps it over a reload."""
    server, key = keyed_server
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    sent: list[tuple[str, str | None]] = []
    page.on("request", lambda r: sent.append((r.url, r.headers.get("authorization"))))
    try:
        with page.expect_response(lambda r: "/memory/query?" in r.url) as info:
            page.goto(ui_url(server, query=QUESTION, project="poimen"))
        assert info.value.status == 401
        expect(page.locator("#error-text")).to_contain_text("401")
        page.fill("#api-key", key)
        page.dispatch_event("#api-key", "change")
        with page.expect_response(lambda r: "/memory/query?" in r.url) as info:
            page.click("button[type=submit]")
        assert info.value.status == 200, info.value.text()
        expect(page.locator("#results > li.result").first).to_be_visible()
        page.locator("details.versions > summary").first.click()
        expect(page.locator(".version-list li").first).to_be_visible()
        assert key not in page.url
        calls = [(u, a) for u, a in sent if "/memory/" in u]
        assert calls[0][1] is None  # before the key was typed
        assert all(a == f"Bearer {key}" for _, a in calls[1:]) and len(calls) >= 3, calls
        assert not [u for u, _ in sent if key in u]
        with page.expect_response(lambda r: "/memory/query?" in r.url) as info:
            page.reload()
        assert info.value.status == 200  # the tab kept the key
    finally:
        context.close()


def test_readable_on_a_narrow_screen(browser: Browser, server: str) -> None:
    context = browser.new_context(viewport={"width": 360, "height": 740}, is_mobile=True)
    try:
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        open_query(page, ui_url(server, query=QUESTION, project="poimen"))
        page.locator("#results > li.result").first.locator(".provenance > summary").click()
        # Nothing wider than the screen, and the side panels stack under the results.
        widths = page.evaluate(
            "[document.documentElement.scrollWidth, document.documentElement.clientWidth]"
        )
        assert widths[0] <= widths[1], widths
        results_box = page.locator("#results").bounding_box()
        plan_box = page.locator("#plan").bounding_box()
        assert results_box and plan_box and plan_box["y"] > results_box["y"]
        assert plan_box["x"] + plan_box["width"] <= 360
        target = os.environ.get("POIMEN_EXPLORER_SCREENSHOT")
        if target:
            page.screenshot(path=target.replace(".png", "-narrow.png"), full_page=True)
    finally:
        context.close()


def test_results_show_their_id_support_and_versions(page: Page, server: str) -> None:
    """Each result says who it is (its external id) and, when derived, its support; its
    versions open on demand from GET /memory/nodes/{id}/history, as the API gives them."""
    body, _ = open_query(page, ui_url(server, query=QUESTION, project="poimen"))
    results = page.locator("#results > li.result")
    for i, r in enumerate(body["results"]):
        item = results.nth(i)
        expect(item.locator(".external-id")).to_have_text(r["external_id"])
        if r["support"] is None:
            expect(item.locator(".support")).to_have_count(0)
        else:
            expect(item.locator(".support")).to_have_text(f"support: {r['support']}")
    first = body["results"][0]
    history = httpx.get(
        f"{server}/memory/nodes/{first['external_id']}/history", params={"project": "poimen"}
    ).json()
    results.nth(0).locator(".versions summary").click()
    versions = results.nth(0).locator(".version")
    expect(versions).to_have_count(len(history["versions"]))
    for i, v in enumerate(history["versions"]):
        expect(versions.nth(i).locator(".revision")).to_have_text(f"r{v['revision']}")
        expect(versions.nth(i)).to_have_attribute("data-current", str(v["current"]).lower())
    expect(versions.last.locator(".ended")).to_have_text("current")


def _refused_writes(server: str) -> float:
    """How many POSTs the service has refused 403 (its metrics; refused before routing,
    they count under the route "unmatched")."""
    scrape = httpx.get(f"{server}/metrics", timeout=10).text
    pattern = r'^poimen_http_requests_total\{method="POST",route="[^"]*",status="403"\} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, scrape, re.M))


def test_a_page_of_another_site_cannot_write(playwright: Playwright, server: str) -> None:
    """A page of another origin posts a node the ways a browser sends without a CORS
    preflight (a text/plain fetch, an HTML form): each reaches the service, which refuses
    it by its Origin (403), and nothing is written. Chromium's own guard against public
    pages calling loopback (Private/Local Network Access) is turned off: not every browser
    has it, and the service must refuse on its own."""
    browser = playwright.chromium.launch(
        executable_path=str(CHROMIUM),
        args=[*CHROMIUM_ARGS, "--disable-features=BlockInsecurePrivateNetworkRequests,"
              "PrivateNetworkAccessSendPreflights,LocalNetworkAccessChecks"],
    )  # fmt: skip
    context = browser.new_context()
    page = context.new_page()
    evil = "http://evil.example/"
    page.route(evil, lambda route: route.fulfill(
        status=200, content_type="text/html",
        body=f'<form method="post" action="{server}/memory/nodes" enctype="text/plain">'
             '<input name="x" value="y"></form>',
    ))  # fmt: skip
    page.goto(evil)
    node = {"id": "planted-by-evil", "level": "L1", "project": "poimen", "text": "planted"}
    before = _refused_writes(server)
    kind = page.evaluate(
        """async ([url, body]) => (await fetch(url, {method: "POST", mode: "no-cors",
                 headers: {"Content-Type": "text/plain"}, body})).type""",
        [f"{server}/memory/nodes", json.dumps([node])],
    )
    assert kind == "opaque"  # sent, its answer hidden from the page
    with page.expect_navigation():
        page.evaluate("document.forms[0].submit()")
    browser.close()
    assert _refused_writes(server) == before + 2
    got = httpx.get(f"{server}/memory/nodes/planted-by-evil", params={"project": "poimen"})
    assert got.status_code == 404, got.text
