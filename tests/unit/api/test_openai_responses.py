"""The OpenAI endpoint's pure parts on the tiny preset's tokenizer (loaded as the gateway does, through `tokenizers`):
decoded text (special tokens skipped, cut at a stop string), stream pieces that join to the text (never a half
character), logprobs shapes, SSE framing, and chat templates rendered with jinja2."""

from __future__ import annotations

import json

import pytest

from loraplex.api.openai import responses
from loraplex.api.openai.stream_state import StreamState
from loraplex.api.openai.tokenizer import GatewayTokenizer
from loraplex.errors import InvalidRequestError
from loraplex.models.tokenizer import EOS_TOKEN


def _seq(tok: GatewayTokenizer, text: str, stop_reason: str = "stop", eos: bool = False, topk: bool = False) -> dict:
    tokens = tok.encode(text) + ([tok.tokenizer.token_to_id(EOS_TOKEN)] if eos else [])
    return {"tokens": tokens, "logprobs": [-0.5 - i for i in range(len(tokens))], "stop_reason": stop_reason,
            "topk_logprobs": [[[t, -0.1], [1, -3.0]] for t in tokens] if topk else None}  # fmt: skip


def test_text_skips_the_eos_and_is_cut_before_a_stop_string(tok: GatewayTokenizer) -> None:
    d = responses.decode_sequence(tok, _seq(tok, "the cat sat", eos=True), [], pieces=True)
    assert (d.text, d.finish_reason, len(d.tokens)) == ("the cat sat", "stop", len(tok.encode("the cat sat")) + 1)
    assert "".join(d.pieces) == d.text and d.pieces[-1] == ""  # the EOS adds no text
    cut = responses.decode_sequence(tok, _seq(tok, "the cat. sat on"), [" on", "."], pieces=True)
    assert cut.text == "the cat" and "".join(cut.pieces) == "the cat"
    # A sample that ran to its length is not cut (the sampler would have ended it with "stop" at the string).
    assert responses.decode_sequence(tok, _seq(tok, "a. b", "length"), ["."], pieces=False).text == "a. b"


def test_stream_pieces_never_split_a_character(tok: GatewayTokenizer) -> None:
    text = "héllo ✓ wörld — 猫"
    d = responses.decode_sequence(tok, _seq(tok, text, "length"), [], pieces=True)
    assert len(d.tokens) > len(text.split()) and "".join(d.pieces) == text
    assert not any("\ufffd" in p for p in d.pieces)


def test_logprobs_in_openais_shapes(tok: GatewayTokenizer) -> None:
    d = responses.decode_sequence(tok, _seq(tok, "the cat", eos=True, topk=True), [], pieces=True)
    legacy = responses.completion_logprobs(tok, d)
    assert legacy["tokens"][-1] == EOS_TOKEN and legacy["token_logprobs"] == d.logprobs
    assert "".join(legacy["tokens"][:-1]) == "the cat" and legacy["text_offset"][0] == 0
    assert all(len(row) == 2 and row[tok.token_text(1)] == -3.0 for row in legacy["top_logprobs"])
    chat = responses.chat_logprobs(tok, d)["content"]
    assert [e["logprob"] for e in chat] == d.logprobs and chat[0]["bytes"] == list(chat[0]["token"].encode())
    assert [x["logprob"] for x in chat[0]["top_logprobs"]] == [-0.1, -3.0]


def test_chat_chunks_and_sse(tok: GatewayTokenizer) -> None:
    """Results alone (no partials: a sampler that answers whole): each choice opens with its role, its text, its
    finish_reason; then usage; framed as SSE."""
    builder = responses.ChunkBuilder(tok, "id", 1, "m", chat=True, with_logprobs=False)
    state = StreamState(tok, builder, [], ["r0", "r1"], 1)
    texts = ("one two", "three")
    chunks = state.opening()
    for i, t in enumerate(texts):
        chunks += state.result(f"r{i}", {"sequences": [_seq(tok, t)]})
    chunks += state.closing(3, include_usage=True)
    for i, t in enumerate(texts):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""} and mine[-1]["finish_reason"] == "stop"
        assert "".join(c["delta"].get("content", "") for c in mine) == t
    completion = sum(len(tok.encode(t)) for t in texts)
    assert chunks[-1] == {**chunks[-1], "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": completion,
                                                                 "total_tokens": 3 + completion}}  # fmt: skip
    framed = b"".join([*map(responses.sse_event, chunks), responses.SSE_DONE]).decode()
    events = framed.split("\n\n")
    assert events[-2] == "data: [DONE]" and events[-1] == ""
    assert [json.loads(e[len("data: "):]) for e in events[:-2]] == chunks


def test_a_chat_template_renders_with_jinja(tok: GatewayTokenizer) -> None:
    template = ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
                "<{{ m.role }}>{{ m.content | tojson }}{{ eos_token }}\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")  # fmt: skip
    t = GatewayTokenizer(tok.tokenizer, template, {"eos_token": EOS_TOKEN}, "")
    text, templated = t.render_chat([{"role": "user", "content": "héllo \"x\""}])
    assert templated and text == f'<user>"héllo \\"x\\""{EOS_TOKEN}\n<assistant>'
    with pytest.raises(InvalidRequestError, match="no tools"):
        t.render_chat([{"role": "tool", "content": "x"}])
    plain, templated = tok.render_chat([{"role": "user", "content": "hi"}])
    assert (plain, templated) == ("user: hi\nassistant:", False)
