"""The OpenAI routes' text bounds, checked before anything is tokenized: tokenizing runs on the gateway at ~1 s per MB,
so a 31 MB prompt would hold a worker (and the cores every tenant shares) for half a minute before its 400. Each limit
is a setting, named in its 413."""

from __future__ import annotations

from collections.abc import Sequence

from loraplex.api.openai.schemas import ChatMessage
from loraplex.errors import InvalidRequestError, RequestTooLargeError
from loraplex.settings import Settings


def text_bytes(text: str, limit: int) -> int:
    """`text`'s UTF-8 size; past `limit` characters it is over `limit` bytes anyway, so nothing is encoded then."""
    return len(text) + 1 if len(text) > limit else len(text.encode("utf-8", "surrogatepass"))


def check_prompt_count(settings: Settings, prompts: int, n: int) -> None:
    """prompts x n samples within LORAPLEX_MAX_SAMPLES_PER_REQUEST (each prompt is one sample request of n); a 400
    like the native routes' num_samples."""
    if prompts * n > settings.max_samples_per_request:
        raise InvalidRequestError(
            f"{prompts} prompts x n={n} samples; at most {settings.max_samples_per_request} in one request "
            "(LORAPLEX_MAX_SAMPLES_PER_REQUEST)"
        )


def check_prompt_bytes(settings: Settings, texts: Sequence[str], what: str = "prompt") -> None:
    """Each text within LORAPLEX_MAX_PROMPT_BYTES, all of them within LORAPLEX_MAX_PROMPT_BYTES_PER_REQUEST."""
    per_prompt, in_all = settings.resolved_max_prompt_bytes, settings.resolved_max_prompt_bytes_per_request
    total = 0
    for i, text in enumerate(texts):
        size = text_bytes(text, max(per_prompt, in_all))
        where = f"{what}[{i}]" if len(texts) > 1 else what
        if size > per_prompt:
            raise RequestTooLargeError(
                f"{where} is over {per_prompt} bytes; at most {per_prompt} (LORAPLEX_MAX_PROMPT_BYTES)"
            )
        total += size
        if total > in_all:
            raise RequestTooLargeError(
                f"the prompts are over {in_all} bytes in all; at most {in_all} per request "
                "(LORAPLEX_MAX_PROMPT_BYTES_PER_REQUEST)"
            )


def check_chat(settings: Settings, messages: Sequence[ChatMessage]) -> None:
    """A chat's message count (LORAPLEX_MAX_CHAT_MESSAGES) and its text's bytes (LORAPLEX_MAX_PROMPT_BYTES): the
    messages render into one prompt. Non-text parts count nothing here; the route refuses them."""
    if len(messages) > settings.max_chat_messages:
        raise RequestTooLargeError(
            f"messages: {len(messages)}; at most {settings.max_chat_messages} (LORAPLEX_MAX_CHAT_MESSAGES)"
        )
    limit = settings.resolved_max_prompt_bytes
    total = 0
    for message in messages:
        content = message.content
        parts = [content] if isinstance(content, str) else [p.get("text") for p in content or [] if isinstance(p, dict)]
        for text in [message.role, message.name or "", *parts]:
            total += text_bytes(text, limit) if isinstance(text, str) else 0
        if total > limit:
            raise RequestTooLargeError(
                f"the messages are over {limit} bytes in all; at most {limit} (LORAPLEX_MAX_PROMPT_BYTES)"
            )
