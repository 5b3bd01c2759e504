"""The layering of ARCHITECTURE.md, checked on the source: imports only go down. A module that imports across a
boundary (at the top or inside a function) fails here, naming the line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "loraplex"
# What the workers (torch) may import besides themselves: the contract, the errors and domain-free process plumbing.
BOTTOM = ("loraplex.protocol", "loraplex.errors", "loraplex.runtime")

# package -> prefixes of modules it must never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "protocol": ("loraplex.dispatch", "loraplex.workers", "loraplex.queue", "loraplex.storage", "loraplex.api",
                 "pydantic", "torch", "redis", "sqlalchemy"),
    "queue": ("loraplex.dispatch", "loraplex.workers", "loraplex.api", "torch"),
    "storage": ("loraplex.dispatch", "loraplex.workers", "loraplex.queue", "loraplex.api", "torch"),
    "api": ("loraplex.workers", "loraplex.dispatch", "loraplex.pool", "torch"),
    # The application layer: the gateway's rules as plain calls, under every front end (api, admin, pipelines, CLI).
    "service": ("loraplex.api", "loraplex.admin", "loraplex.pipelines", "loraplex.launch", "loraplex.workers",
                "loraplex.dispatch", "loraplex.pool", "fastapi", "starlette", "torch"),
    # The operators' console sits on the application layer, never on the HTTP package.
    "admin": ("loraplex.api", "loraplex.workers", "loraplex.dispatch", "loraplex.pool", "torch"),
    "client": ("loraplex.api", "loraplex.queue", "loraplex.storage", "loraplex.workers", "loraplex.dispatch", "torch"),
    # The policy and the loop over the queue: no SQL (the pool's records and lookups are pool/'s), no pool, no torch.
    "dispatch": ("loraplex.workers", "loraplex.api", "loraplex.pool", "loraplex.storage", "sqlalchemy", "torch"),
    # Pipelines train through the service layer like a tenant: never the pool's internals.
    "pipelines": ("loraplex.api", "loraplex.workers", "loraplex.dispatch", "loraplex.pool", "loraplex.launch", "torch"),
    # The pool process joins workers/, dispatch/, storage/ and queue/: never the gateway's HTTP side or the client.
    "pool": ("loraplex.api", "loraplex.client", "loraplex.admin", "loraplex.pipelines", "loraplex.launch"),
    # Process plumbing with no domain: nothing of the service's own packages.
    "runtime": ("loraplex.api", "loraplex.client", "loraplex.admin", "loraplex.pipelines", "loraplex.launch",
                "loraplex.pool", "loraplex.dispatch", "loraplex.workers", "loraplex.queue", "loraplex.storage",
                "loraplex.samplers", "loraplex.models", "torch"),
    # The vLLM backend drives a server process over HTTP: no torch, no vllm import (the gateway may load it).
    "samplers": ("loraplex.workers", "loraplex.api", "loraplex.dispatch", "loraplex.queue", "loraplex.storage",
                 "torch", "transformers", "vllm"),
}  # fmt: skip


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_layer_imports_nothing_above_it(package: str) -> None:
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {name}"
        for path in sorted((PACKAGE / package).rglob("*.py"))
        for line, name in _imports(path)
        if any(_under(name, p) for p in FORBIDDEN[package])
    ]
    assert bad == []


def test_workers_import_torch_side_packages_and_the_bottom_layers_only() -> None:
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {name}"
        for path in sorted((PACKAGE / "workers").rglob("*.py"))
        for line, name in _imports(path)
        if _under(name, "loraplex") and not _under(name, "loraplex.workers") and not any(_under(name, b) for b in BOTTOM)
    ]
    assert bad == []


@pytest.mark.parametrize("package", ["workers", "protocol", "queue", "storage", "client", "samplers"])
def test_metrics_are_defined_above_the_engine_and_the_stores(package: str) -> None:
    """prometheus-client belongs to the processes' sides (pool/metrics.py, api/metrics.py): the workers
    report plain numbers, and the queue carries the pool's metrics as bytes."""
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {name}"
        for path in sorted((PACKAGE / package).rglob("*.py"))
        for line, name in _imports(path)
        if _under(name, "prometheus_client")
    ]
    assert bad == []
