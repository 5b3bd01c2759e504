"""OpenAI's request bodies for /v1/completions and /v1/chat/completions. Unknown fields are ignored (clients send many,
e.g. `user`, `metadata`, `store`); the known ones that would change the result and that this sampler cannot honour are
refused by `unsupported()` with a 400 naming them, never silently dropped. A value of the wrong type is a 400 naming
the field (api/errors.py renders validation errors of these paths in OpenAI's shape)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 512  # OpenAI's chat has no fixed default (the context's rest); ours is this
MAX_STOP_SEQUENCES = 16


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


def _check_utf8(value: Any) -> None:
    """JSON may escape a lone surrogate ("\\ud800"); no tokenizer, Redis key or database takes one."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("a string holds a lone surrogate (not valid UTF-8)") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_utf8(k)
            _check_utf8(v)
    elif isinstance(value, list):
        for v in value:
            _check_utf8(v)


class StreamOptions(Lenient):
    include_usage: bool = False


class SamplingFields(Lenient):
    """What both endpoints share."""

    model: str = Field(..., min_length=1, max_length=1024)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, description="An extension (vLLM's): -1 = off")
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, unused
    # Known and refused unless neutral (they change what is sampled): see unsupported().
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _utf8(self) -> SamplingFields:
        _check_utf8(self.model_dump())
        return self

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return stops

    def common_unsupported(self) -> list[str]:
        names = []
        if self.presence_penalty:
            names.append("presence_penalty")
        if self.frequency_penalty:
            names.append("frequency_penalty")
        if self.logit_bias:
            names.append("logit_bias")
        return names


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(
        None, ge=0, le=20, description="Top-k logprobs per sampled token (0: the token's only)"
    )
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        names = self.common_unsupported()
        if self.echo:
            names.append("echo")
        if self.best_of is not None and self.best_of != self.n:
            names.append("best_of")
        if self.suffix:
            names.append("suffix")
        return names

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: one string or token-id list, or a list of those."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return [[]]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(Lenient):
    role: str = Field(..., min_length=1, max_length=64)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as one string; a non-text part (an image, audio) is refused by the route."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(TextPart.model_validate(part).text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None

    def unsupported(self) -> list[str]:
        names = self.common_unsupported()
        for name in ("tools", "functions", "audio", "prediction"):
            if getattr(self, name):
                names.append(name)
        if self.tool_choice not in (None, "none"):
            names.append("tool_choice")
        if self.function_call not in (None, "none"):
            names.append("function_call")
        if self.response_format and self.response_format.get("type", "text") != "text":
            names.append("response_format")
        if self.modalities and set(self.modalities) != {"text"}:
            names.append("modalities")
        if self.top_logprobs and not self.logprobs:
            names.append("top_logprobs (needs logprobs: true)")
        return names

    def new_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_CHAT_MAX_TOKENS
