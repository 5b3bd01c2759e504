"""scripts/compose_check/compose_pod.py reads compose.yaml as compose does (`make compose-check` runs it for real,
minutes long, outside CI): variables, profiles, start order, and the `podman run` each service becomes. And the
Dockerfile builds on a normal host by default (public base) and on the check's base by a build ARG."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK_ENV = {"COMPOSE_PROFILES": "cpu", "IMAGE_TAG": "compose-check", "API_PORTS": "18700"}


def _load_compose_pod():
    spec = importlib.util.spec_from_file_location("compose_pod", ROOT / "scripts/compose_check/compose_pod.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["compose_pod"] = module
    spec.loader.exec_module(module)
    return module


cp = _load_compose_pod()


@pytest.fixture(scope="module")
def services():
    return cp.load(ROOT / "compose.yaml", CHECK_ENV)["services"]


def test_interpolation_follows_compose() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert (
        cp.interpolate("${SET} ${SET:-d} ${UNSET:-d} ${EMPTY:-d} ${EMPTY-d} ${UNSET-d} ${UNSET}", env) == "x x d d  d "
    )
    assert cp.interpolate('test -f "$$HOME/a"', env) == 'test -f "$HOME/a"'


def test_the_check_starts_the_cpu_pool_after_what_it_depends_on(services) -> None:
    order = cp.start_order(services, ["pool-cpu", "api"], cp.profiles_from(CHECK_ENV))
    assert order == ["redis", "postgres", "migrate", "api", "pool-cpu"]
    with pytest.raises(ValueError, match="needs profile"):
        cp.start_order(services, ["pool"], {"cpu"})  # the GPU pool is not of the active profile
    with pytest.raises(ValueError, match="no service"):
        cp.start_order(services, ["nope"], {"cpu"})


def test_a_depends_on_cycle_is_named() -> None:
    services = {"a": {"depends_on": ["b"]}, "b": {"depends_on": {"a": {"condition": "service_healthy"}}}}
    with pytest.raises(ValueError, match="cycle: a -> b -> a"):
        cp.start_order(services, ["a"], set())


def test_the_pool_runs_as_compose_yaml_describes_it(services) -> None:
    args = cp.run_args("proj", "pool-cpu", services["pool-cpu"], {})
    assert args[:6] == ["run", "-d", "--pod", "proj", "--name", "proj-pool-cpu"]
    assert args[args.index("--restart") + 1] == "unless-stopped"
    assert "LORAPLEX_DEVICE=cpu" in args and "LORAPLEX_REDIS_URL=redis://redis:6379/0" in args
    assert args[args.index("-v") + 1] == "proj_loraplex-data:/var/lib/loraplex"
    assert args[args.index("--stop-timeout") + 1] == "60"
    assert args[-3:] == ["loraplex:compose-check", "loraplex", "worker"]
    assert cp.probe(services["pool-cpu"]) == ["sh", "-c", 'test -f "$LORAPLEX_HOME/pool-$LORAPLEX_POOL.ready"']
    assert cp.dependencies(services["pool-cpu"])["migrate"] == "service_completed_successfully"


def test_images_compose_cannot_pull_here_are_mapped(services) -> None:
    args = cp.run_args("proj", "redis", services["redis"], {"redis:7": "localhost/stand-in:7"})
    assert args[args.index("localhost/stand-in:7") + 1 :] == services["redis"]["command"]
    assert cp.probe(services["redis"]) == ["redis-cli", "ping"]


def test_the_pod_publishes_one_port_per_service_and_resolves_service_names(services) -> None:
    args = cp.pod_create_args("proj", services, ["redis", "api"])
    assert args[args.index("-p") + 1] == "18700:8700"
    assert args[args.index("--add-host") : args.index("--add-host") + 2] == ["--add-host", "redis:127.0.0.1"]
    assert cp.published("8700-8703:8700") == "8700:8700"  # compose's one host port per replica: a pod runs one
    assert cp.published("127.0.0.1:8700-8701:8700") == "127.0.0.1:8700:8700"
    assert cp.published("127.0.0.1:5555:5555") == "127.0.0.1:5555:5555"


def test_durations() -> None:
    assert cp.seconds("60s") == 60 and cp.seconds("1m30s") == 90 and cp.seconds("600s") == 600
    with pytest.raises(ValueError):
        cp.seconds("soon")


def test_the_dockerfile_takes_its_base_from_an_arg_with_a_public_default() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    pin = re.search(r'"(torch==[^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin and f"{pin.group(1)}\n" in text  # the image's torch is the project's pin
    # Everything the Dockerfile copies is inside the build context .dockerignore leaves.
    allowed = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line[:1] == "!"}
    copied = {p for line in text.splitlines() if line.startswith("COPY ") for p in line.split()[1:-1]}
    assert copied and copied <= allowed, copied - allowed
