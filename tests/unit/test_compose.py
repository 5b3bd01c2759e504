"""compose.yaml cannot run here (no Docker engine), so it is checked by parsing: the services exist, every loraplex
command is one the CLI accepts, and every LORAPLEX_* variable is a real setting."""

from __future__ import annotations

from pathlib import Path

import yaml

from loraplex.cli import build_parser
from loraplex.settings import Settings

COMPOSE = Path(__file__).resolve().parents[2] / "compose.yaml"


def test_compose_services_use_real_commands_and_settings() -> None:
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    assert {"redis", "postgres", "migrate", "api", "pool"} <= set(services)
    for name in ("migrate", "api", "pool"):
        command = services[name]["command"]
        assert command[0] == "loraplex"
        build_parser().parse_args(command[1:])  # raises SystemExit on an unknown command or flag
        for var in services[name]["environment"]:
            assert var.startswith("LORAPLEX_")
            assert var.removeprefix("LORAPLEX_").lower() in Settings.model_fields, var
