"""Offline fine-tuning pipelines from the client: read a config (YAML or a dict) and its JSONL dataset files, submit
them (the gateway checks both: a bad config is an InvalidRequestError naming the field), follow, cancel, and download
a pipeline's PEFT export and a sweep's report. Used by `ServiceClient` (its pipeline methods) and `loraplex finetune`."""

from __future__ import annotations

import builtins
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from loraplex.client.training import extract_tar
from loraplex.client.transport import Transport
from loraplex.errors import InvalidRequestError

FINISHED_STATES = frozenset({"succeeded", "failed", "cancelled"})
REPORT_FILES = ("report.md", "report.csv", "eval_loss.svg")


def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A YAML (or JSON) pipeline config as a dict; its dataset paths resolved against the config's folder."""
    import yaml

    file = Path(path)
    try:
        config = yaml.safe_load(file.read_text())
    except OSError as exc:
        raise InvalidRequestError(f"cannot read the config {file}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise InvalidRequestError(f"{file} is not valid YAML: {exc}") from None
    if not isinstance(config, dict):
        raise InvalidRequestError(f"{file}: the config must be a mapping of settings")
    dataset = config.get("dataset")
    if isinstance(dataset, dict):
        for split in ("train", "eval"):
            if isinstance(dataset.get(split), str):
                dataset[split] = str((file.parent / dataset[split]).expanduser())
    return config


def read_jsonl(path: str | os.PathLike[str], split: str) -> list[dict[str, Any]]:
    """The records of a JSONL file; a line that is not JSON is an InvalidRequestError naming it."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise InvalidRequestError(f"dataset.{split}: cannot read {file}: {exc.strerror}") from None
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{file}:{number}: not JSON ({exc.msg})") from None
    if not records:
        raise InvalidRequestError(f"dataset.{split}: {file} has no records")
    return records


def submission(config: dict[str, Any]) -> dict[str, Any]:
    """The body of POST /v1/pipelines: the config and the records of the files its dataset names."""
    dataset = config.get("dataset")
    if not isinstance(dataset, dict) or not isinstance(dataset.get("train"), str):
        raise InvalidRequestError("dataset.train: the path of a JSONL file is required")
    body: dict[str, Any] = {"config": config, "train": read_jsonl(dataset["train"], "train")}
    if isinstance(dataset.get("eval"), str):
        body["eval"] = read_jsonl(dataset["eval"], "eval")
    return body


class PipelineCalls:
    """The pipeline calls of a ServiceClient (over its transport)."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    def submit(self, config: dict[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
        """Submit a pipeline (or a sweep: one pipeline per grid point); `config` is a dict or a YAML file's path.
        Returns {"pipelines": [...], "sweep_id": ...}."""
        data = read_config(config) if not isinstance(config, dict) else config
        return self._transport.request("POST", "/v1/pipelines", json=submission(data))

    def get(self, pipeline_id: str) -> dict[str, Any]:
        return self._transport.request("GET", f"/v1/pipelines/{pipeline_id}")

    def list(self, sweep_id: str | None = None, limit: int = 100, offset: int = 0) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit, "offset": offset}
        if sweep_id is not None:
            params["sweep_id"] = sweep_id
        return self._transport.request("GET", "/v1/pipelines", params=params)

    def workers(self) -> dict[str, Any]:
        """{"alive": how many pipelines workers are alive, "heartbeat_seconds": how often each says so}."""
        return self._transport.request("GET", "/v1/pipelines/workers")

    def cancel(self, pipeline_id: str) -> dict[str, Any]:
        return self._transport.request("POST", f"/v1/pipelines/{pipeline_id}/cancel")

    def wait(self, pipeline_id: str, timeout: float = 3600.0, poll_s: float = 0.5) -> dict[str, Any]:
        """Poll until the pipeline has ended (succeeded, failed or cancelled); TimeoutError past `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            pipeline = self.get(pipeline_id)
            if pipeline["state"] in FINISHED_STATES:
                return pipeline
            if time.monotonic() > deadline:
                raise TimeoutError(f"pipeline {pipeline_id} still {pipeline['state']} after {timeout:g} s")
            time.sleep(poll_s)

    def download_export(self, pipeline_id: str, out_dir: str | os.PathLike[str]) -> Path:
        """A succeeded pipeline's PEFT export (adapter_model.safetensors, adapter_config.json, the tokenizer) into
        `out_dir` (created if needed; returned), from the `export_path` its answers name. NotFoundError before it is
        written."""
        with tempfile.TemporaryFile() as archive:
            self._transport.download(f"/v1/pipelines/{pipeline_id}/export", archive)
            archive.seek(0)
            return extract_tar(archive, Path(out_dir))

    def download_sweep_report(self, sweep_id: str, out_dir: str | os.PathLike[str]) -> builtins.list[Path]:
        """A finished sweep's report files (report.md, report.csv, eval_loss.svg) into `out_dir`."""
        folder = Path(out_dir)
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        for name in REPORT_FILES:
            with open(folder / name, "wb") as sink:
                self._transport.download(f"/v1/sweeps/{sweep_id}/report/{name}", sink)
            written.append(folder / name)
        return written
