"""One streamed call's choices (pure): fed the pool's partial entries (queue/sample_partials.py) and the requests'
results, it answers the chunks to send. Prompt p's sample s is choice p x n + s, whichever request feeds it first.

A partial delta extends its choice's tokens when it starts where they end, repeats are skipped (a pool that restarted
publishes from 0 again) and checked (other tokens: StreamDiverged), and a gap (an entry lost) leaves the choice to its
result. The result is the answer: its text (decoded and cut as the non-streaming answer is, responses.py) finishes
each choice, so the streamed text equals the non-streaming text for the same seed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loraplex.api.openai.responses import ChunkBuilder, decode_sequence, usage
from loraplex.api.openai.stream_text import StreamDiverged, TextCursor
from loraplex.api.openai.tokenizer import GatewayTokenizer
from loraplex.queue.sample_partials import PartialEntry, TopK

Chunk = dict[str, Any]


@dataclass
class _Choice:
    cursor: TextCursor = field(default_factory=TextCursor)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk: TopK = field(default_factory=list)
    gap: bool = False  # a delta was lost: the rest of its text comes with the result
    done: bool = False


class StreamState:
    def __init__(
        self, tok: GatewayTokenizer, chunks: ChunkBuilder, stops: Sequence[str], request_ids: Sequence[str], n: int,
    ) -> None:  # fmt: skip
        self.tok = tok
        self.chunks = chunks
        self.stops = list(stops)
        self.n = n
        self.first_choice = {rid: i * n for i, rid in enumerate(request_ids)}
        self.choices = [_Choice() for _ in range(len(request_ids) * n)]
        self.completion_tokens = 0

    @property
    def per_token(self) -> bool:
        """One chunk per token (each carries its logprobs) instead of one per piece of new text."""
        return self.chunks.with_logprobs

    def opening(self) -> list[Chunk]:
        return [c for i in range(len(self.choices)) if (c := self.chunks.opening(i)) is not None]

    def partial(self, request_id: str, entry: PartialEntry) -> list[Chunk]:
        """The chunks a partial entry of this request adds (none for an end entry: its result follows)."""
        base = self.first_choice[request_id]
        grown: list[int] = []
        for delta in entry.deltas:
            if delta.sample >= self.n:
                continue  # not a sample of this request (a malformed entry): the result answers
            index = base + delta.sample
            choice = self.choices[index]
            if choice.done or choice.gap:
                continue
            have = len(choice.tokens)
            if delta.start > have:
                choice.gap = True
                continue
            overlap = have - delta.start
            if delta.tokens[:overlap] != choice.tokens[delta.start : delta.start + overlap]:
                raise StreamDiverged
            if len(delta.tokens) > overlap:
                choice.tokens += delta.tokens[overlap:]
                choice.logprobs += delta.logprobs[overlap:]
                choice.topk += (delta.topk or [])[overlap:]
                if index not in grown:
                    grown.append(index)
        out = []
        for index in grown:
            choice = self.choices[index]
            for piece in choice.cursor.advance(self.tok, choice.tokens, self.stops, self.per_token):
                chunk = self.chunks.piece(index, piece, choice.tokens, choice.logprobs, choice.topk or None)
                if chunk is not None:
                    out.append(chunk)
        return out

    def result(self, request_id: str, result: dict[str, Any]) -> list[Chunk]:
        """The chunks that finish this request's choices from its result (its wire form: `sequences`)."""
        base = self.first_choice[request_id]
        out = []
        for s, seq in enumerate(result.get("sequences", [])[: self.n]):
            index = base + s
            choice = self.choices[index]
            if choice.done:
                continue
            decoded = decode_sequence(self.tok, seq, self.stops, pieces=False)
            sent = choice.cursor.tokens_sent
            if decoded.tokens[:sent] != choice.tokens[:sent]:
                raise StreamDiverged
            for piece in choice.cursor.finish(self.tok, decoded.tokens, decoded.text, self.per_token):
                chunk = self.chunks.piece(index, piece, decoded.tokens, decoded.logprobs, decoded.topk)
                if chunk is not None:
                    out.append(chunk)
            out.append(self.chunks.finish(index, decoded.finish_reason))
            choice.done = True
            self.completion_tokens += len(decoded.tokens)
        return out

    def closing(self, prompt_tokens: int, include_usage: bool) -> list[Chunk]:
        return [self.chunks.usage(usage(prompt_tokens, self.completion_tokens))] if include_usage else []
