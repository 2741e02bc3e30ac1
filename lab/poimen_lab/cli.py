"""The lab's CLI commands (`eval`, `bench`, `bench-rls`, `bench-recall`, `bench-overload`,
`bench-fair`, `bench-tenants`, `bench-proxy`, `bench-peers`), registered into `poimen-memory`
through the ``poimen_memory.commands`` entry point, so the product never imports the lab by name."""

from __future__ import annotations

import argparse

from poimen_lab.bench.command import add_parser as add_bench
from poimen_lab.bench.fair import add_parser as add_bench_fair
from poimen_lab.bench.overload import add_parser as add_bench_overload
from poimen_lab.bench.peers import add_parser as add_bench_peers
from poimen_lab.bench.proxy import add_parser as add_bench_proxy
from poimen_lab.bench.recall import add_parser as add_bench_recall
from poimen_lab.bench.rls import add_parser as add_bench_rls
from poimen_lab.bench.tenants import add_parser as add_bench_tenants
from poimen_lab.eval.command import add_parser as add_eval


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    add_eval(sub)
    add_bench(sub)
    add_bench_rls(sub)
    add_bench_recall(sub)
    add_bench_overload(sub)
    add_bench_fair(sub)
    add_bench_tenants(sub)
    add_bench_proxy(sub)
    add_bench_peers(sub)
