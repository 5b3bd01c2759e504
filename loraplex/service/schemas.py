"""Request and response bodies of the native routes (`/v1`). Requests forbid unknown fields so typos fail loudly (422)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from loraplex.protocol.adam import ADAM_FIELD
from loraplex.protocol.checkpoint_paths import MAX_TTL_SECONDS
from loraplex.protocol.losses import LOSS_NAMES
from loraplex.protocol.payloads import DatumPayload, ForwardBackwardPayload, OptimStepPayload

if TYPE_CHECKING:
    LossFn = str
else:  # a Literal of protocol/losses.py's names: pydantic answers an unknown loss with the list of known ones
    LossFn = Literal[LOSS_NAMES]


class Strict(BaseModel):
    # allow_inf_nan=False: NaN and +-Infinity (which Python's JSON parser accepts) are a 422 naming the field, never a
    # silent null or default further on.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class CreateAdapterRequest(Strict):
    base_model: str | None = Field(None, description="Must be the pool's base model; empty means the pool's")
    rank: int = Field(8, ge=1, le=1024)
    alpha: float | None = Field(None, gt=0, description="LoRA alpha; empty means 2 x rank")
    seed: int | None = Field(None, ge=0, lt=2**63)
    user_metadata: dict[str, Any] = Field(default_factory=dict)
    from_checkpoint: str | None = Field(
        None, description="tinker://<model_id>/<weights|sampler_weights>/<name>: start from this checkpoint (rank, "
        "alpha and seed come from it) instead of from a seed"
    )
    with_optimizer: bool = Field(True, description="With from_checkpoint: also restore the Adam state (weights only if false)")
    target_modules: list[str] | None = Field(
        None, min_length=1, max_length=64,
        description="Train LoRA on these of the pool's target modules only (empty means all of them)",
    )  # fmt: skip


class Datum(Strict):
    """A datum of the native JSON body. Its rules are the body's schema (a 422 naming the field); the service checks
    the payload built from it again, with the rules every front end meets (service/training.py)."""

    model_input: list[int] = Field(..., min_length=1)
    loss_fn_inputs: dict[str, list[float] | list[int]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _lengths_match(self) -> Datum:
        n = len(self.model_input)
        for name, values in self.loss_fn_inputs.items():
            if len(values) != n:
                raise ValueError(f"loss_fn_inputs.{name} has {len(values)} values, model_input has {n}")
        if min(self.model_input) < 0:  # min_length=1; min runs in C (a generator took ~0.3 ms on 4,096 tokens)
            raise ValueError("model_input holds a negative token id")
        return self


class ForwardBackwardRequest(Strict):
    seq_id: int = Field(..., ge=0, lt=2**31)
    data: list[Datum] = Field(..., min_length=1)
    loss_fn: LossFn = "cross_entropy"
    loss_fn_config: dict[str, float] = Field(default_factory=dict)

    def payload(self) -> ForwardBackwardPayload:
        """The queued payload, built in one step (the service checks it: service/training.py)."""
        return ForwardBackwardPayload(
            data=tuple(DatumPayload(d.model_input, d.loss_fn_inputs) for d in self.data),
            loss_fn=self.loss_fn,
            loss_fn_config=self.loss_fn_config,
        )


def adam_field(name: str) -> Any:
    """The request field of one AdamW hyperparameter: its default and bounds from protocol/adam.py (a value out of
    them is a 4xx naming the field)."""
    spec = ADAM_FIELD[name]
    return Field(spec.default, ge=spec.ge, gt=spec.gt, lt=spec.lt, allow_inf_nan=False)


class AdamFields(BaseModel):
    """AdamW's six fields with protocol/adam.py's defaults and bounds, for every request model that carries them (this
    one, the Tinker body, a pipeline's optimizer config); each model brings its own config (extra fields...)."""

    learning_rate: float = adam_field("learning_rate")
    beta1: float = adam_field("beta1")
    beta2: float = adam_field("beta2")
    eps: float = adam_field("eps")
    weight_decay: float = adam_field("weight_decay")
    grad_clip_norm: float = adam_field("grad_clip_norm")


class AdamParams(Strict, AdamFields):
    """The native optim_step's hyperparameters (tests/unit/test_shared_tables.py holds every model to ADAM_FIELDS)."""


class OptimStepRequest(Strict):
    seq_id: int = Field(..., ge=0, lt=2**31)
    adam_params: AdamParams = Field(default_factory=lambda: AdamParams.model_validate({}))

    def payload(self) -> OptimStepPayload:
        """The queued payload: every hyperparameter by name, defaults filled in."""
        return OptimStepPayload(adam_params=self.adam_params.model_dump())


class SaveCheckpointRequest(Strict):
    seq_id: int = Field(..., ge=0, lt=2**31)
    name: str = Field(..., min_length=1, max_length=255, description="Letters, digits, '_', '-', '.'; no path tricks")
    ttl_seconds: int | None = Field(
        None, gt=0, le=MAX_TTL_SECONDS, description="Delete the checkpoint this long after it is saved"
    )
    overwrite: bool = Field(False, description="Replace an existing checkpoint of this name (else 409)")


class LoadStateRequest(Strict):
    seq_id: int = Field(..., ge=0, lt=2**31)
    path: str = Field(..., description="tinker://<model_id>/<weights|sampler_weights>/<name>")
    with_optimizer: bool = True


class CheckpointOut(BaseModel):
    """One checkpoint, with Tinker's listing fields (`checkpoint_id`, `checkpoint_type`, `tinker_path`, `time`)."""

    checkpoint_id: str  # "weights/<name>" or "sampler_weights/<name>"
    checkpoint_type: str  # "training" or "sampler"
    tinker_path: str
    model_id: str
    kind: str  # "state" or "sampler"
    name: str
    size_bytes: int | None  # None (with sha256) while the files of an answered sampler save are still being written
    sha256: str | None
    step: int
    time: Any
    expires_at: Any | None = None


class CheckpointListOut(BaseModel):
    checkpoints: list[CheckpointOut]


class Cursor(BaseModel):
    """Where a page sits in a listing (Tinker's cursor): its offset and limit, and how many items there are in all."""

    offset: int
    limit: int
    total_count: int


class CheckpointPage(BaseModel):
    """A page of the tenant's checkpoints across its runs, newest first."""

    checkpoints: list[CheckpointOut]
    cursor: Cursor


class RunOut(BaseModel):
    """A training run (an adapter; its model_id is the training_run_id) with Tinker's TrainingRun fields, then ours.
    Deleted adapters stay listed: `status` says "deleted"."""

    training_run_id: str
    base_model: str
    model_owner: str  # the tenant's name
    is_lora: bool = True
    corrupted: bool = False
    lora_rank: int
    last_request_time: Any  # the adapter's last_used_at, or created_at before its first step
    last_checkpoint: CheckpointOut | None = None  # the newest state checkpoint (weights/<name>)
    last_sampler_checkpoint: CheckpointOut | None = None  # the newest sampler checkpoint (sampler_weights/<name>)
    user_metadata: dict[str, Any] = Field(default_factory=dict)
    status: str
    applied_seq_id: int | None
    session_id: str | None = None


class RunPage(BaseModel):
    """A page of the tenant's training runs, newest first."""

    training_runs: list[RunOut]
    cursor: Cursor


class DeleteCheckpointsRequest(Strict):
    paths: list[str] = Field(..., description="tinker://<model_id>/<weights|sampler_weights>/<name>, at most 1000")


class CheckpointTtlRequest(Strict):
    path: str = Field(..., description="tinker://<model_id>/<weights|sampler_weights>/<name>")
    ttl_seconds: int | None = Field(..., description="Expire this long from now (> 0); null: never expire")


class WeightsInfoRequest(Strict):
    tinker_path: str = Field(..., description="tinker://<model_id>/<weights|sampler_weights>/<name>")


class WeightsInfoOut(BaseModel):
    """What a checkpoint's weights are (Tinker's weights_info fields, then ours)."""

    base_model: str
    is_lora: bool = True
    lora_rank: int
    train_unembed: bool = False
    train_mlp: bool  # the adapter targets gate/up/down_proj
    train_attn: bool  # the adapter targets q/k/v/o_proj
    tinker_path: str
    model_id: str
    kind: str  # "state" or "sampler"
    checkpoint_type: str  # "training" or "sampler"
    size_bytes: int
    step: int


class FutureRef(BaseModel):
    request_id: str
    model_id: str


class AdapterOut(BaseModel):
    model_id: str
    base_model: str
    rank: int
    alpha: float
    seed: int
    status: str
    applied_seq_id: int | None
    target_modules: list[str]
    created_at: Any
    last_used_at: Any | None = None
    session_id: str | None = None  # the Tinker session that created it


class ErrorOut(BaseModel):
    type: str
    message: str
    category: str


class FutureOut(BaseModel):
    request_id: str
    state: str
    result: dict[str, Any] | None = None
    error: ErrorOut | None = None
    # While not final (queued/running), Tinker's queue_state: "active", or "paused_capacity" while the pool is down
    # (no recent heartbeat, or still loading its model), with a reason for people.
    queue_state: str | None = None
    queue_state_reason: str | None = None


class CreateSamplerRequest(Strict):
    model_path: str | None = Field(
        None, max_length=1024, description="tinker://<model_id>/sampler_weights/<name>; empty samples the base model"
    )
    base_model: str | None = Field(None, description="Must be the pool's base model; empty means the pool's")


class SamplerOut(BaseModel):
    sampler_id: str
    base_model: str
    model_path: str | None = None


class SampleRequest(Strict):
    seq_id: int = Field(..., ge=0, lt=2**31, description="The sampler's request counter: (sampler, seq_id) is idempotent")
    prompt: list[int] = Field(..., min_length=1)
    num_samples: int = Field(1, ge=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_k: int = Field(-1, ge=-1)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | list[int] | None = Field(
        None, description="Stop strings or token ids; null stops at EOS only, [] not even there"
    )
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = Field(0, ge=0, le=20)
    topk_sample_logprobs: int = Field(0, ge=0, le=20)


class PipelineOut(BaseModel):
    """An offline fine-tuning pipeline and its progress (loraplex/pipelines/)."""

    id: str
    name: str
    sweep_id: str | None
    sweep_point: dict[str, Any]
    state: str  # queued, running, succeeded, failed, cancelled
    step: int
    total_steps: int
    attempt: int  # runs of its task so far (more than 1: resumed after a worker died)
    model_id: str | None  # the adapter the current run trains
    last_checkpoint: str | None
    last_checkpoint_step: int | None
    eval_losses: list[list[float]]  # [[step, mean loss per completion token], ...]
    train_losses: list[list[float]]
    final_checkpoint: str | None  # tinker path of the final sampler weights
    export_path: str | None  # the API path its PEFT export downloads from (a tar), never a server path
    error: str | None
    config: dict[str, Any]
    created_at: Any
    started_at: Any | None = None
    finished_at: Any | None = None


class SubmittedPipelines(BaseModel):
    pipelines: list[PipelineOut]
    sweep_id: str | None = None


class PipelineList(BaseModel):
    pipelines: list[PipelineOut]
    total_count: int


class PipelineWorkers(BaseModel):
    """How many pipelines workers are alive (each beats every `heartbeat_seconds`; one that missed three is not)."""

    alive: int
    heartbeat_seconds: float
