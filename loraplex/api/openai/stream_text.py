"""A sample's text sent a piece at a time (pure): while the pool samples (`TextCursor.advance`, from the tokens so far)
and once its result is in (`TextCursor.finish`, from the result's text: the whole answer's). The pieces concatenate
to the text the whole answer has, whatever the tokens' boundaries:

- never half a character: the decoded text so far shows a trailing partial UTF-8 sequence as U+FFFD, held back until
  the next token completes it;
- never past a stop string: text from a stop string's first occurrence on is not sent (the result's text is cut
  there), and a tail that may be the start of a stop string waits for the tokens that tell;
- only what extends what was sent: a decoder whose earlier text changes as tokens arrive sends nothing more until the
  result, and a result whose text does not extend what was sent (the sample was drawn again after a pool restart,
  without a seed) is a `StreamDiverged`.

Per token (`per_token`, for logprobs: each token's chunk carries its logprob) each prefix is decoded, O(n^2) in the
sample's length; otherwise one decode per update."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from loraplex.errors import EngineError

PARTIAL_CHARACTER = "\ufffd"


class Decoder(Protocol):
    def decode(self, tokens: list[int]) -> str: ...


class StreamDiverged(EngineError):
    """What the pool sampled does not extend what the stream already sent."""

    def __init__(self, message: str = "") -> None:
        super().__init__(message or (
            "the sample was drawn again (its pool restarted) and differs from what this stream sent; ask again (a "
            "request with a seed draws the same tokens every time)"
        ))  # fmt: skip


@dataclass(frozen=True)
class Piece:
    start: int  # the tokens [start, end) whose text this is (start == end: text held back until the end)
    end: int
    text: str
    offset: int  # where the piece starts in the sample's text (OpenAI's legacy text_offset)


def visible_reach(text: str, stops: Sequence[str]) -> int:
    """How much of a sample's text so far may be sent: not a trailing partial character, nothing from a stop string's
    first occurrence on, not a tail that is a proper prefix of a stop string."""
    reach = len(text.rstrip(PARTIAL_CHARACTER))
    for stop in stops:
        at = text.find(stop)
        if 0 <= at < reach:
            reach = at
    held = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, reach), held, -1):
            if text.endswith(stop[:k], 0, reach):
                held = k
                break
    return reach - held


@dataclass
class TextCursor:
    """One choice's stream: what was sent of its text and of its tokens."""

    sent: str = ""
    tokens_sent: int = 0

    def advance(self, tok: Decoder, tokens: list[int], stops: Sequence[str], per_token: bool) -> list[Piece]:
        """The pieces the tokens so far add (only those with text, unless per_token: then one per new token)."""
        pieces = []
        for end in range(self.tokens_sent + 1, len(tokens) + 1) if per_token else [len(tokens)]:
            text = tok.decode(tokens[:end])
            reach = visible_reach(text, stops) if text.startswith(self.sent) else len(self.sent)
            piece = self._take(text, max(reach, len(self.sent)), self.tokens_sent, end)
            if per_token or piece.text:
                pieces.append(piece)
                self.tokens_sent = end
        return pieces

    def finish(self, tok: Decoder, tokens: list[int], text: str, per_token: bool) -> list[Piece]:
        """The rest of the sample from its result (`text`: the answer's text, cut at a stop string): per_token, one
        piece per token not sent yet (its reach clamped to `text`) and, when tokens are all sent but text is held,
        one piece of no token; else one piece with the rest, if any. StreamDiverged unless `text` extends what was
        sent."""
        if not text.startswith(self.sent):
            raise StreamDiverged
        pieces = []
        if per_token:
            for end in range(self.tokens_sent + 1, len(tokens) + 1):
                last = end == len(tokens)
                reach = len(text) if last else min(len(tok.decode(tokens[:end]).rstrip(PARTIAL_CHARACTER)), len(text))
                pieces.append(self._take(text, max(reach, len(self.sent)), end - 1, end))
        if len(self.sent) < len(text):
            pieces.append(self._take(text, len(text), self.tokens_sent, len(tokens)))
        self.tokens_sent = len(tokens)
        return pieces

    def _take(self, text: str, reach: int, start: int, end: int) -> Piece:
        piece = Piece(start, end, text[len(self.sent) : reach], len(self.sent))
        self.sent += piece.text
        return piece
