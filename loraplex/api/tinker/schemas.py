"""JSON bodies of the Tinker routes (`/api/v1`), as the SDK 0.38 sends them (tinker-wire.md section 2).

Unknown fields are ignored, not refused: a newer SDK may add fields, and the SDK's own models forbid extras on its
side already. Values are still validated (types, ranges, no NaN): a bad one is a 422 naming the field."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from loraplex.service.schemas import AdamFields

SEQ_ID = Field(..., ge=0, lt=2**31)


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, protected_namespaces=())


class CreateSessionBody(Body):
    tags: list[str] = Field(default_factory=list, max_length=64)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""
    project_id: str | None = None
    display_name: str | None = None


class SessionBody(Body):
    session_id: str = Field(..., min_length=1, max_length=64)


class FinishReason(Body):
    type: str = "success"


class FinishBody(Body):
    reason: FinishReason = Field(default_factory=FinishReason)
    detail: str | None = None


class LoraConfigBody(Body):
    rank: int = Field(..., ge=1, le=1024)
    seed: int | None = Field(None, ge=0, lt=2**63)
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfigBody(Body):
    type: str = "adamw"


class CreateModelBody(Body):
    session_id: str = Field(..., min_length=1, max_length=64)
    model_seq_id: int = Field(..., ge=0, lt=2**31)
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfigBody | None = None
    optimizer_config: OptimizerConfigBody = Field(default_factory=OptimizerConfigBody)


class ModelBody(Body):
    model_id: str = Field(..., min_length=1, max_length=128)


class AdamParamsBody(Body, AdamFields):
    """Tinker's optim_step hyperparameters."""


class OptimStepBody(ModelBody):
    seq_id: int = SEQ_ID
    adam_params: AdamParamsBody | None = None
    # Another optimizer family's step (the SDK sends DimuonParams here); refused with a message naming it.
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsBody(ModelBody):
    seq_id: int = SEQ_ID
    path: str | None = Field(None, max_length=255)
    ttl_seconds: int | None = Field(None, gt=0)
    overwrite: bool = False
    user_metadata: dict[str, Any] | None = None


class SaveWeightsForSamplerBody(SaveWeightsBody):
    sampling_session_seq_id: int | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"


class LoadWeightsBody(Body):
    # Create-via-load: session_id + model_seq_id (the adapter id is "<session_id>:train:<model_seq_id>").
    # The deprecated load_state: model_id + seq_id (into that existing adapter).
    model_id: str | None = Field(None, min_length=1, max_length=128)
    seq_id: int | None = Field(None, ge=0, lt=2**31)
    session_id: str | None = Field(None, min_length=1, max_length=64)
    model_seq_id: int | None = Field(None, ge=0, lt=2**31)
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str = Field(..., min_length=1, max_length=1024)
    optimizer: bool = Field(False, validation_alias=AliasChoices("optimizer", "load_optimizer_state"))
    optimizer_config: OptimizerConfigBody | None = None


class RetrieveFutureBody(Body):
    request_id: str = Field(..., min_length=1, max_length=128)
    allow_metadata_only: bool = False


class TtlBody(Body):
    ttl_seconds: int | None = Field(None, gt=0)


class WeightsInfoBody(Body):
    tinker_path: str = Field(..., min_length=1, max_length=1024)


class CreateSamplingSessionBody(Body):
    session_id: str = Field(..., min_length=1, max_length=64)
    sampling_session_seq_id: int = Field(..., ge=0, lt=2**31)
    base_model: str | None = None
    model_path: str | None = Field(None, max_length=1024)


class PromptChunk(Body):
    type: str = "encoded_text"
    tokens: list[int] | None = None


class PromptBody(Body):
    chunks: list[PromptChunk] = Field(..., min_length=1)


class SamplingParamsBody(Body):
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(1.0, ge=0)
    top_k: int = Field(-1, ge=-1)
    top_p: float = Field(1.0, gt=0, le=1)


class AsampleBody(Body):
    sampling_session_id: str | None = Field(None, min_length=1, max_length=64)
    seq_id: int | None = Field(None, ge=0, lt=2**31)
    num_samples: int = Field(1, ge=1)
    prompt: PromptBody
    sampling_params: SamplingParamsBody = Field(default_factory=lambda: SamplingParamsBody.model_validate({}))
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = Field(0, ge=0, le=20)
    topk_sample_logprobs: int = Field(0, ge=0, le=20)
    # Options the native sampler does not offer yet: refused with a message, never ignored.
    target_prompt_logprobs: Any = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None
