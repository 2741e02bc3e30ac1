"""A large corpus that looks real (issue 28): real MiniLM vectors of real texts (the LoCoMo
and SciFact nodes in ../shared/data, embedded once by the repository's own local embedder and
cached outside the repository), recombined into as many synthetic nodes as asked.

Each synthetic node mixes one real vector with one of its 10 nearest real neighbours (a
random convex weight), adds noise shaped like the real spread (a random real vector's
deviation from the mean, scaled down) and is normalised again, so it lies where real
embeddings lie and its neighbourhood is a real one's. The corpus has 1,000 projects (by
default) with Zipf sizes (the r-th largest holds a share proportional to 1/r), each about its
own topic: a project draws its nodes from the real vectors nearest a topic vector of its own.
The queries are the real questions (LoCoMo's questions, SciFact's claims), embedded by the
same model; a project's queries are the questions nearest its topic.

The shape of ``Corpus`` is synthetic.Corpus's (synthetic.load COPYs it): the largest project
is named synthetic.MAIN and the one closest to 1% of the nodes synthetic.SMALL, so the
`poimen-memory bench` parts that name them work on either corpus."""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from poimen_lab.bench import synthetic

CACHE_DEFAULT = Path("/tmp/poimen-bench-cache")
DATA_DEFAULT = Path(__file__).resolve().parents[3].parent / "shared" / "data"
SOURCES = ("locomo-dev", "scifact")
NEIGHBOURS = 10
NOISE = 0.35  # the deviation added, relative to a real vector's own from the mean

F32 = np.ndarray[Any, np.dtype[np.float32]]


@dataclass
class RealTexts:
    """The real texts and questions and their vectors (unit length)."""

    texts: list[str]
    vectors: F32
    questions: list[str]
    question_vectors: F32


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_sources(folders: Sequence[Path]) -> tuple[list[str], list[str]]:
    """Every node text and every question of the folders (nodes.jsonl, queries*.jsonl)."""
    texts: list[str] = []
    questions: list[str] = []
    for folder in folders:
        if not (folder / "nodes.jsonl").exists():
            raise FileNotFoundError(f"{folder}/nodes.jsonl: no such file (the corpus reads it)")
        texts += [n["text"] for n in _read_jsonl(folder / "nodes.jsonl") if n.get("text")]
        for qfile in sorted(folder.glob("queries*.jsonl")):
            questions += [q["text"] for q in _read_jsonl(qfile) if q.get("text")]
    # One copy of each (SciFact's queries-train and queries-test share no claim, but a
    # question asked twice would count its neighbours twice).
    return list(dict.fromkeys(texts)), list(dict.fromkeys(questions))


def embed_cached(
    folders: Sequence[Path],
    embed: Callable[[list[str]], Any],
    model: str,
    cache: Path = CACHE_DEFAULT,
) -> RealTexts:
    """The folders' texts and questions with their vectors, embedded once per content and
    model: cached under ``cache`` (never in the repository)."""
    texts, questions = read_sources(folders)
    digest = hashlib.sha256(
        json.dumps([model, texts, questions], ensure_ascii=False).encode()
    ).hexdigest()[:16]
    path = cache / f"real-{digest}.npz"
    if path.exists():
        with np.load(path) as z:
            return RealTexts(texts, z["vectors"], questions, z["questions"])
    print(
        f"realistic: embedding {len(texts)} texts and {len(questions)} questions once "
        f"(cached in {path})",
        file=sys.stderr,
    )
    vectors = _unit(np.asarray(embed(texts), dtype=np.float32))
    qvectors = _unit(np.asarray(embed(questions), dtype=np.float32))
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, vectors=vectors, questions=qvectors)
    tmp.replace(path)
    return RealTexts(texts, vectors, questions, qvectors)


def _unit(x: np.ndarray[Any, Any]) -> F32:
    x = x.astype(np.float32)
    out: F32 = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    return out


def nearest(vectors: F32, k: int, chunk: int = 2048) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Each vector's k nearest other vectors by cosine (exact, in chunks)."""
    n = len(vectors)
    k = min(k, n - 1)
    out = np.empty((n, k), dtype=np.int64)
    for start in range(0, n, chunk):
        sims = vectors[start : start + chunk] @ vectors.T
        rows = np.arange(sims.shape[0])
        sims[rows, start + rows] = -np.inf  # not itself
        top = np.argpartition(-sims, k, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(sims, top, axis=1), axis=1)
        out[start : start + chunk] = np.take_along_axis(top, order, axis=1)
    return out


def zipf_sizes(n: int, projects: int) -> list[int]:
    """Project sizes summing to n, the r-th proportional to 1/r (each at least 1)."""
    share = 1.0 / np.arange(1, projects + 1)
    sizes = np.maximum(np.floor(n * share / share.sum()).astype(np.int64), 1)
    sizes[0] += n - int(sizes.sum())  # the rounding goes to the largest
    return [int(s) for s in sizes]


def project_names(sizes: list[int]) -> list[str]:
    """tenant-<rank>, but the largest is synthetic.MAIN and the one nearest 1% of the nodes
    synthetic.SMALL (the bench's filtered run)."""
    total = sum(sizes)
    small = int(np.argmin([abs(s / total - 0.01) for s in sizes[1:]])) + 1 if len(sizes) > 1 else 0
    names = [f"tenant-{r:04d}" for r in range(1, len(sizes) + 1)]
    names[0] = synthetic.MAIN
    if small:
        names[small] = synthetic.SMALL
    return names


def generate(
    real: RealTexts,
    n: int,
    n_queries: int,
    *,
    seed: int = 0,
    projects: int = 1000,
    noise: float = NOISE,
) -> synthetic.Corpus:
    """n synthetic nodes recombined from the real vectors (see the module's docstring) in
    ``projects`` Zipf-sized projects, and n_queries real questions (cycled when asked for
    more than there are), each assigned to the project whose topic it is nearest."""
    rng = np.random.default_rng(seed)
    base = real.vectors
    m = len(base)
    projects = max(1, min(projects, n))
    neighbours = nearest(base, NEIGHBOURS)
    mean = base.mean(axis=0)
    deviation = base - mean
    # A project's topic: a real vector; its pool, the real vectors nearest it.
    topics = rng.choice(m, size=projects, replace=projects > m)
    pool_size = max(NEIGHBOURS, min(m, 200))
    sizes = zipf_sizes(n, projects)
    names = project_names(sizes)
    pools = np.empty((projects, pool_size), dtype=np.int64)
    for start in range(0, projects, 256):
        sims = base[topics[start : start + 256]] @ base.T
        top = np.argpartition(-sims, pool_size - 1, axis=1)[:, :pool_size]
        pools[start : start + 256] = top
    of_project = np.repeat(np.arange(projects), sizes)
    rng.shuffle(of_project)
    first = pools[of_project, rng.integers(0, pool_size, n)]
    second = neighbours[first, rng.integers(0, neighbours.shape[1], n)]
    w = rng.uniform(0.5, 1.0, (n, 1)).astype(np.float32)
    shape = deviation[rng.integers(0, m, n)]
    vectors = _unit(w * base[first] + (1 - w) * base[second] + noise * shape)
    levels = list(
        rng.choice(
            [lv for lv, _ in synthetic.LEVEL_SHARE], size=n, p=[p for _, p in synthetic.LEVEL_SHARE]
        )
    )
    texts = [real.texts[int(i)] for i in first]
    qidx = np.arange(n_queries) % len(real.questions)
    qvec = real.question_vectors[qidx]
    nearest_topic = np.argmax(qvec @ base[topics].T, axis=1)
    return synthetic.Corpus(
        vectors,
        texts,
        levels,
        [names[int(p)] for p in of_project],
        [[] for _ in range(n)],
        np.ascontiguousarray(qvec),
        [real.questions[int(i)] for i in qidx],
        [names[int(p)] for p in nearest_topic],
    )


def project_queries(
    real: RealTexts, corpus: synthetic.Corpus, project: str, count: int
) -> tuple[F32, list[str]]:
    """The ``count`` real questions nearest a project's nodes (their mean direction), vectors
    and texts: what a tenant about that topic asks."""
    members = np.array([p == project for p in corpus.projects])
    centre = _unit(corpus.vectors[members].mean(axis=0, keepdims=True))[0]
    order = np.argsort(-(real.question_vectors @ centre), kind="stable")[:count]
    return np.ascontiguousarray(real.question_vectors[order]), [
        real.questions[int(i)] for i in order
    ]


def profile(vectors: F32, sample: int = 500, seed: int = 0) -> dict[str, float]:
    """The neighbour-distance profile: median cosine similarity of a sample's 1st and 10th
    nearest neighbours, and of random pairs (to compare the corpus with the real vectors)."""
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(vectors), size=min(sample, len(vectors)), replace=False)
    sims = vectors[idx] @ vectors.T
    sims[np.arange(len(idx)), idx] = -np.inf
    part = -np.sort(-sims, axis=1)[:, :NEIGHBOURS]
    a, b = rng.integers(0, len(vectors), (2, 2000))
    pairs = vectors[a] * vectors[b]
    return {
        "nn1_cosine_p50": round(float(np.median(part[:, 0])), 4),
        "nn10_cosine_p50": round(float(np.median(part[:, -1])), 4),
        "random_pair_cosine_p50": round(float(np.median(pairs.sum(axis=1))), 4),
    }
