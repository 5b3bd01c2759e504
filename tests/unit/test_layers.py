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


# ---- the import closure of the torch-free sides ----------------------------------------------------------------------
# The gateway, the operators' console, the Celery workers and the tenants' client never load the engine's stack: from
# every module of these packages, following loraplex's own imports (at the top and inside functions), none of these
# is reached.
TORCH_FREE = ("api", "service", "admin", "pipelines", "client")
TORCH_STACK = ("torch", "transformers", "peft")
# The Celery workers tokenize the pipelines' datasets (transformers' tokenizers; a preset's tokenizer folder built by
# the model registry on first use): the only edges into the stack, each (importing module, imported name).
TOKENIZING_EDGES = frozenset({
    ("loraplex.pipelines.dataset", "transformers"),
    ("loraplex.pipelines.runner", "loraplex.models.registry"),
})  # fmt: skip


def _module_files() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _module_files()


def _imported_modules(module: str) -> list[tuple[int, str]]:
    """Every name `module` imports, anywhere in its body (relative imports resolved); for `from X import Y`, X and,
    when Y is a submodule, X.Y."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names if f"{base}.{a.name}" in MODULES]
    return out


def _reaches_torch_stack(start: str, allowed: frozenset[tuple[str, str]]) -> list[str]:
    """The import chains from `start` to torch / transformers / peft, as "a:line -> b:line -> ... -> torch". Importing
    a.b.c runs a/__init__ and a/b/__init__ too, so the packages on the way are followed as well."""
    came_from: dict[str, str | None] = {start: None}
    todo, chains = [start], []
    while todo:
        module = todo.pop()
        for line, name in _imported_modules(module):
            if (module, name) in allowed:
                continue
            if name.split(".")[0] in TORCH_STACK:
                hops, at = [f"{module}:{line}"], came_from[module]
                while at is not None:
                    hops.append(at)
                    at = came_from[at.rpartition(":")[0]]
                chains.append(" -> ".join([*reversed(hops), name]))
                continue
            parts = name.split(".")
            for i in range(2, len(parts) + 1):
                step = ".".join(parts[:i])
                if parts[0] == "loraplex" and step in MODULES and step not in came_from:
                    came_from[step] = f"{module}:{line}"
                    todo.append(step)
    return chains


@pytest.mark.parametrize("package", TORCH_FREE)
def test_torch_free_sides_never_reach_the_torch_stack(package: str) -> None:
    roots = sorted(m for m in MODULES if _under(m, f"loraplex.{package}"))
    assert roots
    reached = {chain for root in roots for chain in _reaches_torch_stack(root, TOKENIZING_EDGES)}
    assert sorted(reached) == []


def test_the_closure_follows_imports_inside_functions() -> None:
    """The check sees lazy imports: the pool process's composition root (workers behind function-level imports)
    reaches torch, and only through them."""
    chains = _reaches_torch_stack("loraplex.pool.process", frozenset())
    assert chains and all("loraplex.pool.process:" in chain for chain in chains)
    lazy_lines = {
        node.lineno
        for fn in ast.walk(ast.parse(MODULES["loraplex.pool.process"].read_text()))
        if isinstance(fn, ast.FunctionDef)
        for node in ast.walk(fn)
        if isinstance(node, ast.Import | ast.ImportFrom)
    }
    assert any(int(chain.split(" -> ")[0].rpartition(":")[2]) in lazy_lines for chain in chains)


# Entry points compose processes: the gateway's composition (launch/gateway.py) and the embedded stack's environment
# for its gateway processes' shared metrics (launch/embedded.py) are the only importers of the HTTP package outside it;
# the CLI, the admin and the pipelines reach the rules through service/.
HTTP_PACKAGE_IMPORTERS = {"loraplex/launch/gateway.py", "loraplex/launch/embedded.py"}


def test_only_the_gateways_composition_imports_the_http_package() -> None:
    importers = {
        str(path.relative_to(PACKAGE.parent))
        for path in sorted(PACKAGE.rglob("*.py"))
        if not path.is_relative_to(PACKAGE / "api")
        for _, name in _imports(path)
        if _under(name, "loraplex.api")
    }
    assert importers == HTTP_PACKAGE_IMPORTERS
