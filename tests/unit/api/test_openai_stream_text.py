"""Streamed text (pure, on the tiny preset's tokenizer): the pool's partial entries and then the result, fed to a
call's StreamState in any split, give chunks whose text joins to exactly the non-streaming answer's text, never half a
character, nothing from a stop string on (a tail that may start one waits), choices interleaved by index, repeats
skipped, a lost entry filled from the result, and a sample drawn again differently refused (StreamDiverged)."""

from __future__ import annotations

import random

import pytest

from loraplex.api.openai import responses
from loraplex.api.openai.stream_state import StreamState
from loraplex.api.openai.stream_text import StreamDiverged, TextCursor, visible_reach
from loraplex.api.openai.tokenizer import GatewayTokenizer
from loraplex.queue.sample_partials import PartialEntry, SampleDelta

TEXTS = ["the cat sat on the mat. the dog", "héllo ✓ wörld — 猫 sat", "plain words only here"]


def test_visible_reach_holds_partial_characters_stops_and_their_beginnings() -> None:
    assert visible_reach("abc\ufffd\ufffd", []) == 3
    assert visible_reach("the cat. sat", ["."]) == len("the cat")
    assert visible_reach("the cat sat", ["sat on"]) == len("the cat ")  # "sat" may become "sat on"
    assert visible_reach("the cat sa", ["sat on", "a"]) == len("the c")  # the first "a" is a stop
    assert visible_reach("the cat", ["dog"]) == len("the cat")


def _sample(tok: GatewayTokenizer, text: str, stops: list[str]) -> dict:
    """A sample as the pool answers it: the tokens up to the one that completes the first stop string ("stop"),
    else all of them ("length")."""
    tokens, reason = tok.encode(text), "length"
    for end in range(1, len(tokens) + 1):
        if any(s in tok.decode(tokens[:end]) for s in stops):
            tokens, reason = tokens[:end], "stop"
            break
    return {"tokens": tokens, "logprobs": [-0.25 * (i + 1) for i in range(len(tokens))], "stop_reason": reason,
            "topk_logprobs": None}  # fmt: skip


def _deltas(rng: random.Random, sample: int, seq: dict) -> list[SampleDelta]:
    """The sample's tokens so far in random slices (some not yet all of them: the rest comes with the result)."""
    tokens, cuts, at = seq["tokens"], [], 0
    upto = rng.randint(0, len(tokens))
    while at < upto:
        end = min(upto, at + rng.randint(1, 4))
        cuts.append(SampleDelta(sample, at, tokens[at:end], seq["logprobs"][at:end], None))
        at = end
    return cuts


def _texts(chunks: list[dict], chat: bool) -> dict[int, str]:
    out: dict[int, str] = {}
    for c in chunks:
        for choice in c["choices"]:
            piece = choice["delta"].get("content", "") if chat else choice["text"]
            out[choice["index"]] = out.get(choice["index"], "") + (piece or "")
            assert "\ufffd" not in (piece or "")
    return out


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("with_logprobs", [False, True])
@pytest.mark.parametrize("stops", [[], ["."], ["sat on", "—"]])
def test_any_split_of_partials_then_the_result_joins_to_the_whole_answer(
    tok: GatewayTokenizer, chat: bool, with_logprobs: bool, stops: list[str]
) -> None:
    sent_early = 0
    for trial in range(6):
        rng = random.Random(trial)
        n, prompts = 2, 2
        results = {f"r{p}": {"sequences": [_sample(tok, rng.choice(TEXTS), stops) for _ in range(n)]}
                   for p in range(prompts)}  # fmt: skip
        builder = responses.ChunkBuilder(tok, "id", 1, "m", chat=chat, with_logprobs=with_logprobs)
        state = StreamState(tok, builder, stops, list(results), n)
        queues = [[(rid, [d]) for d in _deltas(rng, s, seq)] for rid, r in results.items()
                  for s, seq in enumerate(r["sequences"])]  # fmt: skip
        entries = []
        while any(queues):  # the choices interleave, each sample's own deltas in order
            entries.append(rng.choice([q for q in queues if q]).pop(0))
        if trial % 3 == 2:
            rng.shuffle(entries)  # out of order too: gaps (left to the result) and late repeats
        chunks = state.opening()
        for rid, deltas in entries:
            chunks += state.partial(rid, PartialEntry(deltas))
        before_results = _texts(chunks, chat)
        sent_early += sum(map(len, before_results.values()))
        for rid in results:
            chunks += state.result(rid, results[rid])
        whole = [responses.decode_sequence(tok, seq, stops, pieces=False) for r in results.values()
                 for seq in r["sequences"]]  # fmt: skip
        assert _texts(chunks, chat) == {i: d.text for i, d in enumerate(whole)}
        for i, d in enumerate(whole):  # what was sent before the results is the start of the answer
            assert d.text.startswith(before_results.get(i, ""))
            finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["index"] == i]
            assert finishes[-1] == d.finish_reason and finishes.count(None) == len(finishes) - 1
            if with_logprobs:  # one chunk per token, each with its logprob: they are the answer's
                key = "content" if chat else "token_logprobs"
                lps = [c["choices"][0]["logprobs"][key] for c in chunks
                       if c["choices"][0]["index"] == i and c["choices"][0]["logprobs"]]  # fmt: skip
                got = [e["logprob"] for row in lps for e in row] if chat else [x for row in lps for x in row]
                assert got == d.logprobs and all(len(row) <= 1 for row in lps)
    assert sent_early > 0  # text went out before the results


def test_nothing_from_a_stop_string_on_is_sent_while_sampling(tok: GatewayTokenizer) -> None:
    builder = responses.ChunkBuilder(tok, "id", 1, "m", chat=False, with_logprobs=False)
    state = StreamState(tok, builder, ["sat on"], ["r"], 1)
    tokens = tok.encode("the cat sat on the mat")
    sent = ""
    for end in range(1, len(tokens) + 1):
        chunks = state.partial("r", PartialEntry([SampleDelta(0, end - 1, tokens[end - 1 : end], [0.0], None)]))
        sent += "".join(c["choices"][0]["text"] for c in chunks)
        assert "sat" not in sent and "the cat sat on the mat".startswith(sent)
    assert sent.startswith("the cat")


def test_repeats_are_skipped_a_gap_waits_for_the_result_and_other_tokens_diverge(tok: GatewayTokenizer) -> None:
    tokens = tok.encode("the cat sat on the mat")
    builder = responses.ChunkBuilder(tok, "id", 1, "m", chat=False, with_logprobs=False)
    state = StreamState(tok, builder, [], ["a", "b"], 1)
    first = state.partial("a", PartialEntry([SampleDelta(0, 0, tokens[:3], [0.0] * 3, None)]))
    again = state.partial("a", PartialEntry([SampleDelta(0, 0, tokens[:4], [0.0] * 4, None)]))  # a restarted pool
    text = "".join(c["choices"][0]["text"] for c in first + again)
    assert text == tok.decode(tokens[:4])
    assert state.partial("b", PartialEntry([SampleDelta(0, 2, tokens[2:4], [0.0] * 2, None)])) == []  # a gap
    assert state.partial("b", PartialEntry([SampleDelta(0, 0, tokens[:2], [0.0] * 2, None)])) == []  # then ignored
    whole = {"sequences": [{"tokens": tokens, "logprobs": [0.0] * len(tokens), "stop_reason": "length"}]}
    rest = state.result("b", whole)
    assert rest[0]["choices"][0]["text"] == "the cat sat on the mat"
    with pytest.raises(StreamDiverged, match="drawn again"):
        state.partial("a", PartialEntry([SampleDelta(0, 2, [tokens[2] + 1], [0.0], None)]))
    other = tok.encode("a dog ran")
    with pytest.raises(StreamDiverged):
        state.result("a", {"sequences": [{"tokens": other, "logprobs": [0.0] * len(other), "stop_reason": "stop"}]})


def test_a_cursor_finishing_alone_gives_the_pieces_of_the_whole_answer(tok: GatewayTokenizer) -> None:
    """The non-streaming logprobs' per-token pieces are the cursor's (responses._pieces), one per token."""
    text = "héllo ✓ wörld"
    tokens = tok.encode(text)
    pieces = TextCursor().finish(tok, tokens, text, per_token=True)
    assert [(p.start, p.end) for p in pieces] == [(i, i + 1) for i in range(len(tokens))]
    assert "".join(p.text for p in pieces) == text and pieces[-1].offset + len(pieces[-1].text) == len(text)
    with pytest.raises(StreamDiverged):
        TextCursor(sent="hello").finish(tok, tokens, text, per_token=False)
