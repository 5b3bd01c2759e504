"""The gateway's service layer (loraplex.service) called directly, as the Tinker routes, the admin and the
pipelines will call it: real Redis and SQLite, no worker pool. Each rule raises its typed error and a rejected call
leaves nothing behind (no row, no queued request)."""

from __future__ import annotations

import math

import pytest

from loraplex import service
from loraplex.errors import ConflictError, InvalidRequestError, NotFoundError, RequestTooLargeError
from loraplex.protocol import DatumPayload, ForwardBackwardPayload, OptimStepPayload
from loraplex.protocol.checkpoint_paths import CheckpointKind, checkpoint_blob_key, tinker_path
from loraplex.protocol.defaults import ADAM_DEFAULTS
from loraplex.service import TenantRef
from loraplex.service.schemas import (
    CreateAdapterRequest,
    Datum,
    ForwardBackwardRequest,
    LoadStateRequest,
    OptimStepRequest,
    SaveCheckpointRequest,
)
from loraplex.storage.blobs import BlobStore
from loraplex.storage.repositories import AdapterRepository, CheckpointRepository, unit_of_work
from tests.helpers.queued import queued as _queued
from tests.helpers.queued import queued_work, rejections


@pytest.fixture()
def ctx(gateway):
    tenants = {name: TenantRef(tenant_id, name) for name, tenant_id in gateway.tenant_ids.items()}
    return gateway.services, tenants["alice"], tenants["bob"]


def _adapter_rows(services, tenant: TenantRef) -> list[str]:
    with services.sessions() as db:
        return [a.model_id for a in AdapterRepository(db, tenant.id).list(include_deleted=True)]


def _saved(services, tenant: TenantRef, model_id: str, kind: CheckpointKind, name: str) -> str:
    """What the recorder does once a worker saved: the folder the gateway chose, and the row."""
    store = BlobStore(services.settings.resolved_blob_root)
    folder = store.path(checkpoint_blob_key(tenant.id, model_id, kind, name))
    folder.mkdir(parents=True)
    with unit_of_work(services.sessions) as session:
        CheckpointRepository(session, tenant.id).add(model_id, kind, name, folder.as_uri(), 1, "0" * 64, step=2)
    return tinker_path(model_id, kind, name)


def _fb(*data: Datum, loss_fn: str = "cross_entropy") -> ForwardBackwardPayload:
    """The payload the native route builds from its body (seq_id 0 here: the service takes the seq_id apart)."""
    return ForwardBackwardRequest(seq_id=0, data=list(data), loss_fn=loss_fn).payload()


def _datum(n: int = 2) -> Datum:
    return Datum(model_input=list(range(1, n + 1)), loss_fn_inputs={"target_tokens": list(range(2, n + 2))})


def test_create_fills_the_defaults_and_queues_the_creation(ctx):
    services, alice, _ = ctx
    ref = service.create_adapter(services, alice, CreateAdapterRequest(rank=4))
    envelope = _queued(services)[ref.request_id]
    assert str(envelope.kind) == "create_adapter" and envelope.model_id == ref.model_id
    payload = envelope.payload.to_wire()
    assert payload["rank"] == 4 and payload["alpha"] == 8.0  # alpha defaults to 2 x rank
    assert 0 <= payload["seed"] < 2**31 and payload["base_model"] == services.settings.base_model
    assert payload["target_modules"] == list(services.settings.target_modules) and payload["from_checkpoint"] is None
    adapter = service.get_adapter(services, alice, ref.model_id)
    assert (adapter.rank, adapter.alpha, adapter.seed, adapter.applied_seq_id) == (4, 8.0, payload["seed"], 0)
    assert service.owner_of(services, ref.request_id) == alice.id
    given = service.create_adapter(services, alice, CreateAdapterRequest(rank=2, alpha=3.0, seed=7))
    assert _queued(services)[given.request_id].payload.to_wire() | {"target_modules": None} == {
        "base_model": services.settings.base_model,
        "rank": 2,
        "alpha": 3.0,
        "seed": 7,
        "target_modules": None,
        "from_checkpoint": None,
    }


def test_create_checks_the_base_model_and_the_rank_and_writes_nothing_when_they_fail(ctx):
    services, alice, _ = ctx
    before = len(_queued(services))
    with pytest.raises(InvalidRequestError, match="maximum rank 16"):
        service.create_adapter(services, alice, CreateAdapterRequest(rank=17))
    with pytest.raises(InvalidRequestError, match="is not served here"):
        service.create_adapter(services, alice, CreateAdapterRequest(base_model="gpt-5"))
    assert _adapter_rows(services, alice) == [] and len(_queued(services)) == before


def test_create_from_a_checkpoint_takes_its_hparams_and_folder(ctx):
    services, alice, bob = ctx
    source = service.create_adapter(services, alice, CreateAdapterRequest(rank=4, alpha=5.0, seed=11)).model_id
    path = _saved(services, alice, source, CheckpointKind.STATE, "final")
    ref = service.create_adapter(services, alice, CreateAdapterRequest(from_checkpoint=path))
    payload = _queued(services)[ref.request_id].payload.to_wire()
    assert (payload["rank"], payload["alpha"], payload["seed"]) == (4, 5.0, 11)
    folder = BlobStore(services.settings.resolved_blob_root).path(
        checkpoint_blob_key(alice.id, source, CheckpointKind.STATE, "final")
    )
    assert payload["from_checkpoint"] == {"path": path, "directory": str(folder), "with_optimizer": True}
    # rank, alpha, seed come from the checkpoint: giving one is an error (even at its default value).
    with pytest.raises(InvalidRequestError, match=r"^rank, seed: taken from the checkpoint"):
        service.create_adapter(services, alice, CreateAdapterRequest(from_checkpoint=path, rank=8, seed=1))
    # Another tenant's checkpoint is not found, and leaves nothing behind.
    with pytest.raises(NotFoundError):
        service.create_adapter(services, bob, CreateAdapterRequest(from_checkpoint=path))
    assert _adapter_rows(services, bob) == []
    sampler = _saved(services, alice, source, CheckpointKind.SAMPLER, "s")
    with pytest.raises(InvalidRequestError, match="with_optimizer=false"):
        service.create_adapter(services, alice, CreateAdapterRequest(from_checkpoint=sampler))
    weights_only = CreateAdapterRequest(from_checkpoint=sampler, with_optimizer=False)
    assert service.create_adapter(services, alice, weights_only).model_id


def test_training_calls_check_the_adapter_and_the_datum_limits(ctx, monkeypatch):
    services, alice, bob = ctx
    model_id = service.create_adapter(services, alice, CreateAdapterRequest(rank=4)).model_id
    ref = service.forward_backward(services, alice, model_id, 1, _fb(_datum()))
    envelope = _queued(services)[ref.request_id]
    assert str(envelope.kind) == "forward_backward" and envelope.seq_id == 1
    assert envelope.payload.to_wire() == {
        "data": [{"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 3]}}],
        "loss_fn": "cross_entropy",
        "loss_fn_config": {},
    }
    forward = service.forward(services, alice, model_id, 2, _fb(_datum()))
    assert str(_queued(services)[forward.request_id].kind) == "forward"
    # A rejection after the seq_id was taken is queued in its place (the caller's next step must not wait for it).
    before = len(queued_work(services))
    monkeypatch.setattr(services.settings, "max_datums_per_request", 2)
    monkeypatch.setattr(services.settings, "max_tokens_per_datum", 5)
    with pytest.raises(RequestTooLargeError, match=r"data has 3 datums; at most 2 per request \(LORAPLEX_MAX_DATUMS"):
        service.forward_backward(services, alice, model_id, 3, _fb(_datum(), _datum(), _datum()))
    with pytest.raises(RequestTooLargeError, match=r"data\[1\] has 6 tokens; at most 5 per datum"):
        service.forward(services, alice, model_id, 4, _fb(_datum(), _datum(6)))
    no_targets = Datum(model_input=[1, 2])
    with pytest.raises(InvalidRequestError, match=r"data\[0\].loss_fn_inputs.target_tokens is required"):
        service.forward_backward(services, alice, model_id, 5, _fb(no_targets))
    held = rejections(services)
    assert sorted(seq for m, seq in held if m == model_id) == [3, 4, 5]
    assert held[(model_id, 4)].payload.to_wire() == {
        "rejected_kind": "forward", "error_type": "RequestTooLargeError",
        "message": "data[1] has 6 tokens; at most 5 per datum (LORAPLEX_MAX_TOKENS_PER_DATUM)",
    }  # fmt: skip
    with pytest.raises(InvalidRequestError):  # the same rejected call again: nothing more queued
        service.forward(services, alice, model_id, 4, _fb(_datum(), _datum(6)))
    with pytest.raises(ConflictError, match="seq_id 4 was already used by a rejected request"):
        service.forward(services, alice, model_id, 4, _fb(_datum()))  # the rejected seq_id is spent
    for call in (service.forward_backward, service.forward):  # another tenant's adapter: not found, nothing queued
        with pytest.raises(NotFoundError):
            call(services, bob, model_id, 6, _fb(_datum()))
    with pytest.raises(NotFoundError):
        service.optim_step(services, bob, model_id, 6, OptimStepRequest(seq_id=6).payload())
    assert len(queued_work(services)) == before and len(rejections(services)) == 3
    # Other losses need no target_tokens.
    assert service.forward_backward(services, alice, model_id, 6, _fb(no_targets, loss_fn="importance_sampling"))
    step = service.optim_step(services, alice, model_id, 7, OptimStepRequest(seq_id=7).payload())
    assert _queued(services)[step.request_id].payload.to_wire() == {"adam_params": dict(ADAM_DEFAULTS)}



def _datum_payload(model_input: list[int], **inputs: list) -> DatumPayload:
    return DatumPayload(model_input, {"target_tokens": [1] * len(model_input), **inputs})


@pytest.mark.parametrize(
    ("payload", "error", "message"),
    [
        (ForwardBackwardPayload(), InvalidRequestError, "data is empty"),
        (ForwardBackwardPayload((DatumPayload([]),)), InvalidRequestError, r"data\[0\].model_input is empty"),
        (ForwardBackwardPayload((_datum_payload([1, -2]),)), InvalidRequestError, "negative token id"),
        (
            ForwardBackwardPayload((_datum_payload([1, 2]), _datum_payload([1, 2], weights=[1.0]))),
            InvalidRequestError,
            r"data\[1\].loss_fn_inputs.weights has 1 values, model_input has 2",
        ),
        (
            ForwardBackwardPayload((_datum_payload([1, 2], weights=[1.0, math.nan]),)),
            InvalidRequestError,
            r"payload.data\[0\].loss_fn_inputs.weights\[1\] is nan",
        ),
        (
            ForwardBackwardPayload((_datum_payload([1, 2], advantages=[-math.inf, 0.0]),)),
            InvalidRequestError,
            r"advantages\[0\] is -inf",
        ),
        (ForwardBackwardPayload((_datum_payload([1]),), loss_fn="nope"), InvalidRequestError, "loss_fn 'nope'"),
        (
            ForwardBackwardPayload((_datum_payload([1]),), loss_fn="ppo", loss_fn_config={"clip": math.inf}),
            InvalidRequestError,
            "loss_fn_config.clip is inf",
        ),
        (
            ForwardBackwardPayload((_datum_payload([1], **{f"x{k}": [0.0] for k in range(8)}),)),
            RequestTooLargeError,
            r"data\[0\] has 9 loss_fn_inputs; at most 8 \(LORAPLEX_MAX_LOSS_INPUTS_PER_DATUM\)",
        ),
    ],
)
def test_a_payload_built_without_the_body_model_meets_every_rule(ctx, payload, error, message):
    """The Tinker routes build the payload straight from protobuf (no request model checks it first): the service's
    one check (and, for non-finite numbers, the queue's encoder) refuses what the native body's schema would, and the
    refusal holds its seq_id."""
    services, alice, _ = ctx
    model_id = service.create_adapter(services, alice, CreateAdapterRequest(rank=4)).model_id
    with pytest.raises(error, match=message):
        service.forward_backward(services, alice, model_id, 1, payload)
    assert rejections(services)[(model_id, 1)].payload.to_wire()["rejected_kind"] == "forward_backward"
    ok = ForwardBackwardPayload((_datum_payload([1, 2], weights=[1e308, 1e308]),), "ppo", {"clip": 0.2})
    assert service.forward_backward(services, alice, model_id, 2, ok).request_id


@pytest.mark.parametrize(
    ("params", "message"),
    [({"beta1": 1.0}, r"adam_params.beta1 must be >= 0 and < 1"), ({"momentum": 0.9}, "adam_params: unknown momentum")],
)
def test_an_optim_step_payload_is_held_to_the_adam_table(ctx, params, message):
    services, alice, _ = ctx
    model_id = service.create_adapter(services, alice, CreateAdapterRequest(rank=4)).model_id
    with pytest.raises(InvalidRequestError, match=message):
        service.optim_step(services, alice, model_id, 1, OptimStepPayload({**ADAM_DEFAULTS, **params}))
    assert rejections(services)[(model_id, 1)].payload.to_wire()["rejected_kind"] == "optim_step"


def test_saves_check_the_name_and_existing_checkpoints(ctx):
    services, alice, bob = ctx
    model_id = service.create_adapter(services, alice, CreateAdapterRequest(rank=4)).model_id
    before = len(queued_work(services))
    for seq_id, save in enumerate((service.save_state, service.save_weights_for_sampler), start=1):
        with pytest.raises(InvalidRequestError, match="invalid checkpoint name"):
            save(services, alice, model_id, SaveCheckpointRequest(seq_id=seq_id, name="../up"))
        with pytest.raises(NotFoundError):
            save(services, bob, model_id, SaveCheckpointRequest(seq_id=9, name="ok"))
    assert len(queued_work(services)) == before
    assert {seq for m, seq in rejections(services) if m == model_id} == {1, 2}  # held, not holes
    first = service.save_state(services, alice, model_id, SaveCheckpointRequest(seq_id=3, name="c", ttl_seconds=9))
    payload = _queued(services)[first.request_id].payload.to_wire()
    folder = BlobStore(services.settings.resolved_blob_root).path(
        checkpoint_blob_key(alice.id, model_id, CheckpointKind.STATE, "c")
    )
    assert payload == {
        "name": "c",
        "path": f"tinker://{model_id}/weights/c",
        "directory": str(folder),
        "blob_uri": folder.as_uri(),
        "ttl_seconds": 9,
        "base_model": services.settings.base_model,
        "overwrite": False,
    }
    _saved(services, alice, model_id, CheckpointKind.STATE, "c")
    retry = service.save_state(services, alice, model_id, SaveCheckpointRequest(seq_id=3, name="c", ttl_seconds=9))
    assert retry.request_id == first.request_id  # a retry gets its first request, not a conflict
    with pytest.raises(ConflictError, match=r"already exists \(pass overwrite=true\)"):
        service.save_state(services, alice, model_id, SaveCheckpointRequest(seq_id=4, name="c"))
    assert service.save_state(services, alice, model_id, SaveCheckpointRequest(seq_id=5, name="c", overwrite=True))
    sampler = service.save_weights_for_sampler(services, alice, model_id, SaveCheckpointRequest(seq_id=6, name="c"))
    assert _queued(services)[sampler.request_id].payload.to_wire()["directory"].endswith("/sampler/c")


def test_load_list_and_delete_checkpoints_stay_within_the_tenant(ctx):
    services, alice, bob = ctx
    model_id = service.create_adapter(services, alice, CreateAdapterRequest(rank=4)).model_id
    bobs = service.create_adapter(services, bob, CreateAdapterRequest(rank=4)).model_id
    path = _saved(services, alice, model_id, CheckpointKind.STATE, "final")
    with pytest.raises(NotFoundError):
        service.load_state(services, bob, bobs, LoadStateRequest(seq_id=1, path=path))
    with pytest.raises(InvalidRequestError, match="not a checkpoint path"):
        service.load_state(services, alice, model_id, LoadStateRequest(seq_id=1, path="weights/final"))
    # Both rejections hold their seq_id: bob's (alice's checkpoint is not found for him) in his own adapter's chain.
    assert set(rejections(services)) == {(bobs, 1), (model_id, 1)}
    load = service.load_state(services, alice, model_id, LoadStateRequest(seq_id=2, path=path))
    payload = _queued(services)[load.request_id].payload.to_wire()
    assert payload["path"] == path and payload["directory"].endswith(f"/{model_id}/state/final")
    with pytest.raises(NotFoundError):
        service.list_checkpoints(services, bob, model_id)
    (listed,) = service.list_checkpoints(services, alice, model_id)
    assert (listed.tinker_path, listed.checkpoint_id, listed.checkpoint_type, listed.kind) == (
        path,
        "weights/final",
        "training",
        "state",
    )
    with pytest.raises(NotFoundError):
        service.delete_checkpoint(services, bob, model_id, "weights", "final")
    with pytest.raises(NotFoundError, match="no checkpoint kind"):
        service.delete_checkpoint(services, alice, model_id, "other", "final")
    folder = services.settings.resolved_blob_root / alice.id / model_id / "state" / "final"
    assert service.delete_checkpoint(services, alice, model_id, "state", "final").tinker_path == path
    assert not folder.exists() and service.list_checkpoints(services, alice, model_id) == []


def test_list_get_and_delete_adapters(ctx):
    services, alice, bob = ctx
    model_id = service.create_adapter(services, alice, CreateAdapterRequest(rank=4)).model_id
    assert [a.model_id for a in service.list_adapters(services, alice)] == [model_id]
    assert [a.model_id for a in service.list_adapters(services, bob)] == []
    with pytest.raises(NotFoundError):
        service.get_adapter(services, bob, model_id)
    with pytest.raises(NotFoundError):
        service.delete_adapter(services, bob, model_id)
    ref = service.delete_adapter(services, alice, model_id)
    assert str(_queued(services)[ref.request_id].kind) == "delete_adapter"
    with pytest.raises(NotFoundError):
        service.get_adapter(services, alice, model_id)
    assert service.list_adapters(services, alice) == []
