// The query explorer: reads its query from its own URL, calls GET /memory/query and renders
// the answer. No framework and no innerHTML: every node is built with createElement, so
// text from the corpus is never parsed as markup.
"use strict";

(function () {
  const PARAMS = ["query", "project", "level", "limit", "strategy", "fusion"];
  const STAGES = ["embed", "lexical", "semantic", "fusion", "rerank", "provenance"];

  const $ = (id) => document.getElementById(id);
  const form = $("query-form");

  // The API key (when the service has keys): sent as the Authorization header, never put
  // in the page's URL; kept in this tab's sessionStorage, so a reload keeps it and closing
  // the tab forgets it.
  const KEY_ITEM = "poimen-memory-api-key";
  const keyInput = $("api-key");
  keyInput.value = sessionStorage.getItem(KEY_ITEM) || "";
  keyInput.addEventListener("change", () => {
    const key = keyInput.value.trim();
    if (key) sessionStorage.setItem(KEY_ITEM, key);
    else sessionStorage.removeItem(KEY_ITEM);
  });
  function requestHeaders() {
    const headers = { Accept: "application/json" };
    const key = keyInput.value.trim();
    if (key) headers.Authorization = `Bearer ${key}`;
    return headers;
  }

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = value;
      else if (key.startsWith("data-")) node.setAttribute(key, value);
      else node[key] = value;
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  const fmt = (x, digits = 3) =>
    x === null || x === undefined ? "—" : Number(x).toFixed(digits).replace(/\.?0+$/, "") || "0";
  // One decimal, two below a millisecond (a cached embedding takes a few microseconds).
  const ms = (x) =>
    x === null || x === undefined ? "—" : `${Number(x).toFixed(Math.abs(x) < 1 ? 2 : 1)} ms`;

  function when(ts) {
    if (!ts) return null;
    const d = new Date(ts);
    if (Number.isNaN(d.getTime())) return ts;
    return d.toISOString().replace("T", " ").replace(/:\d\d\.\d+Z$/, " UTC");
  }

  // -- URL <-> form ------------------------------------------------------------------------

  function paramsFromUrl() {
    const u = new URLSearchParams(window.location.search);
    const levels = u.getAll("level").flatMap((v) => v.split(",")).map((v) => v.trim()).filter(Boolean);
    return {
      query: u.get("query") || "",
      project: u.get("project") || "",
      level: levels,
      limit: u.get("limit") || "",
      strategy: u.get("strategy") || "",
      fusion: u.get("fusion") || "",
    };
  }

  function fillForm(p) {
    form.elements.query.value = p.query;
    form.elements.project.value = p.project;
    if (p.level.length) {
      for (const box of form.querySelectorAll('input[name="level"]')) box.checked = p.level.includes(box.value);
    }
    if (p.limit) form.elements.limit.value = p.limit;
    form.elements.strategy.value = p.strategy;
    form.elements.fusion.value = p.fusion;
  }

  function paramsFromForm() {
    return {
      query: form.elements.query.value.trim(),
      project: form.elements.project.value.trim(),
      level: [...form.querySelectorAll('input[name="level"]:checked')].map((b) => b.value),
      limit: form.elements.limit.value,
      strategy: form.elements.strategy.value,
      fusion: form.elements.fusion.value,
    };
  }

  function searchString(p) {
    const u = new URLSearchParams();
    for (const key of PARAMS) {
      const value = key === "level" ? p.level.join(",") : p[key];
      if (value) u.set(key, value);
    }
    return u.toString();
  }

  // -- rendering ---------------------------------------------------------------------------

  function levelBadge(level) {
    return el("span", { class: `badge level-${String(level).toLowerCase()}`, text: level });
  }

  function nodeHead(node) {
    return el(
      "span",
      { class: "node-head" },
      levelBadge(node.level),
      node.source ? el("span", { class: "source", text: node.source }) : null,
      node.timestamp ? el("time", { class: "ts", dateTime: node.timestamp, text: when(node.timestamp) }) : null,
      node.title ? el("span", { class: "title", text: node.title }) : null,
    );
  }

  function countLevels(parents, acc = {}) {
    for (const p of parents || []) {
      acc[p.level] = (acc[p.level] || 0) + 1;
      countLevels(p.parents, acc);
    }
    return acc;
  }

  function treeList(parents) {
    return el(
      "ul",
      { class: "tree" },
      parents.map((p) => {
        const text = el("p", { class: "node-text", text: p.text });
        const item = el("li", { class: "node", "data-level": p.level });
        if (p.parents && p.parents.length) {
          item.append(el("details", {}, el("summary", {}, nodeHead(p)), text, treeList(p.parents)));
        } else {
          item.append(el("div", { class: "leaf" }, nodeHead(p), text));
        }
        return item;
      }),
    );
  }

  function provenance(parents) {
    if (!parents || !parents.length) return el("p", { class: "muted prov-none", text: "No provenance: this is evidence itself." });
    const counts = countLevels(parents);
    const summary = Object.keys(counts).sort().map((k) => `${counts[k]} ${k}`).join(", ");
    return el(
      "details",
      { class: "provenance" },
      el("summary", {}, `Provenance (${summary})`),
      treeList(parents),
    );
  }

  // Who a result is (its id, as ingested) and what still supports it (memory.support_status:
  // full, partial, none; null for evidence itself), and why it cites nothing, if it does not.
  function identity(r) {
    return el(
      "div",
      { class: "identity" },
      r.external_id ? el("span", { class: "external-id", text: r.external_id }) : null,
      r.support ? el("span", { class: `support support-${r.support}`, text: `support: ${r.support}` }) : null,
      r.uncited_reason ? el("span", { class: "uncited muted", text: `cites no turn: ${r.uncited_reason}` }) : null,
    );
  }

  // The node's versions (GET /memory/nodes/{id}/history), fetched when first opened.
  function versions(r, project) {
    if (!r.external_id || !project) return null;
    const list = el("ol", { class: "version-list" });
    const box = el("details", { class: "versions" }, el("summary", {}, "Versions"), list);
    box.addEventListener("toggle", async () => {
      if (!box.open || list.childElementCount) return;
      const url = `/memory/nodes/${encodeURIComponent(r.external_id)}/history?project=${encodeURIComponent(project)}`;
      try {
        const response = await fetch(url, { headers: requestHeaders() });
        const body = await response.json();
        if (!response.ok) {
          list.append(el("li", { class: "muted", text: `${response.status} ${body.error || ""}` }));
          return;
        }
        for (const v of body.versions) {
          const ended = v.current ? "current" : `${v.end_reason} ${when(v.expired_at)}`;
          list.append(
            el(
              "li",
              { class: "version", "data-revision": String(v.revision), "data-current": String(v.current) },
              el("span", { class: "revision", text: `r${v.revision}` }),
              el("span", { class: "since", text: `from ${when(v.created_at)}` }),
              el("span", { class: "ended", text: ended }),
              v.text === null ? el("span", { class: "muted", text: "erased" }) : el("p", { class: "version-text", text: v.text }),
            ),
          );
        }
      } catch (err) {
        list.append(el("li", { class: "muted", text: `Failed: ${err.message}` }));
      }
    });
    return box;
  }

  function legCell(name, rank, score, scoreName) {
    return el(
      "div",
      { class: "leg", "data-leg": name },
      el("span", { class: "leg-name", text: name }),
      el("span", { class: "leg-rank", text: rank === null || rank === undefined ? "not in leg" : `rank ${rank}` }),
      score === null || score === undefined ? null : el("span", { class: "leg-score", text: `${scoreName} ${fmt(score)}` }),
    );
  }

  function renderResults(body) {
    const list = $("results");
    list.replaceChildren();
    if (!body.results.length) {
      list.append(el("li", { class: "muted empty", text: "No results." }));
      return;
    }
    body.results.forEach((r, i) => {
      list.append(
        el(
          "li",
          { class: "result", "data-level": r.level },
          el("div", { class: "result-head" }, el("span", { class: "rank", text: `#${i + 1}` }), nodeHead(r)),
          identity(r),
          el("p", { class: "result-text", text: r.text }),
          r.breadcrumb && r.breadcrumb.length ? el("p", { class: "breadcrumb muted", text: r.breadcrumb.join(" › ") }) : null,
          el(
            "div",
            { class: "scores" },
            legCell("semantic", r.semantic_rank, r.query_score, "cosine"),
            legCell("lexical", r.lexical_rank, r.lexical_score, "score"),
            el(
              "div",
              { class: "leg fused", "data-leg": "fused" },
              el("span", { class: "leg-name", text: "fused" }),
              el("span", { class: "leg-rank", text: r.fusion_method || "" }),
              el("span", { class: "leg-score final-score", text: fmt(r.final_score) }),
            ),
            r.rerank_score !== null && r.rerank_score !== undefined
              ? el(
                  "div",
                  { class: "leg", "data-leg": "rerank" },
                  el("span", { class: "leg-name", text: "rerank" }),
                  el("span", { class: "leg-score", text: fmt(r.rerank_score) }),
                )
              : null,
          ),
          provenance(r.parents),
          versions(r, r.project),
        ),
      );
    });
  }

  // The L0 turns the answer cites: what the results derive from, and what the query
  // matches directly (GET /memory/query's "evidence", memory.select_evidence).
  function renderEvidence(body) {
    const list = $("evidence");
    const items = body.evidence || [];
    const budget = body.plan && body.plan.evidence ? body.plan.evidence.budget : 0;
    list.replaceChildren();
    $("evidence-note").textContent = budget
      ? `${items.length} L0 turn${items.length === 1 ? "" : "s"} cited (at most ${budget}); the trees above keep only these.`
      : "Evidence off (evidence=0): the trees above hold every L0 turn.";
    items.forEach((e) => {
      const why = [];
      if (e.cited_by && e.cited_by.length) why.push(`cited by ${e.cited_by.map((r) => `#${r}`).join(", ")}`);
      if (e.direct_rank !== null && e.direct_rank !== undefined) why.push(`direct match rank ${e.direct_rank}`);
      if (e.neighbour_score > 0) why.push(`said beside a candidate +${fmt(e.neighbour_score)}`);
      list.append(
        el(
          "li",
          { class: "result evidence-item", "data-level": "L0" },
          el("div", { class: "result-head" }, el("span", { class: "rank", text: `E${e.rank}` }), nodeHead(e)),
          el("p", { class: "result-text", text: e.text }),
          el("p", { class: "evidence-why muted", text: `${why.join(" · ")} · score ${fmt(e.score)}` }),
        ),
      );
    });
  }

  function renderPlan(body) {
    const plan = body.plan || {};
    const engines = plan.engines || {};
    const dl = el("dl", { class: "facts" });
    const row = (k, v) => dl.append(el("dt", { text: k }), el("dd", {}, v));
    row("strategy", el("strong", { class: "strategy", text: body.search_strategy }));
    if (plan.optimizer_strategy && plan.optimizer_strategy !== body.search_strategy) {
      row("optimizer chose", plan.optimizer_strategy);
    }
    row("question type", el("span", { class: "question-type", text: plan.question_type || "—" }));
    row("confidence", fmt(plan.confidence, 2));
    row("levels", (body.level_filter || []).join(", "));
    const engineList = el("ul", { class: "engines" });
    for (const name of ["lexical", "semantic", "rerank"]) {
      engineList.append(el("li", {}, el("span", { class: "muted", text: `${name}: ` }), engines[name] || "none"));
    }
    row("engines", engineList);
    const reasons = [...(plan.reasons || []), ...(plan.why || [])];
    $("plan-body").replaceChildren(
      dl,
      reasons.length ? el("h3", { text: "Reasons" }) : null,
      reasons.length ? el("ul", { class: "reasons" }, reasons.map((r) => el("li", { text: r }))) : null,
    );
  }

  // Stage start times are not measured, only durations: starts follow the pipeline's
  // order (the lexical leg runs alongside embed → semantic; fusion waits for both legs;
  // rerank and provenance follow).
  function layout(metrics, strategy) {
    const d = Object.fromEntries(STAGES.map((s) => [s, Number(metrics[`${s}_time_ms`] || 0)]));
    const spans = {};
    const put = (stage, start) => {
      if (d[stage] > 0) spans[stage] = [start, d[stage]];
      return start + d[stage];
    };
    const embedEnd = put("embed", 0);
    const lexEnd = put("lexical", 0);
    const semStart = strategy === "LexicalFirst" ? Math.max(embedEnd, lexEnd) : embedEnd;
    const semEnd = put("semantic", semStart);
    const fusionEnd = put("fusion", Math.max(embedEnd, lexEnd, semEnd));
    const rerankEnd = put("rerank", fusionEnd);
    const end = put("provenance", rerankEnd);
    return { spans, end };
  }

  function renderTimings(body) {
    const m = body.metrics || {};
    const total = Number(m.total_time_ms || body.latency_ms || 0);
    const { spans, end } = layout(m, body.search_strategy);
    const scale = Math.max(total, end, 0.001);
    const rows = el("ol", { class: "waterfall" });
    const bar = (name, start, dur, extra) => {
      const fill = el("span", { class: `bar bar-${name}` });
      fill.style.left = `${((start / scale) * 100).toFixed(2)}%`;
      fill.style.width = `${Math.max((dur / scale) * 100, 0.6).toFixed(2)}%`;
      rows.append(
        el(
          "li",
          { class: `stage ${extra || ""}`, "data-stage": name },
          el("span", { class: "stage-name", text: name }),
          el("span", { class: "track", title: `${name}: ${ms(dur)} from ${ms(start)}` }, fill),
          el("span", { class: "stage-ms", text: ms(dur) }),
        ),
      );
    };
    for (const stage of STAGES) if (spans[stage]) bar(stage, spans[stage][0], spans[stage][1]);
    const skipped = STAGES.filter((s) => !spans[s]);
    const untimed = total - end;
    if (untimed > 0.05) bar("other", end, untimed, "untimed");
    bar("total", 0, total, "total");
    $("timings-body").replaceChildren(
      rows,
      el(
        "p",
        { class: "muted note" },
        skipped.length ? `Not run: ${skipped.join(", ")}. ` : "",
        "Durations are measured; start offsets follow the pipeline's order. ",
        "“other” is validation, routing and serialization.",
      ),
      el(
        "p",
        { class: "muted note" },
        `${m.semantic_candidates ?? 0} semantic and ${m.lexical_candidates ?? 0} lexical candidates; `,
        `embedding cache ${m.embedding_cache_hit ? "hit" : "miss"}.`,
      ),
    );
  }

  function renderDegraded(entries) {
    const box = $("degraded");
    const list = $("degraded-list");
    list.replaceChildren(
      ...(entries || []).map((d) =>
        el("li", {}, el("strong", { class: "degraded-stage", text: d.stage }), " — ", el("code", { text: d.reason })),
      ),
    );
    box.hidden = !(entries && entries.length);
  }

  function showError(title, body) {
    const box = $("error");
    const parts = [el("strong", { text: title })];
    if (body && typeof body === "object") {
      if (body.detail) parts.push(": ", body.detail);
      if (body.hint) parts.push(el("br"), el("span", { class: "muted", text: `hint: ${body.hint}` }));
    } else if (body) {
      parts.push(": ", String(body));
    }
    $("error-text").replaceChildren(...parts);
    box.hidden = false;
  }

  function clear() {
    $("error").hidden = true;
    $("degraded").hidden = true;
    $("results").replaceChildren();
    $("evidence").replaceChildren();
    $("evidence-note").textContent = "";
  }

  // -- running a query ---------------------------------------------------------------------

  let current = null;

  async function run(p) {
    clear();
    if (!p.query) {
      $("status").textContent = "Type a query and press Enter.";
      return;
    }
    if (current) current.abort();
    const controller = new AbortController();
    current = controller;
    document.body.classList.add("busy");
    $("status").textContent = "Searching…";
    const started = performance.now();
    try {
      const response = await fetch(`/memory/query?${searchString(p)}`, {
        headers: requestHeaders(),
        signal: controller.signal,
      });
      const roundTrip = performance.now() - started;
      let body = null;
      try {
        body = await response.json();
      } catch (err) {
        body = null;
      }
      if (controller !== current) return;
      const rid = response.headers.get("X-Request-ID");
      if (!response.ok || !body) {
        showError(body && body.error ? `${response.status} ${body.error}` : `HTTP ${response.status}`, body);
        $("status").textContent = `Failed (request ${rid || "?"}).`;
        return;
      }
      renderResults(body);
      renderEvidence(body);
      renderPlan(body);
      renderTimings(body);
      renderDegraded(body.degraded);
      const n = body.results.length;
      $("status").textContent =
        `${n} result${n === 1 ? "" : "s"} · ${body.search_strategy} · ${ms(body.latency_ms)} in the service, ` +
        `${ms(roundTrip)} round trip · request ${rid || "?"}`;
      document.title = `${p.query} · poimen-memory`;
    } catch (err) {
      if (err.name === "AbortError") return;
      showError("Request failed", err.message);
      $("status").textContent = "Failed.";
    } finally {
      if (controller === current) {
        document.body.classList.remove("busy");
        current = null;
      }
    }
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const p = paramsFromForm();
    const url = `/ui?${searchString(p)}`;
    if (url !== window.location.pathname + window.location.search) window.history.pushState(null, "", url);
    run(p);
  });

  window.addEventListener("popstate", () => {
    const p = paramsFromUrl();
    fillForm(p);
    run(p);
  });

  document.addEventListener("keydown", (event) => {
    const typing = /^(INPUT|SELECT|TEXTAREA)$/.test(document.activeElement.tagName);
    if (event.key === "/" && !typing && !event.ctrlKey && !event.metaKey && !event.altKey) {
      event.preventDefault();
      form.elements.query.focus();
      form.elements.query.select();
    }
  });

  const initial = paramsFromUrl();
  fillForm(initial);
  if (initial.query) run(initial);
  else form.elements.query.focus();
})();
