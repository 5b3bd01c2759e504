"""The partial-sample wire (pure): what each sample gained since the last entry, as JSON and back; a malformed entry
is a ValueError naming it."""

from __future__ import annotations

import pytest

from loraplex.queue.sample_partials import END, SampleDelta, decode_entry, encode_deltas, sequence_deltas
from loraplex.workers.sampling.jobs import SampledSequence


def test_deltas_carry_only_what_each_sample_gained_and_copy_it() -> None:
    a = SampledSequence([5, 6], [-0.5, -0.25], "", [[(5, -0.5)], [(6, -0.25)]])
    b = SampledSequence([], [], "", [])
    published: list[int] = []
    first = sequence_deltas(published, [a, b])
    assert first == [SampleDelta(0, 0, [5, 6], [-0.5, -0.25], [[(5, -0.5)], [(6, -0.25)]])] and published == [2, 0]
    for seq, token in ((a, 7), (b, 9)):  # the sampler's lists grow in place
        seq.tokens.append(token)
        seq.logprobs.append(-1.0)
        seq.topk_logprobs.append([(token, -1.0)])
    assert first[0].tokens == [5, 6]  # a delta keeps what it was
    second = sequence_deltas(published, [a, b])
    assert [(d.sample, d.start, d.tokens) for d in second] == [(0, 2, [7]), (1, 0, [9])] and published == [3, 1]
    assert sequence_deltas(published, [a, b]) == []


def test_entries_round_trip_and_malformed_ones_are_refused() -> None:
    deltas = [SampleDelta(0, 3, [1, 2], [-0.5, -1.5], None), SampleDelta(1, 0, [4], [-0.125], [[(4, -0.125), (2, -3.0)]])]
    entry = decode_entry(encode_deltas(deltas))
    assert entry.deltas == deltas and not entry.end
    assert decode_entry(END).end
    for bad in (b"nope", b'{"s": [[0, -1, [1], [0.0], null]]}', b'{"s": [[0]]}', b'{"x": 1}', b"[]"):
        with pytest.raises(ValueError, match="malformed partial-sample entry"):
            decode_entry(bad)
