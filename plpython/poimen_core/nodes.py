"""The memory-node format (see docs/ingest.md), its content-addressed key and the rules a
batch of nodes must satisfy.

Stdlib only and written once for both writers: the service's ingest (CLI and HTTP, through
poimen_memory.ingest) and memory.add_nodes inside PostgreSQL (poimen_core.addnodes), so a
node the one refuses the other refuses too, for the same reason.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import unicodedata
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Protocol

from poimen_core import vocabulary
from poimen_core.vocabulary import LEVELS as LEVELS

HASH_VERSION = "poimen-node/1"
MAX_TEXT_CHARS = 100_000
MAX_JSON_DEPTH = 32  # nesting of a node's JSON (metadata included)
# Bounds on the other fields, so that every write fits its indexes (an external id is a
# btree key, at most 2,704 bytes: 512 characters of up to 4 UTF-8 bytes stay below) and
# every answer that carries a node stays bounded too.
MAX_ID_CHARS = 512
MAX_PARENTS = 256
MAX_TITLE_CHARS = 1_000
MAX_SOURCE_CHARS = 2_048
MAX_BREADCRUMB = 32  # items, each at most MAX_TITLE_CHARS
MAX_METADATA_BYTES = 16_384  # compact JSON, UTF-8
# The keys of a node that parse_line reads (POST /memory/nodes' Node schema declares each:
# tests/test_contract.py); other keys are ignored, as nodes.jsonl files carry extras.
NODE_FIELDS = (
    "id", "level", "project", "text", "title", "source", "timestamp", "parents",
    "breadcrumb", "metadata", "revision", "valid_from", "valid_to", "expires_at",
)  # fmt: skip


@dataclass(frozen=True)
class NodeRecord:
    line_no: int
    project: str
    level: str
    text: str
    external_id: str | None = None
    title: str | None = None
    source: str | None = None
    timestamp: datetime | None = None
    breadcrumb: tuple[str, ...] = ()
    parents: tuple[str, ...] = ()
    metadata: dict[str, Any] = field(default_factory=dict)
    # The revision the writer read (0: the id must have no current version); not content,
    # so not in the hash. None: write on top of whatever is current.
    revision: int | None = None
    # Valid time: when the fact held in the world (None: unbounded). Content: the same text
    # with a new bound ("until 2024-06") is a new version.
    valid_from: datetime | None = None
    valid_to: datetime | None = None
    # When the node leaves answers (None: never, or its project's retention). Not content,
    # as metadata: not in the hash.
    expires_at: datetime | None = None
    # Hashed as a node without an id: set (adopt_stored_hashes) when the id names a node
    # that was written without one, whose generated id is not in its stored hash.
    hashed_without_id: bool = False

    @property
    def sha256(self) -> bytes:
        return node_sha256(
            self.project, self.level, None if self.hashed_without_id else self.external_id,
            self.source, self.title, self.text,
            timestamp_text(self.valid_from), timestamp_text(self.valid_to),
        )  # fmt: skip


def timestamp_text(ts: datetime | None) -> str | None:
    """A node's timestamp as PostgreSQL input text, for both writers. An aware one goes as
    its UTC instant: Python accepts UTC offsets PostgreSQL's input refuses (beyond +-15:59,
    e.g. +21:42). A naive one stays naive and is read in the session's TimeZone."""
    if ts is None:
        return None
    return (ts.astimezone(UTC) if ts.tzinfo is not None else ts).isoformat()


def write_row(r: NodeRecord) -> dict[str, Any]:
    """A validated record as memory._write_nodes takes it (one element of its JSON array)."""
    return {
        "sha256": r.sha256.hex(),
        "project": r.project,
        "level": r.level,
        "external_id": r.external_id,
        "title": r.title,
        "breadcrumb": list(r.breadcrumb),
        "text": r.text,
        "source": r.source,
        "ts": timestamp_text(r.timestamp),
        "metadata": r.metadata,
        "parents": list(r.parents),
        "revision": r.revision,
        "valid_from": timestamp_text(r.valid_from),
        "valid_to": timestamp_text(r.valid_to),
        "expires_at": timestamp_text(r.expires_at),
    }


def node_sha256(
    project: str,
    level: str,
    external_id: str | None,
    source: str | None,
    title: str | None,
    text: str,
    valid_from: str | None = None,
    valid_to: str | None = None,
) -> bytes:
    """Canonical form: the UTF-8 of the compact JSON array
    ["poimen-node/1", project, level, external_id, source, title, NFC(text)], with nulls as "",
    and, only when the node has a valid time, its two bounds after it (so every key made
    before valid time existed is unchanged).

    Identical input gives the identical key (re-ingest is a no-op); the external id and
    source keep two equal texts from different places distinct.
    """
    canonical = [
        HASH_VERSION,
        project,
        level,
        external_id or "",
        source or "",
        title or "",
        unicodedata.normalize("NFC", text),
    ]
    if valid_from is not None or valid_to is not None:
        canonical += [valid_from or "", valid_to or ""]
    data = json.dumps(canonical, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(data).digest()


@dataclass(frozen=True)
class LineError:
    line_no: int
    field: str
    message: str

    def __str__(self) -> str:
        return self.describe("line")

    def describe(self, unit: str) -> str:
        """``unit`` names what line_no counts: a JSONL "line", or a "node" of a JSON array."""
        return f"{unit} {self.line_no}: field '{self.field}': {self.message}"


def _finite(text: str) -> float:
    value = float(text)  # 1e400 parses to inf, which jsonb cannot store either
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of the range of a JSON number PostgreSQL stores")
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def loads(raw: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads that refuses NaN/Infinity (PostgreSQL jsonb cannot store them) and input
    nested deeper than MAX_JSON_DEPTH (before the parser's own recursion limit)."""
    depth = level = 0
    in_string = escaped = False
    for ch in raw:  # a cheap scan: brackets outside strings
        if in_string:
            escaped = not escaped and ch == "\\"
            in_string = escaped or ch != '"'
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            level += 1
            depth = max(depth, level)
        elif ch in "]}":
            level -= 1
    if depth > max_depth:
        raise ValueError(f"nested deeper than {max_depth} levels")
    return json.loads(
        raw,
        parse_constant=_reject_constant,
        parse_float=_finite,
        parse_int=_whole,
        object_pairs_hook=unique_object,
    )


class RepeatedKey(ValueError):
    """A JSON object names one key twice."""


def unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different: json keeps the last of a repeated key,
    so {"project": "a", "project": "b"} was read as b by us and as a by anything that reads
    the first (a gateway, an audit log). Refused, as a repeated query parameter is."""
    out = dict(pairs)
    if len(out) < len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise RepeatedKey(f"key {key!r} is given more than once in an object")
            seen.add(key)
    return out


def _whole(text: str) -> int:
    """A JSON integer, refused in our words past Python's digit limit (its own message
    names sys.set_int_max_str_digits(), the server's business, not the caller's)."""
    limit: int = getattr(sys, "get_int_max_str_digits", lambda: 0)()
    digits = len(text) - text.startswith("-")
    if limit and digits > limit:
        raise ValueError(f"a whole number of {digits} digits (at most {limit})")
    return int(text)


def _bad_text(value: Any) -> str | None:
    """What PostgreSQL text cannot hold: NUL, and lone UTF-16 surrogates (not UTF-8)."""
    if isinstance(value, str):
        if "\x00" in value:
            return "contains a NUL character (\\u0000)"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "contains an unpaired surrogate (not valid Unicode)"
        return None
    if isinstance(value, dict):
        items: list[Any] = [*value.keys(), *value.values()]
        return next((m for m in map(_bad_text, items) if m), None)
    if isinstance(value, list):
        return next((m for m in map(_bad_text, value) if m), None)
    return None


def _opt_str(
    obj: dict[str, Any], key: str, line_no: int, errors: list[LineError], most: int
) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        errors.append(
            LineError(line_no, key, f"must be a string or null, got {type(value).__name__}")
        )
        return None
    if len(value) > most:
        errors.append(LineError(line_no, key, f"longer than {most} characters"))
        return None
    return value


def _blank(text: str) -> bool:
    """Nothing but white space, controls and format characters (a zero-width space or a
    BOM is not white space to str.strip, yet it is nothing to search or cite either)."""
    return all(ch.isspace() or unicodedata.category(ch) in ("Cc", "Cf") for ch in text)


def _id_problem(value: Any) -> str | None:
    """Why ``value`` cannot be a node id (an id or a parent), or None. Strings only: a JSON
    number would be stored as its text, and 12345 and 12345.0 would not name one node."""
    if not isinstance(value, str):
        return f"must be a string, got {type(value).__name__}"
    if _blank(value):
        return "must not be empty or blank"
    if len(value) > MAX_ID_CHARS:
        return f"longer than {MAX_ID_CHARS} characters"
    return None


def parse_line(raw: str, line_no: int, default_project: str | None) -> NodeRecord | list[LineError]:
    errors: list[LineError] = []
    try:
        obj = loads(raw)
    except json.JSONDecodeError as exc:
        return [LineError(line_no, "<json>", f"not valid JSON: {exc.msg} at column {exc.colno}")]
    except ValueError as exc:
        return [LineError(line_no, "<json>", str(exc))]
    if not isinstance(obj, dict):
        return [LineError(line_no, "<json>", "each node must be a JSON object")]
    text = obj.get("text")
    if not isinstance(text, str) or _blank(text):
        errors.append(LineError(line_no, "text", "required, a non-empty string"))
    elif len(text) > MAX_TEXT_CHARS:
        errors.append(LineError(line_no, "text", f"longer than {MAX_TEXT_CHARS} characters"))
    level = obj.get("level")
    if level not in LEVELS:
        errors.append(LineError(line_no, "level", f"must be one of L0, L1, L2, got {level!r}"))
    project = _opt_str(obj, "project", line_no, errors, 128) or default_project
    if not project:
        errors.append(LineError(line_no, "project", "required (or pass --project)"))
    elif not vocabulary.PROJECT_NAME_RE.fullmatch(project):  # as memory.projects CHECK
        errors.append(
            LineError(line_no, "project", f"{project!r} is not a valid project name "
                      "(letters, digits, _ . : -; at most 128; starts alphanumeric)")
        )  # fmt: skip
    ext_id = obj.get("id")
    id_problem = None if ext_id is None else _id_problem(ext_id)
    if id_problem:
        errors.append(LineError(line_no, "id", id_problem))
    ts = _instant(obj, "timestamp", line_no, errors)
    valid_from = _instant(obj, "valid_from", line_no, errors)
    valid_to = _instant(obj, "valid_to", line_no, errors)
    expires_at = _instant(obj, "expires_at", line_no, errors)
    if valid_from is not None and valid_to is not None:
        try:
            ordered = _as_utc(valid_from) < _as_utc(valid_to)
        except TypeError:  # one naive, one aware: PostgreSQL reads both as instants
            ordered = True
        if not ordered:
            errors.append(LineError(line_no, "valid_to", "must be after valid_from"))
    parents = obj.get("parents")
    parents = [] if parents is None else parents
    if not isinstance(parents, list):
        errors.append(LineError(line_no, "parents", "must be a list of node ids"))
        parents = []
    elif len(parents) > MAX_PARENTS:
        errors.append(LineError(line_no, "parents", f"more than {MAX_PARENTS} parents"))
        parents = []
    else:
        problem = next(((i, m) for i, p in enumerate(parents) if (m := _id_problem(p))), None)
        if problem:
            errors.append(LineError(line_no, "parents", f"parent {problem[0]} {problem[1]}"))
            parents = []
    breadcrumb = obj.get("breadcrumb")
    breadcrumb = [] if breadcrumb is None else breadcrumb
    if not isinstance(breadcrumb, list) or not all(isinstance(b, str) for b in breadcrumb):
        errors.append(LineError(line_no, "breadcrumb", "must be a list of strings"))
        breadcrumb = []
    elif len(breadcrumb) > MAX_BREADCRUMB or any(len(b) > MAX_TITLE_CHARS for b in breadcrumb):
        errors.append(LineError(line_no, "breadcrumb", f"at most {MAX_BREADCRUMB} items of "
                                f"at most {MAX_TITLE_CHARS} characters"))  # fmt: skip
        breadcrumb = []
    metadata = obj.get("metadata")
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict):
        errors.append(LineError(line_no, "metadata", "must be a JSON object"))
        metadata = {}
    elif len(json.dumps(metadata, ensure_ascii=False, separators=(",", ":")).encode(
        "utf-8", "surrogatepass"
    )) > MAX_METADATA_BYTES:  # fmt: skip
        errors.append(LineError(line_no, "metadata", f"larger than {MAX_METADATA_BYTES} bytes "
                                "as compact JSON"))  # fmt: skip
        metadata = {}
    revision = obj.get("revision")
    if revision is not None and (
        isinstance(revision, bool) or not isinstance(revision, int) or not 0 <= revision < 2**31
    ):
        errors.append(LineError(line_no, "revision", "must be a whole number >= 0 or null"))
        revision = None
    title = _opt_str(obj, "title", line_no, errors, MAX_TITLE_CHARS)
    source = _opt_str(obj, "source", line_no, errors, MAX_SOURCE_CHARS)
    bad = _bad_text(obj)
    if bad:
        # PostgreSQL text and jsonb cannot store it; say so instead of failing mid-batch.
        errors.append(LineError(line_no, "<json>", bad))
    if errors:
        return errors
    assert isinstance(text, str) and isinstance(level, str) and project
    return NodeRecord(
        line_no=line_no,
        project=project,
        level=level,
        text=text,
        external_id=ext_id,
        title=title,
        source=source,
        timestamp=ts,
        breadcrumb=tuple(breadcrumb),
        parents=tuple(parents),
        metadata=metadata,
        revision=revision,
        valid_from=valid_from,
        valid_to=valid_to,
        expires_at=expires_at,
    )


def _as_utc(ts: datetime) -> datetime:
    return ts.astimezone(UTC) if ts.tzinfo is not None else ts


def _instant(
    obj: Mapping[str, Any], name: str, line_no: int, errors: list[LineError]
) -> datetime | None:
    """An optional ISO 8601 field (timestamp, valid_from, valid_to, expires_at): null or ""
    is unknown."""
    raw = obj.get(name)
    if raw is None or raw == "":
        return None
    if not isinstance(raw, str):
        errors.append(LineError(line_no, name, "must be an ISO 8601 string or null"))
        return None
    try:
        ts = datetime.fromisoformat(raw.replace("Z", "+00:00"))
        # Stored as timestamptz (UTC) and read back into Python: both ends must fit.
        _as_utc(ts)
    except ValueError:
        errors.append(LineError(line_no, name, f"not ISO 8601: {raw!r}"))
        return None
    except OverflowError:
        errors.append(LineError(line_no, name, f"out of range: {raw!r}"))
        return None
    return ts


def parse_lines(
    lines: Iterable[str], default_project: str | None = None, first_line: int = 1
) -> tuple[list[NodeRecord], list[LineError]]:
    records: list[NodeRecord] = []
    errors: list[LineError] = []
    for i, raw in enumerate(lines, start=first_line):
        if not raw.strip():
            continue
        parsed = parse_line(raw, i, default_project)
        if isinstance(parsed, list):
            errors.extend(parsed)
        else:
            records.append(parsed)
    return records, errors


class Stored(Protocol):
    """What validate needs to know of a node already in the database."""

    @property
    def level(self) -> str: ...

    @property
    def sha256(self) -> bytes: ...


Key = tuple[str, str]  # (project, external id)


def reference_keys(records: Sequence[NodeRecord]) -> list[Key]:
    """Every (project, id) the records name, as a node or as a parent: what validate and
    the edges need to look up among the stored nodes."""
    return sorted(
        {(r.project, r.external_id) for r in records if r.external_id is not None}
        | {(r.project, p) for r in records for p in r.parents}
    )


def adopt_stored_hashes(
    records: Sequence[NodeRecord], stored: Mapping[Key, Stored]
) -> list[NodeRecord]:
    """The records, each one that names a node written without an id (by its generated
    id) with that node's content hashed as the node's hash was: with an empty id. Its
    stored hash left the generated id out (the writer made the id after the hash), so the
    same content must hash the same, or writing it back under its id would look like new
    content: a needless new version, and one whose hash differs from the old one's."""
    out: list[NodeRecord] = []
    for r in records:
        old = None if r.external_id is None else stored.get((r.project, r.external_id))
        if old is not None and old.sha256 != r.sha256:
            idless = replace(r, hashed_without_id=True)
            if idless.sha256 == old.sha256:
                r = idless
        out.append(r)
    return out


def _written_fields(r: NodeRecord) -> tuple[Any, ...]:
    """What a write stores beside the content hash, as memory._same_version compares it."""
    return (r.sha256, json.dumps(r.metadata, sort_keys=True), _instant_key(r.timestamp),
            r.breadcrumb)  # fmt: skip


def _instant_key(ts: datetime | None) -> Any:
    return None if ts is None else (_as_utc(ts), ts.tzinfo is None)


class StoredRevision(Protocol):
    """What stale_revisions needs to know of a stored node: its current version."""

    @property
    def sha256(self) -> bytes: ...

    @property
    def revision(self) -> int: ...


def stale_revisions(
    records: Sequence[NodeRecord], stored: Mapping[Key, StoredRevision]
) -> list[tuple[NodeRecord, int]]:
    """The records that name a revision other than their id's current one (0: none) and
    change its content: what memory._write_nodes would refuse (PM419), found before
    anything is written, each with the current revision. A change of metadata or timestamp
    alone under a stale revision is left to the writer, which compares them (this side
    knows the stored hash only)."""
    out: list[tuple[NodeRecord, int]] = []
    for r in records:
        if r.revision is None:
            continue
        old = None if r.external_id is None else stored.get((r.project, r.external_id))
        current = 0 if old is None else old.revision
        if current != r.revision and (old is None or old.sha256 != r.sha256):
            out.append((r, current))
    return out


def validate(records: Sequence[NodeRecord], stored: Mapping[Key, Stored]) -> list[LineError]:
    """What the format alone cannot tell: an id used twice in the batch for other content, a
    new version that changes a node's level, and provenance that does not go exactly one
    level down (which also rules out cycles)."""
    errors: list[LineError] = []
    by_key: dict[Key, NodeRecord] = {}
    for r in records:
        if r.external_id is None:
            continue
        key = (r.project, r.external_id)
        first = by_key.setdefault(key, r)
        # Other metadata or timestamp is other content too: each would be a version.
        if first is not r and _written_fields(first) != _written_fields(r):
            errors.append(LineError(r.line_no, "id", f"{r.external_id!r} is already used on "
                                    f"line {first.line_no} for other content"))  # fmt: skip
        # New content under a stored id is its next version (memory._write_nodes); a
        # version keeps the node's level, which its edges depend on.
        old = stored.get(key)
        if old is not None and old.sha256 != r.sha256 and old.level != r.level:
            errors.append(LineError(r.line_no, "level", f"{r.external_id!r} is stored in "
                                    f"project {r.project!r} as {old.level}; a new version "
                                    "keeps its level"))  # fmt: skip
    for r in records:
        if r.level == "L0" and r.parents:
            errors.append(LineError(r.line_no, "parents", "an L0 node has no parents"))
            continue
        want = LEVELS[LEVELS.index(r.level) - 1] if r.level != "L0" else None
        for p in r.parents:
            if p == r.external_id:
                errors.append(LineError(r.line_no, "parents", f"{p!r} is the node itself"))
                continue
            parent = by_key.get((r.project, p))
            old = stored.get((r.project, p))
            level = parent.level if parent else (old.level if old is not None else None)
            if level is not None and level != want:
                errors.append(LineError(r.line_no, "parents", f"{p!r} is {level}; a {r.level} "
                                        f"node's parents must be {want}"))  # fmt: skip
    return errors


def new_records(
    records: Sequence[NodeRecord], stored_shas: Container[bytes]
) -> tuple[list[NodeRecord], int]:
    """Records not stored yet, once each, in level order (a parent before its child), and
    how many records that leaves out as duplicates."""
    todo: dict[bytes, NodeRecord] = {}
    duplicates = 0
    for r in sorted(records, key=lambda r: LEVELS.index(r.level)):
        if r.sha256 in stored_shas or r.sha256 in todo:
            duplicates += 1
        else:
            todo[r.sha256] = r
    return list(todo.values()), duplicates
