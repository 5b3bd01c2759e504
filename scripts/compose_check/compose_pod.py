"""Runs compose.yaml's services with `podman run` in one pod, compose.yaml being the only description of them.

For `make compose-check` (scripts/compose_check/run.sh) on hosts with podman but no compose engine. Debian's
podman-compose (1.0.3) installs, but ignores `depends_on` conditions (migrate would race postgres) and hands the
healthchecks to podman, whose probes need systemd timers these hosts do not run. So this file reads compose.yaml as
compose does (anchors and merge keys, `${VAR:-default}` from the environment, profiles, `depends_on` with its
conditions, restart, volumes, ports, shm_size, stop_grace_period, command) and runs the probes itself.

The pod shares one network namespace: each service name resolves to 127.0.0.1 and each service's ports are the
pod's, so one replica per service (a range of host ports publishes its first port). Images compose cannot pull here
are mapped to ones built locally (`--image redis:7=localhost/...`); every other name is compose.yaml's own.

    compose_pod.py --project NAME [--file compose.yaml] [--image FROM=TO ...] up SERVICE...
    compose_pod.py --project NAME down
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

VARIABLE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}")
LABEL = "loraplex.compose-check.project"  # on every container and volume of ours, so `down` finds them all
DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
SECONDS_PER = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}


# --- compose.yaml, read as compose reads it (pure) ----------------------------------------------------------------


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """compose's `${VAR}`, `${VAR:-default}` (unset or empty), `${VAR-default}` (unset) and `$$` (a literal `$`)."""

    def value(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, default = match.groups()
        found = env.get(name)
        if (op == ":-" and not found) or (op == "-" and found is None):
            return default
        return found or ""

    return VARIABLE.sub(value, text)


def interpolated(node: Any, env: Mapping[str, str]) -> Any:
    """Every string value of a parsed compose file interpolated (keys are names, never variables)."""
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, dict):
        return {key: interpolated(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolated(value, env) for value in node]
    return node


def load(path: Path, env: Mapping[str, str]) -> dict[str, Any]:
    return interpolated(yaml.safe_load(path.read_text()), env)


def profiles_from(env: Mapping[str, str]) -> set[str]:
    return {p.strip() for p in env.get("COMPOSE_PROFILES", "").split(",") if p.strip()}


def dependencies(service: Mapping[str, Any]) -> dict[str, str]:
    """`depends_on` as {service: condition}, in either of compose's two forms."""
    depends = service.get("depends_on") or {}
    if isinstance(depends, list):
        return {name: "service_started" for name in depends}
    return {name: (spec or {}).get("condition", "service_started") for name, spec in depends.items()}


def start_order(services: Mapping[str, Any], wanted: Iterable[str], profiles: set[str]) -> list[str]:
    """`wanted` and everything they depend on, each after its dependencies (file order among equals). A service of
    a profile that is not active is refused, as compose refuses it."""
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in order:
            return
        if name in path:
            raise ValueError(f"depends_on cycle: {' -> '.join((*path, name))}")
        if name not in services:
            raise ValueError(f"no service {name!r} in the compose file")
        own = set(services[name].get("profiles") or [])
        if own and not own & profiles:
            raise ValueError(f"service {name!r} needs profile {sorted(own)} (COMPOSE_PROFILES={sorted(profiles)})")
        for dependency in dependencies(services[name]):
            visit(dependency, (*path, name))
        order.append(name)

    known = list(services)
    for name in sorted(set(wanted), key=lambda n: known.index(n) if n in known else len(known)):
        visit(name, ())
    return order


def published(port: str) -> str:
    """A `ports` entry for the pod: `HOST-RANGE:PORT` (one host port per replica in compose) publishes the range's
    first port, as a pod runs one replica."""
    *host, container = str(port).rsplit(":", 1)
    if host and re.fullmatch(r"\d+-\d+", host[0].rsplit(":", 1)[-1]) and "-" not in container:
        prefix, _, ports = host[0].rpartition(":")
        first = ports.split("-")[0]
        return f"{prefix}:{first}:{container}" if prefix else f"{first}:{container}"
    return str(port)


def seconds(duration: str | int | float) -> int:
    """compose's durations (`60s`, `1m30s`) in whole seconds, for `podman run --stop-timeout`."""
    if isinstance(duration, int | float):
        return int(duration)
    parts = DURATION.findall(duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise ValueError(f"not a compose duration: {duration!r}")
    return round(sum(float(n) * SECONDS_PER[u] for n, u in parts))


def environment(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        return dict(item.split("=", 1) for item in env)
    return {key: "" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
            for key, value in env.items()}  # fmt: skip


def volume_arg(project: str, volume: str) -> str:
    """A named volume becomes the project's (`PROJECT_NAME`, as compose names it); a path is bound as it is."""
    source, _, rest = volume.partition(":")
    if source.startswith(("/", ".", "~")):
        return volume
    return f"{project}_{source}:{rest}"


def container_name(project: str, service: str) -> str:
    return f"{project}-{service}"


def pod_create_args(project: str, services: Mapping[str, Any], names: list[str]) -> list[str]:
    args = ["pod", "create", "--name", project, "--label", f"{LABEL}={project}"]
    for name in names:
        args += ["--add-host", f"{name}:127.0.0.1"]  # the pod's containers share one network namespace
        for port in services[name].get("ports") or []:
            args += ["-p", published(port)]
    return args


def run_args(project: str, name: str, service: Mapping[str, Any], images: Mapping[str, str]) -> list[str]:
    """`podman run` for one service in the project's pod. Healthchecks are not handed to podman (its probes run on
    systemd timers): Pod.healthy runs them."""
    args = ["run", "-d", "--pod", project, "--name", container_name(project, name), "--label", f"{LABEL}={project}",
            "--restart", str(service.get("restart", "no"))]  # fmt: skip
    for key, value in environment(service).items():
        args += ["-e", f"{key}={value}"]
    for volume in service.get("volumes") or []:
        args += ["-v", volume_arg(project, volume)]
    if "shm_size" in service:
        args += ["--shm-size", str(service["shm_size"])]
    if "stop_grace_period" in service:
        args += ["--stop-timeout", str(seconds(service["stop_grace_period"]))]
    image = service["image"]
    args.append(images.get(image, image))
    command = service.get("command")
    if command:
        args += shlex.split(command) if isinstance(command, str) else [str(part) for part in command]
    return args


def probe(service: Mapping[str, Any]) -> list[str] | None:
    """The healthcheck's test as a command to exec in the container (None: the service has none)."""
    test = (service.get("healthcheck") or {}).get("test")
    if not test or test == ["NONE"]:
        return None
    if isinstance(test, str):
        return ["sh", "-c", test]
    kind, *rest = test
    return ["sh", "-c", rest[0]] if kind == "CMD-SHELL" else list(rest)


# --- podman (I/O) -------------------------------------------------------------------------------------------------


def podman(*args: str, check: bool = True, timeout: float | None = 120) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])} ... exited {result.returncode}: {result.stderr.strip()}")
    return result


def wait_for(what: str, ready: Callable[[], bool], timeout_s: float, every_s: float = 1.0) -> float:
    """Seconds until `ready()`; RuntimeError naming `what` after timeout_s."""
    start = time.monotonic()
    while not ready():
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"{what}: not after {timeout_s:.0f} s")
        time.sleep(every_s)
    return time.monotonic() - start


class Pod:
    """compose.yaml's services as containers of one podman pod named `project`."""

    def __init__(self, project: str, services: Mapping[str, Any], images: Mapping[str, str]) -> None:
        self.project, self.services, self.images = project, services, images

    def container(self, name: str) -> str:
        return container_name(self.project, name)

    def state(self, name: str) -> dict[str, Any]:
        """{running, pid, restarts, exit_code, stopped_by_user} of a service's container."""
        (info,) = json.loads(podman("inspect", "--type", "container", self.container(name)).stdout)
        state = info["State"]
        return {"running": state["Status"] == "running", "pid": state["Pid"], "restarts": info.get("RestartCount", 0),
                "exit_code": state["ExitCode"], "status": state["Status"]}  # fmt: skip

    def healthy(self, name: str) -> bool:
        command = probe(self.services[name])
        if command is None:
            return self.state(name)["running"]
        return podman("exec", self.container(name), *command, check=False, timeout=60).returncode == 0

    def completed(self, name: str) -> bool:
        state = self.state(name)
        if state["status"] == "exited" and state["exit_code"] != 0:
            logs = podman("logs", "--tail", "20", self.container(name), check=False)
            raise RuntimeError(f"{name} exited {state['exit_code']}:\n{logs.stdout}{logs.stderr}")
        return state["status"] == "exited"

    def wait_condition(self, name: str, condition: str, timeout_s: float) -> None:
        if condition == "service_healthy":
            wait_for(f"{name} healthy", lambda: self.healthy(name), timeout_s)
        elif condition == "service_completed_successfully":
            wait_for(f"{name} completed", lambda: self.completed(name), timeout_s)
        elif condition != "service_started":
            raise ValueError(f"unknown depends_on condition {condition!r}")

    def up(self, names: list[str], timeout_s: float = 600) -> None:
        """Create the pod and start `names` in order, each once its dependencies meet their conditions."""
        podman(*pod_create_args(self.project, self.services, names))
        for name in names:
            for dependency, condition in dependencies(self.services[name]).items():
                self.wait_condition(dependency, condition, timeout_s)
            podman(*run_args(self.project, name, self.services[name], self.images))
            print(f"started {self.container(name)}", flush=True)

    def wait_ready(self, names: Iterable[str], timeout_s: float = 600) -> None:
        """Until each service is healthy (with a healthcheck), done (a one-off job: restart "no"), or running."""
        for name in names:
            if probe(self.services[name]) is None and str(self.services[name].get("restart", "no")) == "no":
                self.wait_condition(name, "service_completed_successfully", timeout_s)
            else:
                self.wait_condition(name, "service_healthy", timeout_s)

    def logs(self, name: str, tail: int = 40) -> str:
        result = podman("logs", "--tail", str(tail), self.container(name), check=False)
        return result.stdout + result.stderr

    def down(self) -> None:
        """Remove the pod, its containers and the project's volumes (whatever state they are in)."""
        podman("pod", "rm", "--force", "--ignore", self.project, check=False, timeout=180)
        for container in podman("ps", "-aq", "--filter", f"label={LABEL}={self.project}").stdout.split():
            podman("rm", "--force", container, check=False)
        volumes = podman("volume", "ls", "-q").stdout.split()
        ours = [v for v in volumes if v.startswith(f"{self.project}_")]
        if ours:
            podman("volume", "rm", "--force", *ours, check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--project", required=True)
    parser.add_argument("--file", type=Path, default=Path(__file__).resolve().parents[2] / "compose.yaml")
    parser.add_argument("--image", action="append", default=[], metavar="FROM=TO")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up")
    up.add_argument("services", nargs="+")
    up.add_argument("--wait", action="store_true", help="until every service started is healthy (or done)")
    sub.add_parser("down")
    args = parser.parse_args(argv)
    env = dict(os.environ)
    services = load(args.file, env)["services"]
    pod = Pod(args.project, services, dict(item.split("=", 1) for item in args.image))
    if args.command == "down":
        pod.down()
        return 0
    names = start_order(services, args.services, profiles_from(env))
    try:
        pod.up(names)
        if args.wait:
            pod.wait_ready(names)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"compose_pod: {exc}", file=sys.stderr)
        for name in names:
            print(f"--- {name} ---\n{pod.logs(name)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
