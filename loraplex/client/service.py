"""Entry point of the Python client: one per server and API key."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from loraplex.client.futures import DEFAULT_RESULT_TIMEOUT_S, APIFuture
from loraplex.client.pipelines import PipelineCalls
from loraplex.client.sampling import SamplingClient
from loraplex.client.training import TrainingClient
from loraplex.client.transport import Transport, raise_for_status
from loraplex.errors import AuthenticationError
from loraplex.protocol.checkpoint_paths import split_tinker_path

DEFAULT_BASE_URL = "http://127.0.0.1:8700"


class ServiceClient:
    """`ServiceClient(base_url, api_key)`; both default to LORAPLEX_BASE_URL and LORAPLEX_API_KEY. Close it when done:
    `with ServiceClient() as client:` (or `close()`), and in async code `async with` (or `await aclose()`).

    `timeout`: seconds per HTTP call. `result_timeout`: how long a future's `result()` waits when not given a
    timeout (default 900 s = 15 minutes; None: forever); past it FutureTimeoutError names the request and the last
    queue_state the server reported (e.g. paused_capacity while the pool is down)."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float = 120.0,
        result_timeout: float | None = DEFAULT_RESULT_TIMEOUT_S,
    ) -> None:
        base_url = base_url or os.environ.get("LORAPLEX_BASE_URL", DEFAULT_BASE_URL)
        api_key = api_key or os.environ.get("LORAPLEX_API_KEY", "")
        if not api_key:
            raise AuthenticationError("no API key: pass api_key= or set LORAPLEX_API_KEY")
        self._transport = Transport(base_url, api_key, timeout, result_timeout)
        # Offline fine-tuning pipelines: submit(config or YAML path), get, list, cancel, wait, download_sweep_report.
        self.pipelines = PipelineCalls(self._transport)

    def create_lora_training_client(
        self,
        base_model: str | None = None,
        rank: int = 8,
        alpha: float | None = None,
        seed: int | None = None,
        user_metadata: dict[str, Any] | None = None,
        target_modules: list[str] | None = None,
    ) -> TrainingClient:
        """Create an adapter (waits until the pool has initialised it from its seed) and return its client.
        `target_modules`: train only these of the pool's modules (e.g. the attention projections); default all."""
        body = {"base_model": base_model, "rank": rank, "alpha": alpha, "seed": seed, "user_metadata": user_metadata or {},
                "target_modules": target_modules}  # fmt: skip
        ref = self._transport.request("POST", "/v1/adapters", json=body)
        APIFuture(self._transport, ref["request_id"], ref["model_id"]).result()
        return TrainingClient(self._transport, ref["model_id"], next_seq_id=1)

    def submit_pipeline(self, config: dict[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
        """Submit an offline fine-tuning pipeline (a dict, or a YAML config's path; its dataset files are read and
        uploaded): {"pipelines": [...], "sweep_id": ...} (a sweep config gives one pipeline per grid point). Follow
        them with `self.pipelines.get/wait`, stop one with `self.pipelines.cancel`."""
        return self.pipelines.submit(config)

    def create_training_client_from_state(self, path: str, with_optimizer: bool = True) -> TrainingClient:
        """A NEW adapter restored from a checkpoint of this tenant (`tinker://<model_id>/weights/<name>`, as returned
        by `save_state`): its weights, and its Adam state too `with_optimizer`, so training continues exactly where
        the saved adapter was. Waits until the pool has loaded it; a checkpoint that does not fit this pool (rank,
        target modules) raises InvalidRequestError, one of another tenant NotFoundError."""
        body = {"from_checkpoint": path, "with_optimizer": with_optimizer}
        ref = self._transport.request("POST", "/v1/adapters", json=body)
        APIFuture(self._transport, ref["request_id"], ref["model_id"]).result()
        return TrainingClient(self._transport, ref["model_id"], next_seq_id=1)

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None) -> SamplingClient:
        """A sampler over one of your sampler checkpoints (`tinker://<model_id>/sampler_weights/<name>`, as
        `save_weights_for_sampler` returns) or, with no path, the base model."""
        out = self._transport.request("POST", "/v1/samplers", json={"model_path": model_path, "base_model": base_model})
        return SamplingClient(self._transport, out["sampler_id"], out["model_path"])

    def list_checkpoints(self, model_id: str) -> list[dict[str, Any]]:
        """An adapter's checkpoints (also after the adapter was deleted), oldest first."""
        return self._transport.request("GET", f"/v1/adapters/{model_id}/checkpoints")["checkpoints"]

    def export_peft(self, model_id: str, out_dir: str | os.PathLike[str], checkpoint: str | None = None) -> Path:
        """Download an adapter's checkpoint as a PEFT folder into `out_dir` (see TrainingClient.export_peft)."""
        return TrainingClient(self._transport, model_id).export_peft(out_dir, checkpoint)

    def download_checkpoint_archive(self, path: str, out_file: str | os.PathLike[str]) -> Path:
        """Download the checkpoint at `path` (tinker://<model_id>/<weights|sampler_weights>/<name>) as a tar archive
        of its PEFT folder into the file `out_file` (returned; see TrainingClient.download_checkpoint_archive)."""
        model_id, _, _ = split_tinker_path(path)
        return TrainingClient(self._transport, model_id).download_checkpoint_archive(out_file, path)

    # ---- runs and checkpoints across them ----------------------------------------------------------------------------
    def list_runs(self, limit: int = 20, offset: int = 0) -> dict[str, Any]:
        """A page of this tenant's training runs (adapters, deleted ones too), newest first:
        {"training_runs": [...], "cursor": {"offset", "limit", "total_count"}}. limit: 1 to 1000."""
        return self._transport.request("GET", "/v1/runs", params={"limit": limit, "offset": offset})

    def get_run(self, model_id: str) -> dict[str, Any]:
        """A training run: Tinker's TrainingRun fields (training_run_id, base_model, model_owner, lora_rank,
        last_request_time, last_checkpoint, last_sampler_checkpoint, user_metadata, ...) and status, applied_seq_id."""
        return self._transport.request("GET", f"/v1/runs/{model_id}")

    def list_all_checkpoints(self, limit: int = 20, offset: int = 0) -> dict[str, Any]:
        """A page of this tenant's checkpoints across its runs, newest first: {"checkpoints": [...], "cursor": ...}."""
        return self._transport.request("GET", "/v1/checkpoints", params={"limit": limit, "offset": offset})

    def delete_checkpoints(self, paths: list[str]) -> list[dict[str, Any]]:
        """Delete the checkpoints at these tinker paths (at most 1000), all or none: one missing or not this tenant's
        raises NotFoundError naming it, and nothing is deleted. Returns the deleted checkpoints."""
        body = {"paths": list(paths)}
        return self._transport.request("POST", "/v1/checkpoints/delete", json=body)["checkpoints"]

    def delete_checkpoint(self, path: str) -> dict[str, Any]:
        """Delete one checkpoint (row and files) by its tinker path."""
        return self.delete_checkpoints([path])[0]

    def set_checkpoint_ttl(self, path: str, ttl_seconds: int | None) -> dict[str, Any]:
        """Expire the checkpoint `ttl_seconds` from now (the retention job then deletes it), or never with None."""
        return self._transport.request("PUT", "/v1/checkpoints/ttl", json={"path": path, "ttl_seconds": ttl_seconds})

    def weights_info(self, path: str) -> dict[str, Any]:
        """What the weights at a tinker path are: base_model, is_lora, lora_rank, train_mlp, train_attn,
        train_unembed, and the checkpoint's kind, size_bytes and step."""
        return self._transport.request("POST", "/v1/weights_info", json={"tinker_path": path})

    def training_client(self, model_id: str) -> TrainingClient:
        """A client for an existing adapter; its seq_ids continue after the last applied one."""
        info = self._transport.request("GET", f"/v1/adapters/{model_id}")
        applied = info["applied_seq_id"]
        return TrainingClient(self._transport, model_id, next_seq_id=(applied or 0) + 1)

    def list_adapters(self) -> list[dict[str, Any]]:
        return self._transport.request("GET", "/v1/adapters")

    def health(self) -> dict[str, Any]:
        """The gateway's /v1/healthz body (gateway, redis, database, pools), whether the service is up (200) or not
        (503: `status` "unavailable", `down` says what)."""
        response = self._transport.get_response("/v1/healthz")
        if response.status_code in (200, 503):
            return response.json()
        return raise_for_status(response)

    def close(self) -> None:
        """Close the HTTP connections, the async client's too (on its event loop: from async code prefer `aclose`)."""
        self._transport.close()

    async def aclose(self) -> None:
        """Close the HTTP connections from async code, on the event loop that made the async calls."""
        await self._transport.aclose()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> ServiceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
