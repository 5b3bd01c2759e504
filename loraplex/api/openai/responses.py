"""Samples (the pool's result: per sequence `tokens`, `logprobs`, `stop_reason`, `topk_logprobs`) as OpenAI's bodies.

- text: the tokens decoded without special tokens (an EOS the sample stopped at is not text); a sample that ended on
  a stop string is cut before its first occurrence (the pool keeps the token that completed it: cutting is ours).
- finish_reason: the sample's stop_reason, "stop" (EOS or a stop string) or "length".
- logprobs: one entry per sampled token, the EOS or stop-string token included (completions: OpenAI's legacy
  {tokens, token_logprobs, top_logprobs, text_offset}; chat: {content: [{token, logprob, bytes, top_logprobs}]}).
  A token's text is its own decoding (a part of a multi-byte character shows as U+FFFD).
- streaming (`ChunkBuilder`, driven by streaming.py as the tokens come): chat opens each choice with its role; then
  chunks of text pieces (stream_text.py: they concatenate to the text), one per token with its logprobs when asked,
  else one per piece of new text; one chunk with the finish_reason per choice, an optional usage chunk, and
  `data: [DONE]`. Choices interleave, each chunk naming its index."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from loraplex.api.openai.stream_text import Piece, TextCursor
from loraplex.api.openai.tokenizer import GatewayTokenizer


@dataclass(frozen=True)
class Decoded:
    text: str
    finish_reason: str
    tokens: list[int]
    logprobs: list[float | None]
    topk: list[list[tuple[int, float]]] | None
    pieces: list[str]  # per token, its new text; "".join(pieces) == text


def decode_sequence(tok: GatewayTokenizer, seq: dict[str, Any], stops: list[str], pieces: bool) -> Decoded:
    tokens = [int(t) for t in seq["tokens"]]
    finish = "stop" if seq.get("stop_reason") == "stop" else "length"
    text = tok.decode(tokens)
    if stops and finish == "stop":
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            text = text[: min(hits)]
    topk_raw = seq.get("topk_logprobs")
    topk = [[(int(t), float(lp)) for t, lp in row] for row in topk_raw] if topk_raw is not None else None
    return Decoded(text, finish, tokens, list(seq.get("logprobs") or []), topk,
                   _pieces(tok, tokens, text) if pieces else [])  # fmt: skip


def _pieces(tok: GatewayTokenizer, tokens: list[int], text: str) -> list[str]:
    """Each token's new text (stream_text.TextCursor.finish from nothing sent): the decoded prefix's growth, held
    back while it ends in a partial character, clamped to `text` (so a cut at a stop string holds)."""
    return [p.text for p in TextCursor().finish(tok, tokens, text, per_token=True)]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


# ---- logprobs ------------------------------------------------------------------------------------------------------
def _legacy_logprobs(
    tok: GatewayTokenizer, tokens: list[int], logprobs: list[float | None], topk: list[list[tuple[int, float]]] | None,
    offsets: list[int],
) -> dict[str, Any]:  # fmt: skip
    return {
        "tokens": [tok.token_text(t) for t in tokens],
        "token_logprobs": logprobs,
        "top_logprobs": [{tok.token_text(t): lp for t, lp in row} for row in topk] if topk is not None else None,
        "text_offset": offsets,
    }


def completion_logprobs(tok: GatewayTokenizer, d: Decoded, start: int = 0, stop: int | None = None) -> dict[str, Any]:
    """OpenAI's legacy logprobs of tokens [start, stop): tokens, token_logprobs, top_logprobs, text_offset."""
    stop = len(d.tokens) if stop is None else stop
    offsets, at = [], 0
    for piece in d.pieces or [""] * len(d.tokens):
        offsets.append(at)
        at += len(piece)
    topk = d.topk[start:stop] if d.topk is not None else None
    return _legacy_logprobs(tok, d.tokens[start:stop], d.logprobs[start:stop], topk, offsets[start:stop])


def _entry(tok: GatewayTokenizer, token: int, logprob: float | None) -> dict[str, Any]:
    piece = tok.token_text(token)
    return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}


def _chat_content(
    tok: GatewayTokenizer, tokens: list[int], logprobs: list[float | None], topk: list[list[tuple[int, float]]] | None
) -> dict[str, Any]:
    content = []
    for t, token in enumerate(tokens):
        entry = _entry(tok, token, logprobs[t] if t < len(logprobs) else None)
        entry["top_logprobs"] = [_entry(tok, i, lp) for i, lp in topk[t]] if topk is not None else []
        content.append(entry)
    return {"content": content, "refusal": None}


def chat_logprobs(tok: GatewayTokenizer, d: Decoded, start: int = 0, stop: int | None = None) -> dict[str, Any]:
    stop = len(d.tokens) if stop is None else stop
    topk = d.topk[start:stop] if d.topk is not None else None
    return _chat_content(tok, d.tokens[start:stop], d.logprobs[start:stop], topk)


# ---- whole bodies ---------------------------------------------------------------------------------------------------
def completion_body(
    tok: GatewayTokenizer, rid: str, created: int, model: str, choices: list[Decoded], with_logprobs: bool,
    prompt_tokens: int,
) -> dict[str, Any]:  # fmt: skip
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": i,
                "text": d.text,
                "finish_reason": d.finish_reason,
                "logprobs": completion_logprobs(tok, d) if with_logprobs else None,
            }  # fmt: skip
            for i, d in enumerate(choices)
        ],
        "usage": usage(prompt_tokens, sum(len(d.tokens) for d in choices)),
    }


def chat_body(
    tok: GatewayTokenizer, rid: str, created: int, model: str, choices: list[Decoded], with_logprobs: bool,
    prompt_tokens: int,
) -> dict[str, Any]:  # fmt: skip
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": d.text, "refusal": None},
                "logprobs": chat_logprobs(tok, d) if with_logprobs else None,
                "finish_reason": d.finish_reason,
            }  # fmt: skip
            for i, d in enumerate(choices)
        ],
        "usage": usage(prompt_tokens, sum(len(d.tokens) for d in choices)),
    }


# ---- streamed chunks ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChunkBuilder:
    """The chunks of one streamed answer (completions' `text_completion`, chat's `chat.completion.chunk`)."""

    tok: GatewayTokenizer
    rid: str
    created: int
    model: str
    chat: bool
    with_logprobs: bool

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}  # fmt: skip

    def opening(self, index: int) -> dict[str, Any] | None:
        """Chat's first chunk of a choice: its role (completions have none)."""
        if not self.chat:
            return None
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])  # fmt: skip

    def piece(
        self, index: int, piece: Piece, tokens: list[int], logprobs: Sequence[float | None],
        topk: list[list[tuple[int, float]]] | None,
    ) -> dict[str, Any] | None:  # fmt: skip
        """A piece of choice `index`'s text; with logprobs, those of its tokens ([piece.start, piece.end) of the
        sample's `tokens`). None when it carries nothing."""
        if not (piece.text or self.with_logprobs):
            return None
        lp = None
        if self.with_logprobs:
            a, b = piece.start, piece.end
            top = topk[a:b] if topk is not None else None
            values: list[float | None] = list(logprobs[a:b])
            lp = (_chat_content(self.tok, tokens[a:b], values, top) if self.chat
                  else _legacy_logprobs(self.tok, tokens[a:b], values, top, [piece.offset] * (b - a)))  # fmt: skip
        if self.chat:
            return self._chunk([{"index": index, "delta": {"content": piece.text}, "logprobs": lp,
                                 "finish_reason": None}])  # fmt: skip
        return self._chunk([{"index": index, "text": piece.text, "logprobs": lp, "finish_reason": None}])

    def finish(self, index: int, finish_reason: str) -> dict[str, Any]:
        if self.chat:
            return self._chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}])
        return self._chunk([{"index": index, "text": "", "logprobs": None, "finish_reason": finish_reason}])

    def usage(self, counts: dict[str, int]) -> dict[str, Any]:
        return {**self._chunk([]), "usage": counts}


def sse_event(chunk: dict[str, Any]) -> bytes:
    """Server-Sent Events: `data: <json>` per chunk, then SSE_DONE."""
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
