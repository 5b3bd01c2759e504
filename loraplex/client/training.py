"""One adapter's training calls. Each call takes the next `seq_id`, so the server applies them in call order even
when they are sent concurrently; a retried call with the same seq_id is answered once. A call returns its future at
once and its request is sent on the transport's threads (`Transport.send`), as the Tinker SDK's calls do: a closed
loop's forward_backward and optim_step travel together. A body that cannot be sent (a non-finite number) raises at
the call; the gateway's refusal raises from the future's `result()` (client/futures.py)."""

from __future__ import annotations

import os
import tarfile
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import IO, Any

from loraplex.client.futures import APIFuture
from loraplex.client.json_body import check_finite, encode
from loraplex.client.sampling import SamplingClient
from loraplex.client.transport import Transport
from loraplex.client.types import AdamParams, Datum, datum_json
from loraplex.errors import InvalidRequestError
from loraplex.protocol.checkpoint_paths import split_tinker_path

SEQ_ID_HEADER = "X-Seq-Id"  # read by the gateway (api/admission.py) when it refuses a body unread


class TrainingClient:
    def __init__(self, transport: Transport, model_id: str, next_seq_id: int = 1) -> None:
        self._transport = transport
        self.model_id = model_id
        self._next_seq = next_seq_id
        self._lock = threading.Lock()

    def _take_seq(self) -> int:
        with self._lock:
            seq, self._next_seq = self._next_seq, self._next_seq + 1
            return seq

    def _fb_body(self, data: Sequence[Datum | dict[str, Any]], loss_fn: str, config: dict[str, float] | None) -> dict:
        return {
            "data": [datum_json(d) for d in data],
            "loss_fn": loss_fn,
            "loss_fn_config": config or {},
        }

    def _numbered(self, body: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
        """`body` with the adapter's next seq_id, as JSON, and its headers; the seq_id is taken only once the body is
        known to be sendable: a non-finite number is an InvalidRequestError naming its field, and takes no seq_id (a
        taken one that never reaches the server would make the next call wait for it). The seq_id also rides in a
        header: a body the gateway refuses unread (413, too large) still names its seq_id, whose place the gateway
        then fills with the rejection (so the next call does not wait for it)."""
        check_finite(body)
        seq_id = self._take_seq()
        headers = {SEQ_ID_HEADER: str(seq_id), "Content-Type": "application/json"}
        return encode({"seq_id": seq_id, **body}), headers

    def _submit(self, path: str, body: dict[str, Any]) -> APIFuture:
        content, headers = self._numbered(body)
        path = f"/v1/adapters/{self.model_id}/{path}"
        return APIFuture.send(self._transport, path, self.model_id, content=content, headers=headers)

    async def _submit_async(self, path: str, body: dict[str, Any]) -> APIFuture:
        content, headers = self._numbered(body)
        path = f"/v1/adapters/{self.model_id}/{path}"
        ref = await self._transport.request_async("POST", path, content=content, headers=headers)
        return APIFuture(self._transport, ref["request_id"], ref["model_id"])

    def forward_backward(
        self, data: Sequence[Datum | dict[str, Any]], loss_fn: str = "cross_entropy", loss_fn_config: dict | None = None
    ) -> APIFuture:
        """Accumulate gradients; the result holds per-datum `logprobs` and `metrics["loss:sum"]`."""
        return self._submit("forward_backward", self._fb_body(data, loss_fn, loss_fn_config))

    def forward(
        self, data: Sequence[Datum | dict[str, Any]], loss_fn: str = "cross_entropy", loss_fn_config: dict | None = None
    ) -> APIFuture:
        """Outputs and loss only; no gradient."""
        return self._submit("forward", self._fb_body(data, loss_fn, loss_fn_config))

    def optim_step(self, adam_params: AdamParams | dict[str, float] | None = None) -> APIFuture:
        """Apply the accumulated gradients with AdamW and clear them."""
        params = adam_params.to_json() if isinstance(adam_params, AdamParams) else dict(adam_params or {})
        return self._submit("optim_step", {"adam_params": params})

    async def forward_backward_async(
        self, data: Sequence[Datum | dict[str, Any]], loss_fn: str = "cross_entropy", loss_fn_config: dict | None = None
    ) -> APIFuture:
        return await self._submit_async("forward_backward", self._fb_body(data, loss_fn, loss_fn_config))

    async def forward_async(
        self, data: Sequence[Datum | dict[str, Any]], loss_fn: str = "cross_entropy", loss_fn_config: dict | None = None
    ) -> APIFuture:
        return await self._submit_async("forward", self._fb_body(data, loss_fn, loss_fn_config))

    async def optim_step_async(self, adam_params: AdamParams | dict[str, float] | None = None) -> APIFuture:
        params = adam_params.to_json() if isinstance(adam_params, AdamParams) else dict(adam_params or {})
        return await self._submit_async("optim_step", {"adam_params": params})

    # ---- checkpoints (steps in seq_id order, like optim_step) ---------------------------------------------------------
    def _save_body(self, name: str, ttl_seconds: int | None, overwrite: bool) -> dict[str, Any]:
        return {"name": name, "ttl_seconds": ttl_seconds, "overwrite": overwrite}

    def save_state(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False) -> APIFuture:
        """Save weights + optimizer state as `name`; the result's `path` (tinker://<model_id>/weights/<name>) is what
        `load_state` and `ServiceClient.create_training_client_from_state` take. An existing name is a ConflictError
        unless `overwrite`; `ttl_seconds` makes the checkpoint expire (the retention job deletes it)."""
        return self._submit("save_state", self._save_body(name, ttl_seconds, overwrite))

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False) -> APIFuture:
        """Save the weights only (tinker://<model_id>/sampler_weights/<name>): for sampling and `loraplex export`."""
        return self._submit("save_weights_for_sampler", self._save_body(name, ttl_seconds, overwrite))

    def save_weights_and_get_sampling_client(self, name: str | None = None, ttl_seconds: int | None = None) -> SamplingClient:
        """Save the weights for sampling (as `name`, default `sampler-<seq_id>`), wait for it, and return a
        SamplingClient over that frozen copy: it keeps sampling these weights while this adapter trains on."""
        with self._lock:
            name = name or f"sampler-{self._next_seq}"
        path = self.save_weights_for_sampler(name, ttl_seconds, overwrite=True).result()["path"]
        out = self._transport.request("POST", "/v1/samplers", json={"model_path": path})
        return SamplingClient(self._transport, out["sampler_id"], out["model_path"])

    def load_state(self, path: str, with_optimizer: bool = True) -> APIFuture:
        """Replace this adapter's weights (and Adam state, `with_optimizer`) with a checkpoint of this tenant."""
        body = {"path": path, "with_optimizer": with_optimizer}
        return self._submit("load_state", body)

    async def save_state_async(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False) -> APIFuture:
        return await self._submit_async("save_state", self._save_body(name, ttl_seconds, overwrite))

    async def save_weights_for_sampler_async(
        self, name: str, ttl_seconds: int | None = None, overwrite: bool = False
    ) -> APIFuture:
        return await self._submit_async("save_weights_for_sampler", self._save_body(name, ttl_seconds, overwrite))

    def list_checkpoints(self) -> list[dict[str, Any]]:
        """This adapter's checkpoints, oldest first (`tinker_path`, `kind`, `name`, `size_bytes`, `step`, ...)."""
        return self._transport.request("GET", f"/v1/adapters/{self.model_id}/checkpoints")["checkpoints"]

    def delete_checkpoint(self, path: str) -> dict[str, Any]:
        """Delete one of this adapter's checkpoints (row and files) by its tinker path."""
        model_id, segment, name = split_tinker_path(path)  # the server reads the kind from the segment
        if model_id != self.model_id:
            raise InvalidRequestError(f"{path} is not a checkpoint of adapter {self.model_id}")
        return self._transport.request("DELETE", f"/v1/adapters/{model_id}/checkpoints/{segment}/{name}")

    def export_peft(self, out_dir: str | os.PathLike[str], checkpoint: str | None = None) -> Path:
        """Download a saved checkpoint of this adapter as a PEFT folder into `out_dir` (created if needed; returned):
        adapter_model.safetensors + adapter_config.json (base_model_name_or_path: the base model's name) + the base
        model's tokenizer, for `peft.PeftModel.from_pretrained(base, out_dir)` or a vLLM server. `checkpoint`: a tinker
        path of this adapter or `<weights|sampler_weights>/<name>`; default the latest sampler or state checkpoint.
        NotFoundError when nothing is saved yet (or the adapter is not this tenant's); InvalidRequestError for a
        tampered checkpoint."""
        params = {"checkpoint": checkpoint} if checkpoint is not None else None
        with tempfile.TemporaryFile() as archive:
            self._transport.download(f"/v1/adapters/{self.model_id}/export", archive, params=params)
            archive.seek(0)
            return extract_tar(archive, Path(out_dir))

    def download_checkpoint_archive(self, out_file: str | os.PathLike[str], checkpoint: str | None = None) -> Path:
        """Download a saved checkpoint of this adapter as a tar archive of its PEFT folder (what `export_peft`
        extracts) into the file `out_file` (returned), written whole or not at all. `checkpoint`: as for
        `export_peft`."""
        out = Path(out_file)
        params = {"checkpoint": checkpoint} if checkpoint is not None else None
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}.", delete=False) as part:
            try:
                self._transport.download(f"/v1/adapters/{self.model_id}/export", part, params=params)
                part.close()
                os.replace(part.name, out)
            except BaseException:
                part.close()
                Path(part.name).unlink(missing_ok=True)
                raise
        return out

    def info(self) -> dict[str, Any]:
        return self._transport.request("GET", f"/v1/adapters/{self.model_id}")

    def delete(self) -> dict[str, Any]:
        ref = self._transport.request("DELETE", f"/v1/adapters/{self.model_id}")
        return APIFuture(self._transport, ref["request_id"], ref["model_id"]).result()


def extract_tar(archive: IO[bytes], out_dir: Path) -> Path:
    """Extract a tar archive of plain files and folders into `out_dir`, checking every member first: an absolute
    name, a '..' component, a link or a device anywhere is an InvalidRequestError and nothing is extracted."""
    try:
        with tarfile.open(fileobj=archive, mode="r:*") as tar:
            members = tar.getmembers()
            for member in members:
                name = PurePosixPath(member.name)
                if not member.name or name.is_absolute() or ".." in name.parts or "\\" in member.name:
                    raise InvalidRequestError(f"unsafe path {member.name!r} in the export archive")
                if not (member.isfile() or member.isdir()):
                    raise InvalidRequestError(f"{member.name!r} in the export archive is not a plain file")
            out_dir.mkdir(parents=True, exist_ok=True)
            tar.extractall(out_dir, members=members, filter="data")
    except tarfile.TarError as exc:
        raise InvalidRequestError(f"the export archive is unreadable: {exc}") from None
    return out_dir
