"""compose.yaml checked by parsing (`make compose-check` runs it with podman, minutes long, outside CI): the services
the deployment needs exist with their healthchecks, every `loraplex ...` command is one the CLI's parser accepts, the
Celery services run the pipelines' app, every LORAPLEX_* variable set (in compose.yaml and in .env.example) is a real setting, every
${VAR} compose.yaml reads is in .env.example, and every volume, service and build it names exists."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from loraplex.launch.cli import build_parser
from loraplex.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
ENV_EXAMPLE = ROOT / ".env.example"
CELERY_APP = "loraplex.pipelines.app:celery_app"  # the pipelines package's Celery app (loraplex/pipelines/app.py)
OURS = ("migrate", "api", "pool", "pool-cpu", "celery-worker", "celery-beat")


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _env_example() -> dict[str, str]:
    pairs = [line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines() if line and not line.startswith("#")]
    return {name.strip(): value.strip() for name, value in pairs}


def _is_setting(var: str) -> bool:
    return var.startswith("LORAPLEX_") and var.removeprefix("LORAPLEX_").lower() in Settings.model_fields


def _parse_cli(args: list[str]) -> argparse.Namespace:
    """The CLI's own parser (SystemExit on an unknown command or flag), and a command that has a function."""
    namespace = build_parser().parse_args(args)
    assert callable(getattr(namespace, "func", None)), args
    return namespace


def test_the_stack_has_every_service_with_healthchecks(spec) -> None:
    services = spec["services"]
    assert {"redis", "postgres", "migrate", "api", "pool", "pool-cpu", "celery-worker", "celery-beat",
            "flower"} <= set(services)  # fmt: skip
    assert services["redis"]["command"][:3] == ["redis-server", "--appendonly", "yes"]
    for name in ("redis", "postgres", "api", "pool", "pool-cpu", "celery-worker", "flower"):
        assert services[name]["healthcheck"]["test"], name
    assert int(str(services["api"]["deploy"]["replicas"]).split(":-")[-1].rstrip("}")) >= 2
    gpus = services["pool"]["deploy"]["resources"]["reservations"]["devices"]
    assert gpus[0]["driver"] == "nvidia" and gpus[0]["capabilities"] == ["gpu"]
    assert services["pool"]["environment"]["LORAPLEX_DEVICE"] == "cuda"
    assert services["pool-cpu"]["environment"]["LORAPLEX_DEVICE"] == "cpu"
    assert services["pool"]["profiles"] == ["gpu"] and services["pool-cpu"]["profiles"] == ["cpu"]
    assert _env_example()["COMPOSE_PROFILES"] in ("gpu", "cpu")  # `docker compose up` starts one of the pools
    # migrate runs once, before every other process of ours
    for name in ("api", "pool", "pool-cpu", "celery-worker", "celery-beat"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully", name
    assert services["migrate"]["restart"] == "no"


def test_every_loraplex_command_exists_in_the_cli(spec) -> None:
    services = spec["services"]
    commands = {name: services[name]["command"] for name in OURS}
    assert _parse_cli(commands["migrate"][1:]).command == "migrate"
    assert _parse_cli(commands["api"][1:]).command == "serve" and not _parse_cli(commands["api"][1:]).embedded
    for name in ("pool", "pool-cpu"):
        assert _parse_cli(commands[name][1:]).command == "worker"
    for command in commands.values():
        if command[0] == "loraplex":
            _parse_cli(command[1:])
    # Healthchecks that call our CLI are real commands too.
    for name in OURS:
        test = services[name].get("healthcheck", {}).get("test", [])
        if len(test) > 1 and test[1] == "loraplex":
            _parse_cli(test[2:])


def test_the_celery_services_run_the_pipelines_app(spec, monkeypatch) -> None:
    services = spec["services"]
    assert services["celery-worker"]["command"][:4] == ["celery", "-A", CELERY_APP, "worker"]
    assert services["celery-beat"]["command"][:4] == ["celery", "-A", CELERY_APP, "beat"]
    assert CELERY_APP in services["celery-worker"]["healthcheck"]["test"][1]
    module, attr = CELERY_APP.split(":")
    from celery import Celery

    from loraplex.settings import get_settings

    # As compose's services do: the app exits at load without a Redis named (pipelines/broker.py). Nothing connects.
    monkeypatch.setenv("LORAPLEX_REDIS_URL", "redis://redis:6379/0")
    get_settings.cache_clear()
    try:
        assert isinstance(getattr(importlib.import_module(module), attr), Celery)
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()


def test_every_loraplex_variable_is_a_setting(spec) -> None:
    for name, service in spec["services"].items():
        for var in service.get("environment") or {}:
            if name not in ("postgres",):
                assert var.startswith("LORAPLEX_"), (name, var)
                assert _is_setting(var), (name, var)
    for var in _env_example():
        if var.startswith("LORAPLEX_"):
            assert _is_setting(var), var


def test_every_variable_compose_reads_is_in_env_example_and_back() -> None:
    text = COMPOSE.read_text()
    read = set(re.findall(r"\$\{([A-Z0-9_]+)(?::?-[^}]*)?\}", text))
    example = set(_env_example())
    assert read - example == set()  # a variable compose.yaml reads that .env.example does not document
    assert example - read - {"COMPOSE_PROFILES"} == set()  # one documented that nothing reads (compose reads that one)


def test_every_volume_service_and_build_it_names_exists(spec) -> None:
    services, volumes = spec["services"], set(spec.get("volumes") or {})
    used: set[str] = set()
    for name, service in services.items():
        assert "image" in service or "build" in service, name
        build = service.get("build")
        if build is not None:
            context = ROOT / (build if isinstance(build, str) else build.get("context", "."))
            assert (context / "Dockerfile").is_file(), name
        for mount in service.get("volumes") or []:
            source = mount.split(":", 1)[0]
            if not source.startswith((".", "/")):  # a named volume, not a bind mount
                used.add(source)
        depends = service.get("depends_on") or {}
        assert set(depends) <= set(services), (name, depends)
    assert used <= volumes, used - volumes
    assert volumes <= used, volumes - used  # no volume left unused


def test_the_dockerfile_can_build_the_cuda_image(spec) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ARG TORCH_INDEX_URL" in dockerfile and '--index-url "$TORCH_INDEX_URL"' in dockerfile
    args = spec["services"]["pool"]["build"]["args"]
    assert args["TORCH_INDEX_URL"] != spec["services"]["pool-cpu"]["build"]["args"]["TORCH_INDEX_URL"]


def test_flower_listens_on_the_loopback_only(spec) -> None:
    """Flower has no login and can revoke tasks: each of its published ports is bound to 127.0.0.1, or
    it reads basic-auth credentials from the environment."""
    flower = spec["services"]["flower"]
    env = flower.get("environment") or {}
    has_auth = any("basic_auth" in str(a).lower() or "basic-auth" in str(a) for a in flower["command"]) or bool(
        env.get("FLOWER_BASIC_AUTH")
    )
    ports = flower.get("ports") or []
    assert ports, "flower publishes no port"
    for port in ports:
        text = port if isinstance(port, str) else f"{port.get('host_ip', '')}:{port.get('published')}"
        assert has_auth or text.startswith("127.0.0.1:"), f"flower published on every interface without auth: {port}"


def test_a_second_pool_serves_another_base_model_under_its_own_name(spec) -> None:
    """The fleet as compose shows it: pool-2 (GPU) and pool-2-cpu run `loraplex worker` under their own pool name and
    another base model than the first pool, each in a profile of its own (a second GPU is the operator's choice)."""
    first = spec["services"]["pool"]["environment"]
    for name in ("pool-2", "pool-2-cpu"):
        service = spec["services"][name]
        env = service["environment"]
        assert service["command"] == ["loraplex", "worker"] and service["profiles"][0].startswith("second-")
        assert env["LORAPLEX_POOL"] != first["LORAPLEX_POOL"]
        assert env["LORAPLEX_BASE_MODEL"] != first["LORAPLEX_BASE_MODEL"]
