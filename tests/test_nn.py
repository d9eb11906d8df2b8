"""dilgen.nn layers against the float64 reference."""
from __future__ import annotations

import pytest
import torch

from dilgen.nn import DilatedAttention, KVCache, LongNetDecoderBlock, MultiheadDilatedAttention
from dilgen.reference import reference_attention

from conftest import device


def test_multihead_layer_matches_projections_plus_reference():
    torch.manual_seed(0)
    layer = MultiheadDilatedAttention(64, 4, [16, 32], [1, 2], num_kv_heads=2, device=device())
    x = torch.randn(2, 50, 64, device=device())
    with torch.no_grad():
        out, weights = layer(x)
        q = layer.q_proj(x).view(2, 50, 4, 16)
        k = layer.k_proj(x).view(2, 50, 2, 16)
        v = layer.v_proj(x).view(2, 50, 2, 16)
        attn = reference_attention(q, k, v, layer.spec).float().to(x.device)
        expect = layer.out_proj(attn.reshape(2, 50, 64))
    assert weights is None
    assert ((out - expect).norm() / expect.norm()).item() < 1e-4


def test_dilated_attention_module():
    layer = DilatedAttention(MultiheadDilatedAttention(32, 2, [8, 16], [1, 2]).spec)
    q, k, v = (torch.randn(1, 20, 2, 16, device=device()) for _ in range(3))
    out = layer(q, k, v)
    ref = reference_attention(q, k, v, layer.spec)
    assert ((out.double().cpu() - ref).norm() / ref.norm()).item() < 1e-4
    assert "w=[8, 16]" in repr(layer)


def test_decoder_block_runs_and_is_causal():
    torch.manual_seed(1)
    block = LongNetDecoderBlock(32, 2, [16, 32], [1, 2], device=device())
    x = torch.randn(1, 40, 32, device=device())
    with torch.no_grad():
        y = block(x)
        x2 = x.clone()
        x2[:, 30:] += 1.0           # changing the future must not change the past
        y2 = block(x2)
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert torch.allclose(y[:, :30], y2[:, :30], atol=1e-5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_first=False), "batch_first"),
    (dict(dropout=1.0), "dropout = 1.0: must be a probability"),
    (dict(dtype=torch.float64), "dtype"),
])
def test_layer_refuses_unsupported_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiheadDilatedAttention(32, 4, [16], [1], **kwargs)


@pytest.mark.parametrize("make, needle", [
    (lambda: MultiheadDilatedAttention(32, 0, [8], [1]), "num_heads = 0: must be an int >= 1"),
    (lambda: MultiheadDilatedAttention(32, 2, 8, [1]), "segment_lengths must be a list"),
    (lambda: MultiheadDilatedAttention(32, 2, None, [1]), "segment_lengths must be a list"),
    (lambda: MultiheadDilatedAttention(32, 2, [8], [1])(torch.randn(1, 8, 16)), r"query must be \(B, N, embed_dim = 32\)"),
    (lambda: MultiheadDilatedAttention(32, 2, [8], [1])(torch.randn(8, 32)), r"query must be \(B, N, embed_dim = 32\)"),
    (lambda: MultiheadDilatedAttention(32, 2, [8], [1])(torch.randn(1, 8, 32, dtype=torch.float64)),
     "query has dtype torch.float64"),
    (lambda: KVCache(1, 8.5, 2, 16), "max_len = 8.5: must be an int >= 1"),
    (lambda: MultiheadDilatedAttention(1200, 4, [8], [1]), "embed_dim = 1200 / num_heads = 4 gives head_dim = 300"),
])
def test_bad_layer_arguments_are_one_line(make, needle):
    """Issue 44: one ValueError line, never a ZeroDivisionError or a shape error from inside."""
    with pytest.raises(ValueError, match=needle) as info:
        make()
    assert "\n" not in str(info.value)


def test_layer_dropout_runs_in_training_only():
    """dropout=p: in training the kernel drops with p (torch.manual_seed reproduces a call,
    two calls differ, padded batches too); in eval it is the layer without dropout."""
    torch.manual_seed(0)
    layer = MultiheadDilatedAttention(32, 2, [8, 16], [1, 2], dropout=0.3, device=device())
    plain = MultiheadDilatedAttention(32, 2, [8, 16], [1, 2], device=device())
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(1, 32, 32, device=device())
    torch.manual_seed(4)
    a = layer(x)[0]
    b = layer(x)[0]
    torch.manual_seed(4)
    assert torch.equal(a, layer(x)[0]) and not torch.allclose(a, b)
    a.sum().backward()
    assert torch.isfinite(layer.q_proj.weight.grad).all()
    layer.eval()
    assert torch.equal(layer(x)[0], plain(x)[0])
    layer.train()
    mask = torch.zeros(1, 32, dtype=torch.bool, device=device())
    mask[0, 28:] = True
    torch.manual_seed(6)
    c = layer(x, key_padding_mask=mask)[0]
    torch.manual_seed(6)
    assert torch.equal(c, layer(x, key_padding_mask=mask)[0]) and torch.isfinite(c).all()
