"""The examples in docs/*.md, parsed out of the Markdown so tests/test_docs_examples.py can
run them (docs cannot drift from the product).

What counts as an example, in a fenced block (``` or ```lang, possibly indented in a list):

- **a psql transcript**: a block with a line starting ``=# `` (the schema's owner) or
  ``=> `` (another role, after ``SET ROLE``). A statement is the prompt line plus the
  following lines up to the first one ending in ``;`` (a trailing ``-- comment`` ignored); a
  psql meta-command (``=# \\set ...``) is its own line. ``$ `` starts a shell command instead
  (continued by a trailing ``\\``), run between two psql sessions (so settings made before
  it do not carry over). A prompt line holding only a comment (``=# -- the same
  call again``) runs the previous statement again. The statement's expected output is every
  line after it up to the next prompt line or the closing fence, trailing blank lines
  dropped: psql's own text (``psql -X -q``, aligned, ``footer=off``, ``SHOW_CONTEXT
  never``), NOTICE/ERROR/DETAIL/HINT lines included. A statement with no output lines is
  only checked to run without an ERROR.
- **a SQL script**: a ```sql block without prompts. Its statements must all run, in one
  transaction that is rolled back.
- **an HTTP example**: a block whose lines start ``$ curl`` (the output follows, as above);
  or a block of URLs of the docs' server (``http://127.0.0.1:8765/...``, one a line), each
  of which must answer 200.

A block may be preceded (blank lines between allowed) by one marker, an HTML comment that
the rendered page hides but the test reads::

    <!-- example: setup=no-embedder; varies=ms -->

with ``;``-separated items, each ``key=value[,value...]`` or a bare flag:

- ``setup=NAME,...``: the test prepares the block's database before the block;
  the names are `tests/test_docs_examples.py`'s SETUPS.
- ``roles=a,b``: NOLOGIN roles the block refers to (cluster-wide, created if missing).
- ``data=locomo-dev``: needs data that is not in this repository; skipped, saying so, when
  it is absent.
- ``varies=COL,...``: the values of these result columns (or, for ``seconds``, every
  ``<number> s`` in a NOTICE) differ from run to run: the rest, headers and row count
  included, is compared exactly.
- ``abridged``: a line ``…`` in the expected output stands for any number of lines.
- ``subset``: (an HTTP example) every line shown is among the lines produced, in order; in a
  line whose first word contains a ``varies`` item, only that first word is compared (a
  Prometheus sample's name and labels, not its value).
- ``skip=REASON``: not run at all; the reason is the skip's.
- ``request-log``: (a ```json block) the request-log line of the previous block's request:
  its keys, and the values not named by ``varies``, are compared.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"

FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*example:\s*(?P<body>.*?)\s*-->\s*$")
PROMPT = re.compile(r"^(?P<prompt>=#|=>|\$) (?P<text>.*)$")
ELLIPSIS = ("…", "...")
DOC_SERVER = "http://127.0.0.1:8765"  # the `make demo` server the docs' HTTP examples name


@dataclass
class Statement:
    prompt: str  # '=#', '=>' or '$'
    text: str  # as sent: prompt removed, continuation lines as written
    expected: list[str]  # the output lines shown (fence indent removed)
    line: int  # 1-based line of the prompt in the doc
    output_lines: tuple[int, int]  # [start, end) 0-based doc lines of the output shown
    repeat: bool = False  # `=# -- ...` alone: the previous statement again

    @property
    def shell(self) -> bool:
        return self.prompt == "$"


@dataclass
class Example:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    kind: str  # 'psql', 'sql-script', 'http', 'http-urls', 'request-log'
    indent: str
    body: list[str]  # lines inside the fence, indent removed
    markers: dict[str, list[str]] = field(default_factory=dict)
    statements: list[Statement] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.path.name}:{self.line}"

    def marker(self, key: str) -> list[str]:
        return self.markers.get(key, [])

    def flag(self, key: str) -> bool:
        return key in self.markers


def parse_marker(body: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item in filter(None, (i.strip() for i in body.split(";"))):
        key, _, value = item.partition("=")
        key = key.strip()
        if key in ("skip",):
            out[key] = [value.strip()]
        else:
            out[key] = [v.strip() for v in value.split(",") if v.strip()] if value else []
    return out


def _ends_statement(line: str) -> bool:
    code = re.sub(r"\s--\s.*$|^--\s.*$", "", line).rstrip()
    return code.endswith(";")


def _parse_transcript(ex: Example, first_line: int) -> None:
    """first_line: 0-based doc line of body[0]."""
    body = ex.body
    i = 0
    previous: Statement | None = None
    while i < len(body):
        m = PROMPT.match(body[i])
        if not m:
            i += 1
            continue
        start = i
        prompt, text = m.group("prompt"), m.group("text")
        lines = [text]
        repeat = False
        if prompt == "$":
            while lines[-1].endswith("\\") and i + 1 < len(body):
                i += 1
                lines.append(body[i])
        elif text.startswith("\\"):
            pass  # a meta-command: one line
        elif re.fullmatch(r"--.*", text.strip()):
            repeat = True
        else:
            while not _ends_statement(lines[-1]) and i + 1 < len(body):
                i += 1
                lines.append(body[i])
        i += 1
        out_start = i
        while i < len(body) and not PROMPT.match(body[i]):
            i += 1
        out_end = i
        while out_end > out_start and not body[out_end - 1].strip():
            out_end -= 1
        stmt = Statement(
            prompt=prompt,
            text=(previous.text if repeat and previous else "\n".join(lines)),
            expected=body[out_start:out_end],
            line=first_line + start + 1,
            output_lines=(first_line + out_start, first_line + out_end),
            repeat=repeat,
        )
        ex.statements.append(stmt)
        if not repeat:
            previous = stmt


def _split_script(body: list[str]) -> list[str]:
    statements: list[str] = []
    current: list[str] = []
    for line in body:
        if not current and (not line.strip() or line.strip().startswith("--")):
            continue
        current.append(line)
        if _ends_statement(line):
            statements.append("\n".join(current))
            current = []
    if current:
        statements.append("\n".join(current))
    return statements


def parse(path: Path) -> list[Example]:
    lines = path.read_text().splitlines()
    examples: list[Example] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group("indent"), m.group("lang")
        start = i
        j = i + 1
        while j < len(lines) and not (
            lines[j].startswith(indent + "```") and lines[j].strip() == "```"
        ):
            j += 1
        body = [
            line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : j]
        ]
        markers: dict[str, list[str]] = {}
        k = start - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        if k >= 0 and (mm := MARKER.match(lines[k])):
            markers = parse_marker(mm.group("body"))
        kind = ""
        if any(re.match(r"^(=#|=>) ", b) for b in body):
            kind = "psql"
        elif any(b.startswith("$ curl ") for b in body):
            kind = "http"
        elif lang == "sql":
            kind = "sql-script"
        elif body and all(b.startswith(DOC_SERVER + "/") for b in body if b.strip()):
            kind = "http-urls"
        elif lang == "json" and "request-log" in markers:
            kind = "request-log"
        if kind:
            ex = Example(path, start + 1, lang, kind, indent, body, markers)
            if kind in ("psql", "http"):
                _parse_transcript(ex, start + 1)
            elif kind == "sql-script":
                ex.statements = [
                    Statement("", s, [], start + 1, (start + 1, start + 1))
                    for s in _split_script(body)
                ]
            examples.append(ex)
        i = j + 1
    return examples


def all_examples(docs: Path = DOCS) -> list[Example]:
    return [ex for path in sorted(docs.glob("*.md")) for ex in parse(path)]


# ---- psql's aligned output, read back -------------------------------------------------


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]


def split_output(lines: list[str]) -> list[str | Table]:
    """Messages (NOTICE/ERROR/... lines, kept as text) and tables (header, rows)."""
    parts: list[str | Table] = []
    i = 0
    while i < len(lines):
        if i + 1 < len(lines) and re.fullmatch(r"-+(\+-+)*", lines[i + 1].strip()):
            header = [c.strip() for c in lines[i].split("|")]
            rows = []
            i += 2
            while i < len(lines) and not re.match(r"^[A-Z]+:  ", lines[i]):
                rows.append([c.strip() for c in lines[i].split("|")])
                i += 1
            parts.append(Table(header, rows))
        else:
            parts.append(lines[i].rstrip())
            i += 1
    return parts


def normalise(lines: list[str]) -> list[str]:
    out = [line.rstrip() for line in lines]
    while out and not out[-1]:
        out.pop()
    return out


def matches_abridged(expected: list[str], actual: list[str]) -> bool:
    """`…` alone on an expected line matches any run of actual lines (none included)."""
    if not expected:
        return not actual
    head, rest = expected[0], expected[1:]
    if head.strip() in ELLIPSIS:
        return any(matches_abridged(rest, actual[k:]) for k in range(len(actual) + 1))
    return bool(actual) and head == actual[0] and matches_abridged(rest, actual[1:])


SECONDS = re.compile(r"\d+(\.\d+)? s\b")


def compare_varying(expected: list[str], actual: list[str], varies: list[str]) -> list[str]:
    """Differences, with the values of the `varies` columns (and `seconds`) not compared."""
    problems: list[str] = []
    exp, act = split_output(expected), split_output(actual)
    if len(exp) != len(act):
        return [f"{len(exp)} output parts shown, {len(act)} produced"]
    for e, a in zip(exp, act, strict=True):
        if isinstance(e, Table) and isinstance(a, Table):
            if e.header != a.header:
                problems.append(f"columns {e.header} shown, {a.header} produced")
                continue
            if len(e.rows) != len(a.rows):
                problems.append(f"{len(e.rows)} rows shown, {len(a.rows)} produced")
                continue
            keep = [n for n, h in enumerate(e.header) if h not in varies]
            for er, ar in zip(e.rows, a.rows, strict=True):
                if [er[n] for n in keep if n < len(er)] != [ar[n] for n in keep if n < len(ar)]:
                    problems.append(f"row {er} shown, {ar} produced")
        elif isinstance(e, str) and isinstance(a, str):
            if "seconds" in varies:
                e, a = SECONDS.sub("… s", e), SECONDS.sub("… s", a)
            if e != a:
                problems.append(f"line {e!r} shown, {a!r} produced")
        else:
            problems.append(f"{e!r} shown, {a!r} produced")
    return problems
