"""The Tinker SDK's protobuf messages (`tinker.proto.tinker_public_pb2`, package `tinker_public`), loaded WITHOUT
importing the `tinker` package: its `__init__` imports torch and transformers, and the gateway stays free of torch
(layering: api/ never imports torch). The module is registered under its own name, so an SDK imported later in the
same process (tests) finds it and the descriptor pool holds the file once."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

MODULE = "tinker.proto.tinker_public_pb2"


def _load() -> ModuleType:
    if MODULE in sys.modules:
        return sys.modules[MODULE]
    spec = importlib.util.find_spec("tinker")  # finds the package; runs none of it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the tinker package (a loraplex dependency) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "proto" / "tinker_public_pb2.py"
    module_spec = importlib.util.spec_from_file_location(MODULE, path)
    if module_spec is None or module_spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[MODULE] = module
    module_spec.loader.exec_module(module)
    return module


pb = _load()
