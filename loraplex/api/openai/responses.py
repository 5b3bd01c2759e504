"""Samples (the pool's result: per sequence `tokens`, `logprobs`, `stop_reason`, `topk_logprobs`) as OpenAI's bodies.

- text: the tokens decoded without special tokens (an EOS the sample stopped at is not text); a sample that ended on
  a stop string is cut before its first occurrence (the pool keeps the token that completed it: cutting is ours).
- finish_reason: the sample's stop_reason, "stop" (EOS or a stop string) or "length".
- logprobs: one entry per sampled token, the EOS or stop-string token included (completions: OpenAI's legacy
  {tokens, token_logprobs, top_logprobs, text_offset}; chat: {content: [{token, logprob, bytes, top_logprobs}]}).
  A token's text is its own decoding (a part of a multi-byte character shows as U+FFFD).
- streaming: the pool answers a sample whole, so a stream is sent at once when all its samples are done: one chunk
  per token (its piece of the text; pieces concatenate to the text), then one with the finish_reason, an optional
  usage chunk, and `data: [DONE]`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson

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
    """Each token's new text: the decoded prefix's growth, held back while it ends in a partial character, clamped
    to `text` (so a cut at a stop string holds). Decodes each prefix: O(n^2) in the sample's length."""
    out, end = [], 0
    for i in range(len(tokens)):
        prefix = tok.decode(tokens[: i + 1])
        reach = len(text) if i == len(tokens) - 1 else min(len(prefix.rstrip("\ufffd")), len(text))
        reach = max(reach, end)
        out.append(text[end:reach])
        end = reach
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


# ---- completions ----------------------------------------------------------------------------------------------------
def completion_logprobs(tok: GatewayTokenizer, d: Decoded, start: int = 0, stop: int | None = None) -> dict[str, Any]:
    """OpenAI's legacy logprobs of tokens [start, stop): tokens, token_logprobs, top_logprobs, text_offset."""
    stop = len(d.tokens) if stop is None else stop
    offsets, at = [], 0
    for piece in d.pieces or [""] * len(d.tokens):
        offsets.append(at)
        at += len(piece)
    return {
        "tokens": [tok.token_text(t) for t in d.tokens[start:stop]],
        "token_logprobs": d.logprobs[start:stop],
        "top_logprobs": [{tok.token_text(t): lp for t, lp in row} for row in d.topk[start:stop]]
        if d.topk is not None
        else None,
        "text_offset": offsets[start:stop],
    }


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


def completion_chunks(
    tok: GatewayTokenizer, rid: str, created: int, model: str, choices: list[Decoded], with_logprobs: bool,
    usage_chunk: dict[str, int] | None,
) -> Iterator[dict[str, Any]]:  # fmt: skip
    head = {"id": rid, "object": "text_completion", "created": created, "model": model, "system_fingerprint": None}
    for i, d in enumerate(choices):
        for t, piece in enumerate(d.pieces):
            if piece or with_logprobs:
                lp = completion_logprobs(tok, d, t, t + 1) if with_logprobs else None
                yield {**head, "choices": [{"index": i, "text": piece, "logprobs": lp, "finish_reason": None}]}
        yield {**head, "choices": [{"index": i, "text": "", "logprobs": None, "finish_reason": d.finish_reason}]}
    if usage_chunk is not None:
        yield {**head, "choices": [], "usage": usage_chunk}


# ---- chat -----------------------------------------------------------------------------------------------------------
def _entry(tok: GatewayTokenizer, token: int, logprob: float | None) -> dict[str, Any]:
    piece = tok.token_text(token)
    return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}


def chat_logprobs(tok: GatewayTokenizer, d: Decoded, start: int = 0, stop: int | None = None) -> dict[str, Any]:
    stop = len(d.tokens) if stop is None else stop
    content = []
    for t in range(start, stop):
        entry = _entry(tok, d.tokens[t], d.logprobs[t] if t < len(d.logprobs) else None)
        entry["top_logprobs"] = [_entry(tok, i, lp) for i, lp in d.topk[t]] if d.topk is not None else []
        content.append(entry)
    return {"content": content, "refusal": None}


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


def chat_chunks(
    tok: GatewayTokenizer, rid: str, created: int, model: str, choices: list[Decoded], with_logprobs: bool,
    usage_chunk: dict[str, int] | None,
) -> Iterator[dict[str, Any]]:  # fmt: skip
    head = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
    }
    for i, d in enumerate(choices):
        yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}]}  # fmt: skip
        for t, piece in enumerate(d.pieces):
            if piece or with_logprobs:
                lp = chat_logprobs(tok, d, t, t + 1) if with_logprobs else None
                yield {**head, "choices": [{"index": i, "delta": {"content": piece}, "logprobs": lp,
                                            "finish_reason": None}]}  # fmt: skip
        yield {**head, "choices": [{"index": i, "delta": {}, "logprobs": None, "finish_reason": d.finish_reason}]}
    if usage_chunk is not None:
        yield {**head, "choices": [], "usage": usage_chunk}


def sse(chunks: Iterator[dict[str, Any]]) -> Iterator[bytes]:
    """Server-Sent Events: `data: <json>` per chunk, then `data: [DONE]`."""
    for chunk in chunks:
        yield b"data: " + orjson.dumps(chunk) + b"\n\n"
    yield b"data: [DONE]\n\n"
