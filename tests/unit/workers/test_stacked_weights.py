"""Sibling base weights stacked in one buffer: each layer's weight a view of its rows, one product for the group equal to
the layers' products side by side, the engine stacking q/k/v and gate/up, and the decode step reading the stack."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.workers.engine.stacked_weights import stack_base_weights, stacked_weight


def _layers(outs: tuple[int, ...], width: int = 12, bias: bool = False) -> list[nn.Linear]:
    torch.manual_seed(0)
    layers = [nn.Linear(width, n, bias=bias) for n in outs]
    for layer in layers:
        layer.weight.requires_grad_(False)
    return layers


def test_stacking_keeps_each_weight_and_makes_one_product() -> None:
    layers = _layers((8, 4, 4))
    before = [layer.weight.clone() for layer in layers]
    assert stacked_weight(layers) is None  # separate storages
    assert stack_base_weights(layers)
    for layer, w in zip(layers, before, strict=True):
        assert torch.equal(layer.weight, w) and not layer.weight.requires_grad
    stacked = stacked_weight(layers)
    assert stacked is not None and stacked.shape == (16, 12)
    x = torch.randn(5, 12)
    assert torch.allclose(F.linear(x, stacked), torch.cat([layer(x) for layer in layers], dim=1), atol=1e-6)
    stacked[0, 0] = 3.0  # one buffer: the layer sees it
    assert layers[0].weight[0, 0].item() == 3.0
    assert stack_base_weights(layers)  # stacked already: unchanged
    assert stacked_weight(layers).data_ptr() == stacked.data_ptr()  # type: ignore[union-attr]


def test_layers_that_do_not_qualify_stay_as_they_are() -> None:
    with_bias = _layers((4, 4), bias=True)
    assert not stack_base_weights(with_bias) and stacked_weight(with_bias) is None
    widths = [nn.Linear(12, 4, bias=False), nn.Linear(10, 4, bias=False)]
    for layer in widths:
        layer.weight.requires_grad_(False)
    assert not stack_base_weights(widths)
    trainable = [nn.Linear(12, 4, bias=False), nn.Linear(12, 4, bias=False)]
    assert not stack_base_weights(trainable)
    pair = _layers((4, 4))
    assert stack_base_weights(pair)
    assert stacked_weight(list(reversed(pair))) is None  # out of order: not one stack
    assert stacked_weight([pair[0]]) is None


def test_engine_stacks_siblings_and_the_decoder_reads_them(tiny_sampler_engine: tuple[Any, Any]) -> None:
    from loraplex.workers.sampling.static_decoder import StaticDecoder

    engine, _ = tiny_sampler_engine
    attention = engine.body.layers[0].self_attn
    stacked = stacked_weight([attention.q_proj.base, attention.k_proj.base, attention.v_proj.base])
    assert stacked is not None
    mlp = engine.body.layers[0].mlp
    assert stacked_weight([mlp.gate_proj.base, mlp.up_proj.base]) is not None
    decoder = StaticDecoder(engine, rows=2, width=16, groups=1, paged=True)
    attn_in, o_point, mlp_in, _ = decoder.points[0]
    assert attn_in.stacked is not None and mlp_in.stacked is not None
    assert o_point.stacked is None  # one layer: nothing to stack

