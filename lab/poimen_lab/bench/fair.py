"""`poimen-memory bench-fair`: fair admission under a tenant's attack (issue 43).

A real corpus (LoCoMo, ../shared/data/locomo-dev: read, never copied) in a fresh database,
over many projects: the four tenants' conversations a project each, every other conversation
split by session (``--sessions-per-project`` to a project), and ``--tenants`` Zipf-sized
synthetic projects beside them; served by ``poimen-memory serve`` as the service's own role
under row-level security. Four API keys, one per tenant project: three "normal" tenants
asking their conversation's questions, ``--normal-concurrency`` at a time each, and one
"costly" tenant sending ``--costly-parallel`` queries in parallel, each legal but as dear as
the contract allows: near ``--costly-chars`` characters of distinct corpus words,
``evidence=100``, ``limit=50``, ``level=L0,L1,L2``. ``--database`` reuses a database an
earlier run kept (``--keep-db``): the load (embedding 5,078 nodes) takes minutes here.

One server per ``--setups`` entry (an admission's settings, SETUPS: ``none``, no share at
all, the behaviour before fair admission; ``share8`` and ``share2``, a share of that many
requests in flight or waiting and nothing else, the behaviour before the share by cost, at
its default and below the pool; ``fair``, the defaults: the share by cost, work-conserving;
``fair1.2``, the same at POIMEN_HTTP_FAIR_SHARE=1.2; ``fair-cpu``, the defaults with the
text weighed by its CPU alone; ``fair-share2``, the defaults with a share of 2 requests;
or ``label:ENV=VALUE+ENV=VALUE``; by default none, share8 and fair), all up at once on
the same database. Each round runs, for
each server in turn (the order alternating round by round, so a noisy machine falls on every
column alike): the three normal keys alone for
``--seconds``, then the same three while the costly key attacks. Reported, per server and
normal key: the medians over rounds of answered queries a second alone and under attack and
their ratio (the goal: >= 0.70), the p50/p95 latency of its 200s, every status counted (the
goal: the costly key gets 429s, the normal keys no 503s), and the CPU the server process and
its database sessions spent per answered request (/proc) beside the wall time.

Bounded: 127.0.0.1 only; each phase ``--seconds`` (at most 120), then the costly key's
requests still in flight are waited for (at most their deadline) before the next phase."""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

from psycopg.conninfo import make_conninfo

from poimen_lab.bench import synthetic
from poimen_lab.bench.http import CPU
from poimen_lab.bench.scratch import drop_database, fresh_database
from poimen_lab.live_server import live_server_process
from poimen_lab.measures import percentile
from poimen_lab.report import table
from poimen_memory.db.connect import connect, database_url, ensure_service_login
from poimen_memory.settings import Settings

DATA_DEFAULT = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "locomo-dev"
TENANT_LARGEST = 1000  # nodes of the largest synthetic tenant (the r-th: ceil(1000 / r))
NO_SHARE = 1_000_000  # POIMEN_HTTP_CLIENT_INFLIGHT beyond any capacity: the "before" column
# The admissions compared (api/admission.py), by name: the environment each server gets.
# POIMEN_HTTP_FAIR_SHARE=0 is admission before the share by cost (requests counted alone).
SETUPS: dict[str, dict[str, str]] = {
    "none": {"POIMEN_HTTP_CLIENT_INFLIGHT": str(NO_SHARE), "POIMEN_HTTP_FAIR_SHARE": "0"},
    "share8": {"POIMEN_HTTP_CLIENT_INFLIGHT": "8", "POIMEN_HTTP_FAIR_SHARE": "0"},
    "share2": {"POIMEN_HTTP_CLIENT_INFLIGHT": "2", "POIMEN_HTTP_FAIR_SHARE": "0"},
    "fair-cpu": {"POIMEN_HTTP_COST": "char=0.0011"},
    "fair": {},
    "fair1.2": {"POIMEN_HTTP_FAIR_SHARE": "1.2"},
    "fair-share2": {"POIMEN_HTTP_CLIENT_INFLIGHT": "2"},
}
GOAL = 0.70  # a normal key's throughput under attack over alone
COSTLY = {"evidence": "100", "limit": "50", "level": "L0,L1,L2"}
DROP = ("POIMEN_RERANK_URL", "POIMEN_OPENSEARCH_URL")
_SESSION = re.compile(r":[DS](\d+)(?::|#|$)")
_WORD = re.compile(r"[a-z]{4,}")


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "bench-fair",
        help="fair admission: three tenants' throughput alone and while a fourth attacks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data", type=Path, default=DATA_DEFAULT, metavar="DIR",
                   help="a LoCoMo-shaped folder: nodes.jsonl, queries.jsonl (default: "
                   "../shared/data/locomo-dev beside the repository)")  # fmt: skip
    p.add_argument("--sessions-per-project", type=int, default=1,
                   help="a conversation's sessions to a project (1: one each)")  # fmt: skip
    p.add_argument("--setups", default="none,share8,fair",
                   help="comma-separated admissions, a server each: "
                   f"{', '.join(SETUPS)}, or label:ENV=VALUE+ENV=VALUE")  # fmt: skip
    p.add_argument("--normal-concurrency", type=int, default=2, help="per normal key")
    p.add_argument("--costly-parallel", type=int, default=16)
    p.add_argument("--costly-chars", type=int, default=1950, help="each costly query's length")
    p.add_argument("--costly-timeout", type=float, default=30.0,
                   help="the costly queries' timeout_seconds")  # fmt: skip
    p.add_argument("--pause", type=float, default=0.05,
                   help="seconds a client waits after a refusal (429, 503) before its next "
                   "request: a client that ignores Retry-After but does not spin")  # fmt: skip
    p.add_argument("--seconds", type=float, default=20.0, help="per phase")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tenants", type=int, default=100,
                   help="Zipf-sized synthetic projects added beside the corpus's")  # fmt: skip
    p.add_argument("--keep-db", action="store_true", help="keep the database (its name is printed)")
    p.add_argument("--database", metavar="NAME",
                   help="use this database, loaded by an earlier run with --keep-db, as is "
                   "(never dropped)")  # fmt: skip
    p.add_argument("--json", type=Path, metavar="OUT")
    p.set_defaults(func=cmd_bench_fair)


# --- the corpus ---------------------------------------------------------------------------


@dataclass
class Corpus:
    records: list[dict[str, Any]]  # nodes.jsonl lines, projects rewritten
    projects: dict[str, list[str]]  # conversation -> its projects
    questions: dict[str, list[str]]  # conversation -> its questions
    words: list[str]  # distinct words of the texts, for the costly queries


def split_projects(
    nodes: Sequence[dict[str, Any]], per: int, whole: Sequence[str] = ()
) -> tuple[list[dict[str, Any]], dict[str, list[str]]]:
    """A project per conversation in ``whole`` (a tenant's); every other conversation split
    into ``<conversation>.s<first session of its group>``, ``per`` sessions to a project.
    Provenance stays inside a session (an observation cites its session's turns, a summary
    its session's observations); a parent in another project is dropped rather than
    crossing tenants."""
    out: list[dict[str, Any]] = []
    project_of: dict[str, str] = {}
    by_conversation: dict[str, set[str]] = {}
    for n in nodes:
        name = str(n["project"])
        if name not in whole:
            m = _SESSION.search(str(n["id"]))
            session = int(m.group(1)) if m else 1
            name = f"{name}.s{(session - 1) // per * per + 1:02d}"
        project_of[n["id"]] = name
        by_conversation.setdefault(n["project"], set()).add(name)
        out.append({**n, "project": name})
    for n in out:
        n["parents"] = [p for p in n.get("parents") or [] if project_of.get(p) == n["project"]]
    return out, {c: sorted(ps) for c, ps in sorted(by_conversation.items())}


def read_corpus(folder: Path, per: int, tenants: int = 4) -> Corpus:
    """The folder's nodes and questions; the first ``tenants`` conversations that have
    questions stay whole (a project a tenant), the rest are split (split_projects)."""
    if not (folder / "nodes.jsonl").is_file() or not (folder / "queries.jsonl").is_file():
        raise FileNotFoundError(f"{folder}: no nodes.jsonl and queries.jsonl (LoCoMo's shape)")
    nodes = [json.loads(x) for x in (folder / "nodes.jsonl").read_text().splitlines() if x]
    questions: dict[str, list[str]] = {}
    for line in (folder / "queries.jsonl").read_text().splitlines():
        if line:
            qy = json.loads(line)
            questions.setdefault(qy["project"], []).append(qy["text"])
    whole = sorted(c for c in {str(n["project"]) for n in nodes} if questions.get(c))[:tenants]
    records, projects = split_projects(nodes, per, whole)
    words = sorted({w for n in nodes for w in _WORD.findall(str(n["text"]).lower())})
    return Corpus(records, projects, {c: questions[c] for c in whole}, words)


def costly_texts(words: Sequence[str], n: int, chars: int, seed: int) -> list[str]:
    """n queries of distinct words (each word once in a query), each as long as fits in
    ``chars``: the most terms the length cap lets one plain query carry."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        pool = list(words)
        rng.shuffle(pool)
        text, used = [], 0
        for w in pool:
            if used + len(w) + 1 > chars:
                break
            text.append(w)
            used += len(w) + 1
        out.append(" ".join(text))
    return out


def _load(url: str, corpus: Corpus, s: Settings, tenants: int, seed: int) -> dict[str, Any]:
    """Ingests the corpus (the local embedder), then ``tenants`` Zipf-sized synthetic
    projects more (synthetic.add_tenants): a store many tenants share."""
    from poimen_lab.eval.data import load_nodes
    from poimen_memory.db.migrate import migrate
    from poimen_memory.embedders.factory import build_embedder
    from poimen_memory.ingest.writer import ingest

    embedder = build_embedder(s.embedding)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "nodes.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in corpus.records))
        records = load_nodes(path)
    with connect(url, autocommit=True) as conn:
        migrate(conn, s.plpython_root)
        report = ingest(
            conn, records, embedder, batch_size=s.ingest_batch,
            embed_group=s.ingest_embed_group, progress=False,
        )  # fmt: skip
        if tenants:
            synthetic.add_tenants(conn, tenants, TENANT_LARGEST, seed)  # VACUUM ANALYZEs
        else:
            conn.execute("VACUUM ANALYZE")
        ensure_service_login(conn, s.service_role)
    return {"ingest_seconds": round(report.seconds, 1), **_loaded(url, corpus)}


def _loaded(url: str, corpus: Corpus) -> dict[str, Any]:
    """What the database holds; an error unless every tenant's project is there."""
    with connect(url, autocommit=True) as conn:
        nodes, projects = conn.execute(
            "SELECT (SELECT count(*) FROM memory.nodes), (SELECT count(*) FROM memory.projects)"
        ).fetchone() or (0, 0)
        found = {r[0] for r in conn.execute("SELECT name FROM memory.projects")}
    missing = {p for c in corpus.questions for p in corpus.projects[c]} - found
    if missing:
        raise RuntimeError(f"the database lacks the tenants' projects {sorted(missing)}")
    return {"nodes": nodes, "projects": projects}


def make_keys(url: str, tenants: dict[str, list[str]]) -> dict[str, str]:
    """A read key per tenant for its projects, stored as `poimen-memory keys create`
    stores one."""
    from poimen_memory.api.auth import key_hash, new_key
    from poimen_memory.db.queries import q

    keys = {}
    with connect(url, autocommit=True) as conn:
        for name, projects in tenants.items():
            key = new_key()
            conn.execute(
                q("key_insert"),
                {"key_hash": key_hash(key), "prefix": key[:12], "projects": projects,
                 "can_write": False, "note": f"bench-fair {name}"},
            )  # fmt: skip
            keys[name] = key
    return keys


class ClusterCPU(CPU):
    """CPU (the server process and this database's sessions), plus what the postmaster's
    exited children spent (its cutime and cstime): the parallel workers a costly query
    starts live between two snapshots, and only the postmaster's reaped time keeps theirs.
    It also holds any other exited backend of the cluster's (none on a cluster of one's
    own)."""

    def __init__(self, server_pid: int, database_url: str) -> None:
        super().__init__(server_pid, database_url)
        with connect(database_url, autocommit=True) as conn:
            row = conn.execute("SHOW data_directory").fetchone()
        pid_file = Path(str(row[0] if row else "")) / "postmaster.pid"
        self.postmaster = int(pid_file.read_text().split()[0]) if pid_file.is_file() else None

    def snapshot(self) -> tuple[float, dict[int, float]]:
        server, backends = super().snapshot()
        if self.postmaster is not None:
            try:
                f = Path(f"/proc/{self.postmaster}/stat").read_text().rsplit(")", 1)[1].split()
                backends[-1] = (int(f[13]) + int(f[14])) / os.sysconf("SC_CLK_TCK")
            except OSError:
                pass
        return server, backends


# --- the load -----------------------------------------------------------------------------


def classify(status: int | None) -> str:
    """How a status is counted: 200, 429 (over the client's share), 503 (the service at
    capacity) by name, anything else as its number; None: no answer (a connection error)."""
    return "connection error" if status is None else str(status)


@dataclass
class Tally:
    """One client group's answers over a phase."""

    ok_ms: list[float] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: str, ms: float) -> None:
        with self.lock:
            self.statuses[kind] += 1
            if kind == "200":
                self.ok_ms.append(ms)


class Group:
    """``threads`` clients of one key, each on one keep-alive connection, sending back to
    back until ``stop`` is set; each waits ``pause`` after a refusal."""

    def __init__(
        self,
        base: str,
        key: str,
        texts: Sequence[str],
        params: dict[str, str],
        threads: int,
        pause: float,
        timeout_s: float,
    ) -> None:
        self.where = urlsplit(base)
        self.headers = {"Authorization": f"Bearer {key}"}
        self.texts, self.params, self.pause, self.timeout_s = texts, params, pause, timeout_s
        self.tally = Tally()
        self.stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]
        self._offset = random.randrange(len(texts))

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join()

    def _connect(self) -> http.client.HTTPConnection:
        host = self.where.hostname or "127.0.0.1"
        return http.client.HTTPConnection(host, self.where.port, timeout=self.timeout_s + 30)

    def _run(self, i: int) -> None:
        conn = self._connect()
        j = 0
        try:
            while not self.stop.is_set():
                text = self.texts[(self._offset + i * 7919 + j) % len(self.texts)]
                j += 1
                path = "/memory/query?" + urlencode({"query": text, **self.params})
                t0 = time.perf_counter()
                try:
                    conn.request("GET", path, headers=self.headers)
                    resp = conn.getresponse()
                    resp.read()
                    status: int | None = resp.status
                except (OSError, http.client.HTTPException):
                    status = None
                    conn.close()
                    conn = self._connect()
                self.tally.add(classify(status), (time.perf_counter() - t0) * 1000)
                if status != 200:
                    self.stop.wait(self.pause)
        finally:
            conn.close()


@dataclass
class Tenants:
    """The keys and what each sends."""

    normal: dict[str, tuple[str, list[str]]]  # name -> (key, questions)
    costly: tuple[str, list[str]]  # (key, texts)


def phase(
    base: str,
    tenants: Tenants,
    *,
    seconds: float,
    attack: bool,
    concurrency: int,
    parallel: int,
    pause: float,
    costly_timeout: float,
    cpu: CPU | None = None,
) -> dict[str, Any]:
    """The normal keys for ``seconds``, with the costly key too when ``attack``: per key its
    200s a second, 200 latencies and statuses; the server's and database's CPU."""
    normal_params = {"timeout_seconds": "5"}
    costly_params = {**COSTLY, "timeout_seconds": f"{costly_timeout:g}"}
    groups = {
        name: Group(base, key, texts, normal_params, concurrency, pause, 5.0)
        for name, (key, texts) in tenants.normal.items()
    }
    attacker = None
    if attack:
        key, texts = tenants.costly
        attacker = Group(base, key, texts, costly_params, parallel, pause, costly_timeout)
    before = cpu.snapshot() if cpu else None
    t0 = time.perf_counter()
    if attacker:
        attacker.start()
    for g in groups.values():
        g.start()
    time.sleep(seconds)
    for g in groups.values():
        g.join()
    wall = time.perf_counter() - t0
    if attacker:
        attacker.join()  # its requests still in flight end (at their deadline at worst)
    spent = cpu.spent(before, cpu.snapshot()) if cpu and before else None
    out: dict[str, Any] = {"wall_s": round(wall, 2), "keys": {}}
    answered = 0
    for name, g in [*groups.items(), *([("costly", attacker)] if attacker else [])]:
        ok = g.tally.ok_ms
        answered += len(ok)
        out["keys"][name] = {
            "ok_per_s": round(len(ok) / wall, 2),
            "ok_ms": [round(x, 1) for x in ok],
            "statuses": dict(sorted(g.tally.statuses.items())),
        }
    if spent is not None:
        total_wall = time.perf_counter() - t0
        out["server_cpu_s"], out["database_cpu_s"] = round(spent[0], 2), round(spent[1], 2)
        out["cpu_cores_busy"] = round((spent[0] + spent[1]) / total_wall, 2)
        out["server_cpu_ms_per_200"] = round(spent[0] * 1000 / max(answered, 1), 1)
        out["database_cpu_ms_per_200"] = round(spent[1] * 1000 / max(answered, 1), 1)
    return out


def probe(
    base: str, cpu: CPU | None, tenants: Tenants, n: int, costly_timeout: float
) -> dict[str, Any]:
    """One request at a time, n of each kind (a normal key's question, a costly query) on an
    idle server: what each costs alone, in wall time and CPU."""
    out: dict[str, Any] = {}
    key0, texts0 = next(iter(tenants.normal.values()))
    kinds = {
        "normal": (key0, texts0, {"timeout_seconds": "5"}),
        "costly": (tenants.costly[0], tenants.costly[1],
                   {**COSTLY, "timeout_seconds": f"{costly_timeout:g}"}),
    }  # fmt: skip
    for kind, (key, texts, params) in kinds.items():
        g = Group(base, key, texts, params, 1, 0.0, costly_timeout)
        before = cpu.snapshot() if cpu else None
        conn = g._connect()
        try:
            for i in range(n):
                path = "/memory/query?" + urlencode({"query": texts[-1 - i], **params})
                t0 = time.perf_counter()
                conn.request("GET", path, headers=g.headers)
                resp = conn.getresponse()
                resp.read()
                g.tally.add(classify(resp.status), (time.perf_counter() - t0) * 1000)
        finally:
            conn.close()
        row: dict[str, Any] = {
            "p50_ms": round(percentile(g.tally.ok_ms, 50), 1) if g.tally.ok_ms else None,
            "statuses": dict(g.tally.statuses),
        }
        if cpu and before:
            server, database = cpu.spent(before, cpu.snapshot())
            row["server_cpu_ms"] = round(server * 1000 / n, 1)
            row["database_cpu_ms"] = round(database * 1000 / n, 1)
        out[kind] = row
    return out


def run(
    servers: Mapping[str, tuple[str, CPU | None]],
    tenants: Tenants,
    *,
    rounds: int,
    seconds: float,
    concurrency: int = 2,
    parallel: int = 16,
    pause: float = 0.05,
    costly_timeout: float = 30.0,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, list[dict[str, Any]]]:
    """Rounds of (alone, under attack) for each server, the servers' order reversed every
    other round: per server, its phases in order."""
    out: dict[str, list[dict[str, Any]]] = {label: [] for label in servers}
    labels = list(servers)
    for r in range(rounds):
        for label in labels if r % 2 == 0 else labels[::-1]:
            base, cpu = servers[label]
            for attack in (False, True):
                log(f"round {r + 1}/{rounds}, {label}, {'under attack' if attack else 'alone'}")
                res = phase(
                    base, tenants, seconds=seconds, attack=attack, concurrency=concurrency,
                    parallel=parallel, pause=pause, costly_timeout=costly_timeout, cpu=cpu,
                )  # fmt: skip
                out[label].append({"round": r + 1, "attack": attack, **res})
    return out


def _median(xs: Sequence[float]) -> float | None:
    return round(statistics.median(xs), 2) if xs else None


def summarise(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """One server's phases: per key, the medians over rounds of its 200s a second alone and
    under attack and their ratio, the p50/p95 of every 200's latency over the rounds, its
    statuses summed; the median CPU per answered request, alone and under attack."""
    keys: dict[str, Any] = {}
    cpu: dict[str, Any] = {}
    for attack, tag in ((False, "alone"), (True, "attack")):
        mine = [p for p in phases if p["attack"] is attack]
        for p in mine:
            for name, k in p["keys"].items():
                row = keys.setdefault(name, {})
                row.setdefault(f"{tag}_per_s", []).append(k["ok_per_s"])
                row.setdefault(f"{tag}_ms", []).extend(k["ok_ms"])
                st = row.setdefault(f"{tag}_statuses", Counter())
                st.update(k["statuses"])
        for f in ("server_cpu_ms_per_200", "database_cpu_ms_per_200", "cpu_cores_busy"):
            cpu[f"{tag}_{f}"] = _median([p[f] for p in mine if f in p])
    out: dict[str, Any] = {}
    for name, row in keys.items():
        s: dict[str, Any] = {}
        for tag in ("alone", "attack"):
            if f"{tag}_per_s" not in row:
                continue
            ms = row[f"{tag}_ms"]
            s[f"{tag}_per_s"] = _median(row[f"{tag}_per_s"])
            s[f"{tag}_per_s_rounds"] = row[f"{tag}_per_s"]
            s[f"{tag}_p50_ms"] = round(percentile(ms, 50), 1) if ms else None
            s[f"{tag}_p95_ms"] = round(percentile(ms, 95), 1) if ms else None
            s[f"{tag}_statuses"] = dict(sorted(row[f"{tag}_statuses"].items()))
        if s.get("alone_per_s") and s.get("attack_per_s") is not None:
            s["ratio"] = round(s["attack_per_s"] / s["alone_per_s"], 2)
        out[name] = s
    return {"keys": out, "cpu": cpu}


def _statuses(st: dict[str, int] | None) -> str:
    return ", ".join(f"{k}: {v}" for k, v in (st or {}).items()) or "-"


HEADER = ["admission", "key", "q/s alone", "q/s attacked", "ratio", f">= {GOAL}",
          "p50 ms alone", "p95 ms alone", "p50 ms attacked", "p95 ms attacked",
          "statuses alone", "statuses attacked"]  # fmt: skip
CPU_HEADER = ["admission", "cores busy alone", "server ms/200", "database ms/200",
              "cores busy attacked", "server ms/200", "database ms/200"]  # fmt: skip
CPU_FIELDS = ("cpu_cores_busy", "server_cpu_ms_per_200", "database_cpu_ms_per_200")


def report(summaries: dict[str, dict[str, Any]]) -> str:
    rows = []
    for label, sm in summaries.items():
        for name, k in sm["keys"].items():
            ratio = k.get("ratio")
            rows.append([
                label, name, k.get("alone_per_s"), k.get("attack_per_s"), ratio,
                "-" if ratio is None else ("yes" if ratio >= GOAL else "NO"),
                k.get("alone_p50_ms"), k.get("alone_p95_ms"),
                k.get("attack_p50_ms"), k.get("attack_p95_ms"),
                _statuses(k.get("alone_statuses")), _statuses(k.get("attack_statuses")),
            ])  # fmt: skip
    cpu = [
        [label] + [sm["cpu"].get(f"{tag}_{f}") for tag in ("alone", "attack") for f in CPU_FIELDS]
        for label, sm in summaries.items()
    ]
    return table(rows, HEADER) + "\n\n" + table(cpu, CPU_HEADER)


def parse_setups(raw: str) -> dict[str, dict[str, str]]:
    """``--setups``: label -> the environment its server gets; ValueError when an entry is
    neither a known name nor ``label:ENV=VALUE+...``."""
    out: dict[str, dict[str, str]] = {}
    for item in filter(None, (x.strip() for x in raw.split(","))):
        label, sep, spec = item.partition(":")
        if not sep:
            if item not in SETUPS:
                raise ValueError(f"unknown setup {item!r}")
            out[item] = SETUPS[item]
            continue
        env = dict(kv.split("=", 1) for kv in spec.split("+") if "=" in kv)
        if not label or not env or not all(k.startswith("POIMEN_") for k in env):
            raise ValueError(f"setup {item!r}: label:POIMEN_X=VALUE+POIMEN_Y=VALUE")
        out[label] = env
    if not out:
        raise ValueError("no setup")
    return out


def cmd_bench_fair(args: argparse.Namespace) -> int:
    try:
        setups = parse_setups(args.setups)
    except ValueError as e:
        print(f"error: --setups: {e}", file=sys.stderr)
        return 2
    if (
        not 0 < args.seconds <= 120
        or not 1 <= args.rounds <= 10
        or not 1 <= args.normal_concurrency <= 16
        or not 1 <= args.costly_parallel <= 64
        or args.sessions_per_project < 1
        or args.tenants < 0
    ):
        print(
            "error: 0 < --seconds <= 120, --rounds 1..10, "
            "--normal-concurrency 1..16, --costly-parallel 1..64, --sessions-per-project >= 1",
            file=sys.stderr,
        )
        return 2
    try:
        corpus = read_corpus(args.data, args.sessions_per_project)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if len(corpus.questions) < 4:
        print(f"error: {args.data} has {len(corpus.questions)} conversations with questions; "
              "the benchmark needs 4 (a tenant each)", file=sys.stderr)  # fmt: skip
        return 2
    random.seed(args.seed)
    s = Settings.from_env()
    server_url = database_url(s, start=True)
    if args.database:
        name, url = args.database, make_conninfo(server_url, dbname=args.database)
    else:
        name, url = fresh_database(server_url)
    result: dict[str, Any] = {"data": str(args.data), "seconds": args.seconds,
                              "rounds": args.rounds, "setups": setups}  # fmt: skip
    try:
        if args.database:
            result["corpus"] = _loaded(url, corpus)
        else:
            print(f"bench-fair: loading {len(corpus.records)} nodes", file=sys.stderr)
            result["corpus"] = _load(url, corpus, s, args.tenants, args.seed)
        names = ["normal-1", "normal-2", "normal-3", "costly"]
        owners = dict(zip(names, corpus.questions, strict=True))
        keys = make_keys(url, {n: corpus.projects[c] for n, c in owners.items()})
        result["tenants"] = owners
        tenants = Tenants(
            normal={n: (keys[n], corpus.questions[owners[n]]) for n in names[:3]},
            costly=(keys["costly"],
                    costly_texts(corpus.words, 200, args.costly_chars, args.seed)),
        )  # fmt: skip
        service = make_conninfo(url, user=s.service_role)
        with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
            servers: dict[str, tuple[str, CPU | None]] = {}
            for i, (label, extra) in enumerate(setups.items()):
                env = {"POIMEN_DATABASE_URL": service, "POIMEN_EMBED_CACHE_SIZE": "0", **extra}
                base, pid = stack.enter_context(
                    live_server_process(env, Path(tmp) / f"server-{i}.log", drop=DROP)
                )
                servers[label] = (base, ClusterCPU(pid, url))
            print("bench-fair: warm-up (discarded)", file=sys.stderr)
            warm = {label: (base, None) for label, (base, _) in servers.items()}
            run(warm, tenants, rounds=1, seconds=2.0, concurrency=args.normal_concurrency,
                parallel=2, pause=args.pause, costly_timeout=args.costly_timeout)  # fmt: skip
            print("bench-fair: one request at a time, each kind (probe)", file=sys.stderr)
            first = next(iter(servers.values()))
            result["alone_one_at_a_time"] = probe(*first, tenants, 5, args.costly_timeout)
            result["phases"] = run(
                servers, tenants, rounds=args.rounds, seconds=args.seconds,
                concurrency=args.normal_concurrency, parallel=args.costly_parallel,
                pause=args.pause, costly_timeout=args.costly_timeout,
                log=lambda m: print(f"bench-fair: {m}", file=sys.stderr),
            )  # fmt: skip
    finally:
        if args.keep_db or args.database:
            print(f"bench-fair: database {name} kept", file=sys.stderr)
        else:
            drop_database(server_url, name)
    result["summary"] = {label: summarise(p) for label, p in result["phases"].items()}
    c = result["corpus"]
    print(f"{c['nodes']} nodes in {c['projects']} projects; {args.rounds} rounds of "
          f"{args.seconds:g} s a phase; medians over rounds; CPU per 200 answered")  # fmt: skip
    for kind, pr in result["alone_one_at_a_time"].items():
        print(f"one {kind} query at a time: p50 {pr['p50_ms']} ms, CPU "
              f"{pr.get('server_cpu_ms')} ms server + {pr.get('database_cpu_ms')} ms database "
              f"({_statuses(pr['statuses'])})")  # fmt: skip
    print(report(result["summary"]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
