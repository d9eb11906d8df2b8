"""Issue 16: torchscale's LongNet (Prov-GigaPath's slide encoder) on dilgen (docs/torchscale.md).

- the float64 reference with head_offsets "block" + short_segments "zero_pad" equals a
  re-expression of torchscale's algorithm (tests/torchscale_model.py) to 1e-12: outputs,
  LSEs and (with exact branch weights) gradients; its layout slip is refused in one line;
- dilgen.compat.torchscale: torchscale's signatures and parameter names, state_dict round
  trips, the unsupported features' errors, patch() on a 2-layer encoder and on GigaPath's
  slide encoder built their way, against the unpatched models (float64 reference);
- the same through dilgen's kernels (head_dim 48, block offsets, zero padding).
"""
from __future__ import annotations

import inspect
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torchscale_model as tm  # noqa: E402

from dilgen import Spec  # noqa: E402
from dilgen.compat import torchscale as compat  # noqa: E402
from dilgen.reference import differentiable_reference, reference_attention  # noqa: E402
from dilgen.support import zero_pad_layout_slip  # noqa: E402


def _spec(H, D, ws, rs, causal=False, **kw):
    return Spec(name="ts", num_heads=H, head_dim=D, segment_lengths=list(ws),
                dilation_rates=list(rs), causal=causal, dtype="float32",
                head_offsets="block", short_segments="zero_pad", **kw)


# (B, N, H, D, segment lengths, ratios): N a multiple of no segment, H not a multiple of r,
# H < r, segments longer than N (torchscale's min(w, N)), rates that are not powers of two
CASES = {
    "gigapath_like_d48": (1, 100, 16, 48, [16, 32, 64, 128], [1, 2, 4, 8]),
    "h5_not_multiple_of_r": (2, 45, 5, 48, [8, 16, 64], [1, 2, 4]),
    "h3_below_r8": (2, 37, 3, 16, [8, 40], [4, 8]),
    "rates_3_6_5": (1, 50, 6, 24, [6, 12, 60], [3, 6, 5]),
    "all_w_above_n": (2, 20, 4, 8, [32, 64], [2, 8]),
    "d80_batch3": (3, 33, 4, 80, [16, 32], [2, 4]),
    "one_branch_r16": (1, 70, 16, 48, [32], [16]),
}
CASE_IDS = sorted(CASES)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("case", CASE_IDS)
def test_reference_equals_torchscale_reexpression(case, causal):
    B, N, H, D, ws, rs = CASES[case]
    q, k, v = tm.qkv(B, N, H, D, seed=len(case))
    out, lse = reference_attention(q, k, v, _spec(H, D, ws, rs, causal), return_lse=True)
    t_out, t_lse = tm.dilated_attention(q, k, v, ws, rs, causal=causal, return_lse=True)
    assert (out - t_out).abs().max().item() < 1e-12
    kept = torch.isfinite(lse)
    assert torch.equal(kept, t_lse > tm.UNKEPT_LSE / 2)        # the same rows kept by no branch
    assert (lse[kept] - t_lse[kept]).abs().max().item() < 1e-12
    assert torch.equal(out[~kept.transpose(1, 2)], torch.zeros_like(out[~kept.transpose(1, 2)]))


def test_torchscale_layout_is_not_specs_default():
    """The two quirks change the function (issue 16: 36-67 % at GigaPath's settings)."""
    B, N, H, D, ws, rs = CASES["gigapath_like_d48"]
    q, k, v = tm.qkv(B, N, H, D, seed=1)
    ts = reference_attention(q, k, v, _spec(H, D, ws, rs))
    spec_default = reference_attention(q, k, v, _spec(H, D, ws, rs).replace(
        head_offsets="mod", short_segments="exact"))
    assert ((ts - spec_default).norm() / spec_default.norm()).item() > 0.2
    # ... and each quirk alone matters
    for change in ({"head_offsets": "mod"}, {"short_segments": "exact"}):
        one = reference_attention(q, k, v, _spec(H, D, ws, rs).replace(**change))
        assert ((ts - one).norm() / ts.norm()).item() > 0.05, change


def test_block_offsets_and_zero_pad_vanish_where_they_must():
    """r = 1 and N a multiple of every w: no offsets, no padding, SPEC's default math."""
    q, k, v = tm.qkv(2, 64, 3, 16, seed=2)
    spec = _spec(3, 16, [16, 32], [1, 1])
    assert torch.allclose(reference_attention(q, k, v, spec),
                          reference_attention(q, k, v, spec.replace(head_offsets="mod",
                                                                    short_segments="exact")),
                          atol=1e-14, rtol=0)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("case", ["h5_not_multiple_of_r", "rates_3_6_5"])
def test_differentiable_reference_gradients(case, causal):
    """Exact gradients (branch weights with their graph) agree to 1e-10; torchscale's
    detached weights give the same forward and other gradients."""
    B, N, H, D, ws, rs = CASES[case]
    spec = _spec(H, D, ws, rs, causal)
    g = torch.Generator().manual_seed(5)
    dout = torch.randn(B, N, H, D, generator=g, dtype=torch.float64)
    grads = {}
    for name in ("reference", "exact_weights", "detached_weights"):
        q, k, v = tm.qkv(B, N, H, D, seed=3, requires_grad=True)
        if name == "reference":
            out, lse = differentiable_reference(q, k, v, spec)
            assert torch.allclose(lse, reference_attention(q, k, v, spec, return_lse=True)[1],
                                  atol=1e-12, rtol=0)
        else:
            out = tm.dilated_attention(q, k, v, ws, rs, causal=causal,
                                       detach_weights=name == "detached_weights")
        (out * dout).sum().backward()
        grads[name] = (out.detach(), q.grad, k.grad, v.grad)
    for a, b in zip(grads["reference"], grads["exact_weights"]):
        assert (a - b).abs().max().item() < 1e-10
    assert torch.allclose(grads["reference"][0], grads["detached_weights"][0], atol=1e-12, rtol=0)
    dq_ref, dq_detached = grads["reference"][1], grads["detached_weights"][1]
    assert ((dq_ref - dq_detached).norm() / dq_ref.norm()).item() > 1e-3


# --------------------------------------------------------------------------- the layout slip

SLIP = (1, 40, 4, 16, [8, 12], [2, 8])      # 12 % 8 != 0 and N = 40 > 12: three segments


def test_layout_slip_is_detected_everywhere():
    B, N, H, D, ws, rs = SLIP
    q, k, v = tm.qkv(B, N, H, D, seed=4)
    with pytest.raises(tm.LayoutSlip):
        tm.dilated_attention(q, k, v, ws, rs)
    spec = _spec(H, D, ws, rs)
    for fn in (lambda: reference_attention(q, k, v, spec),
               lambda: differentiable_reference(q, k, v, spec)):
        with pytest.raises(ValueError, match=r"segment_lengths\[1\] = 12, dilation_rates\[1\] = 8.*slip"):
            fn()
    msg = zero_pad_layout_slip(spec, N)
    assert msg and "\n" not in msg and "slip" in msg
    # N <= w: one segment of min(w, N) rows, padded to a multiple of r: no slip, and it agrees
    q12, k12, v12 = (x[:, :12] for x in (q, k, v))
    assert zero_pad_layout_slip(spec, 12) is None
    assert torch.allclose(reference_attention(q12, k12, v12, spec),
                          tm.dilated_attention(q12, k12, v12, ws, rs), atol=1e-12, rtol=0)
    # the exact short segments have no slip to refuse
    reference_attention(q, k, v, spec.replace(short_segments="exact"))


def test_compat_refuses_the_layout_slip_in_one_line():
    B, N, H, D, ws, rs = SLIP
    layer = compat.DilatedAttention(tm.make_args(ws, rs, embed_dim=H * D, heads=H), H * D, H,
                                    self_attention=True, subln=True).double()
    x = torch.randn(B, N, H * D, dtype=torch.float64)
    with pytest.raises(ValueError) as exc:
        layer(x, x, x)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("dilgen.compat.torchscale args: ") and "slip" in msg
    assert msg.count("dilgen.compat.torchscale") == 1, msg
    assert "N = 40" in msg and "dilation_rates[1] = 8" in msg


# --------------------------------------------------------------------------- compat: structure

ARGS = tm.ENCODER_ARGS     # tm.small_encoder(): two layers, 5 heads of 48, w 8/16/64, r 1/2/4


def test_signatures_match_torchscale():
    for name in ("__init__", "forward"):
        ours = list(inspect.signature(getattr(compat.DilatedAttention, name)).parameters.items())
        theirs = list(inspect.signature(getattr(tm.DilatedAttention, name)).parameters.items())
        assert [(n, p.default) for n, p in ours] == [(n, p.default) for n, p in theirs], name


@pytest.mark.parametrize("subln", [True, False], ids=["subln", "no_subln"])
def test_state_dict_round_trip(subln):
    args = tm.make_args([8, 16], [1, 2], embed_dim=96, heads=2, subln=subln)
    torch.manual_seed(0)
    theirs = tm.DilatedAttention(args, 96, 2, self_attention=True, subln=subln)
    ours = compat.DilatedAttention(args, 96, 2, self_attention=True, subln=subln)
    sd = theirs.state_dict()
    assert set(ours.state_dict()) == set(sd)
    assert ("inner_attn_ln.weight" in sd) == subln
    ours.load_state_dict(sd, strict=True)
    back = tm.DilatedAttention(args, 96, 2, self_attention=True, subln=subln)
    back.load_state_dict(ours.state_dict(), strict=True)
    for key, value in sd.items():
        assert torch.equal(back.state_dict()[key], value), key
    assert ours.spec.head_offsets == "block" and ours.spec.short_segments == "zero_pad"
    assert ours.spec.segment_lengths == (8, 16) and ours.spec.head_dim == 48


def test_string_segment_lists_as_in_gigapath_configs():
    args = tm.make_args("[1024, 5792, 32768, 185363, 1048576]", "[1, 2, 4, 8, 16]",
                        embed_dim=768, heads=16)
    layer = compat.DilatedAttention(args, 768, 16, self_attention=True, subln=True)
    assert layer.spec.segment_lengths == (1024, 5792, 32768, 185363, 1048576)
    assert layer.spec.head_dim == 48 and layer.spec.dilation_rates == (1, 2, 4, 8, 16)
    assert zero_pad_layout_slip(layer.spec, 70_000) is None
    assert "185363" in zero_pad_layout_slip(layer.spec, 185_364)   # issue 16: slips above 185K


def test_patch_replaces_every_dilated_attention_in_place(capsys):
    model, _ = tm.small_encoder()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    replaced = compat.patch(model)
    assert replaced == ["layers.0.self_attn", "layers.1.self_attn"]
    printed = capsys.readouterr().out
    assert "replaced 2" in printed and "layers.1.self_attn" in printed
    for layer in model.layers:
        assert isinstance(layer.self_attn, compat.DilatedAttention)
        assert layer.self_attn.q_proj.weight.dtype == torch.float64
    after = model.state_dict()
    assert set(after) == set(before)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    # a torchscale model takes the patched model's weights back, unchanged
    fresh, _ = tm.small_encoder(seed=1)
    fresh.load_state_dict(after, strict=True)
    assert compat.patch(model, verbose=False) == []
    assert compat.patch(model) == [] and "found no" in capsys.readouterr().out
    with pytest.raises(TypeError, match="from_torchscale"):
        compat.patch(fresh.layers[0].self_attn)


def test_patch_keeps_train_mode_and_recognises_by_name_only():
    model, _ = tm.small_encoder()
    model.layers[0].eval()
    compat.patch(model, verbose=False)
    assert model.layers[0].self_attn.training is False and model.layers[1].self_attn.training is True

    class DilatedAttention(torch.nn.Module):        # a namesake without torchscale's attributes
        pass
    holder = torch.nn.Sequential(DilatedAttention())
    assert compat.patch(holder, verbose=False) == []


def _with_reference(monkeypatch, differentiable=False):
    """Run compat's attention through the float64 reference (the kernels refuse these specs)."""
    if differentiable:
        monkeypatch.setattr(compat, "_attend", lambda q, k, v, spec: differentiable_reference(q, k, v, spec)[0])
    else:
        monkeypatch.setattr(compat, "_attend", lambda q, k, v, spec: reference_attention(q, k, v, spec))


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_patched_encoder_equals_torchscale_encoder_float64(monkeypatch, causal):
    """The whole 2-layer encoder (projections, sub-LN, residuals) after patch(), with the
    attention computed by the float64 reference, equals the torchscale-built encoder."""
    _with_reference(monkeypatch)
    model, _ = tm.small_encoder()
    x = torch.randn(2, 45, ARGS["embed_dim"], dtype=torch.float64)
    expected = model(token_embeddings=x, is_causal=causal)["encoder_out"]
    compat.patch(model, verbose=False)
    got = model(token_embeddings=x, is_causal=causal)["encoder_out"]
    assert (got - expected).abs().max().item() < 1e-10
    # an all-False key_padding_mask is no mask
    none_padded = torch.zeros(2, 45, dtype=torch.bool)
    again = model(token_embeddings=x, encoder_padding_mask=none_padded, is_causal=causal)["encoder_out"]
    assert torch.equal(again, got)


def test_patched_encoder_gradients_float64(monkeypatch):
    """Input gradients of the patched encoder equal torchscale's algorithm with exact branch
    weights (dilgen differentiates the LSE weights; torchscale detaches them)."""
    _with_reference(monkeypatch, differentiable=True)
    real = tm.dilated_attention
    monkeypatch.setattr(tm, "dilated_attention",
                        lambda *a, **kw: real(*a, **{**kw, "detach_weights": False}))
    model, _ = tm.small_encoder()
    x = torch.randn(1, 37, ARGS["embed_dim"], dtype=torch.float64, requires_grad=True)
    model(token_embeddings=x)["encoder_out"].square().sum().backward()
    expected = x.grad.clone()
    x.grad = None
    compat.patch(model, verbose=False)
    model(token_embeddings=x)["encoder_out"].square().sum().backward()
    assert (x.grad - expected).abs().max().item() < 1e-9 * expected.abs().max().item()


@pytest.mark.parametrize("segments", [None, "[8, 16, 32, 64, 128]"], ids=["gigapath_rule", "short"])
def test_patch_gigapath_slide_encoder_float64(monkeypatch, segments):
    """GigaPath's slide encoder mirrored tiny (LongNetViT -> make_longnet_from_name -> layers
    whose self_attn is a DilatedAttention; string segment lists; an all-False padding mask):
    patch() finds every self_attn and the slide embedding stays (float64 reference). None:
    LongNetViT's rule, w 1024-1048576 (one zero-padded segment per branch at 45 tokens)."""
    _with_reference(monkeypatch)
    model = tm.make_slide_encoder(segment_length=segments)
    tiles, coords = tm.make_slide(model, 2, 44, seed=3)
    expected = model(tiles, coords)[0]
    assert compat.patch(model, verbose=False) == ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    assert isinstance(model.encoder.layers[1].self_attn, compat.DilatedAttention)
    assert (model(tiles, coords)[0] - expected).abs().max().item() < 1e-10


# --------------------------------------------------------------------------- compat: errors


def _one_line(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("dilgen.compat.torchscale"), msg
    return msg


@pytest.mark.parametrize("extra,word", [
    ({"xpos_rel_pos": True}, "xpos"),
    ({"multiway": True}, "multiway"),
])
def test_unsupported_configurations_are_named(extra, word):
    args = tm.make_args([8, 16], [1, 2], embed_dim=96, heads=2, **extra)
    with pytest.raises(NotImplementedError) as exc:
        compat.DilatedAttention(args, 96, 2, self_attention=True, subln=True)
    assert word in _one_line(exc)
    if word == "xpos":       # a torchscale model built with xpos: patch() names it too
        model = torch.nn.Sequential(tm.DilatedAttention(args, 96, 2, self_attention=True))
        with pytest.raises(NotImplementedError) as exc:
            compat.patch(model, verbose=False)
        assert "xpos" in _one_line(exc)


@pytest.mark.parametrize("kwargs,word", [
    ({"incremental_state": {}}, "incremental_state"),
    ({"attn_mask": torch.zeros(12, 12)}, "attn_mask"),
    ({"rel_pos": torch.zeros(1)}, "rel_pos"),
])
def test_unsupported_forward_arguments_are_named(kwargs, word):
    layer = compat.DilatedAttention(tm.make_args([8], [2], embed_dim=32, heads=2), 32, 2,
                                    self_attention=True)
    x = torch.randn(1, 12, 32)
    with pytest.raises(NotImplementedError) as exc:
        layer(x, x, x, **kwargs)
    assert word in _one_line(exc)


def test_dropout_while_training_and_bad_masks():
    """torchscale's `dropout` while training runs in the kernels: the layer equals its
    projections through the float64 reference under the same mask (torchscale's head layout
    and zero padding: w 8 over N 12), and eval mode has no dropout."""
    from dilgen.runtime.dropout_call import draw_seed
    args = tm.make_args([8, 16], [1, 2], embed_dim=32, heads=2)
    layer = compat.DilatedAttention(args, 32, 2, dropout=0.3, self_attention=True)
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(8))
    torch.manual_seed(3)
    out = layer(x, x, x)[0]
    torch.manual_seed(3)
    seed = draw_seed()                                # the seed the layer's call drew
    q, k, v = (proj(x).view(2, 12, 2, 16).double() for proj in (layer.q_proj, layer.k_proj, layer.v_proj))
    ref = differentiable_reference(q, k, v, layer.spec, dropout_p=0.3, seed=seed)[0]
    want = layer.out_proj(ref.reshape(2, 12, 32).float())
    assert tm.rel_error(out, want) < TOL_FP32
    layer.eval()
    assert tm.rel_error(layer(x, x, x)[0], want) > 1e-2   # eval: no dropout
    x = torch.randn(2, 12, 32)
    hole = torch.zeros(2, 12, dtype=torch.bool)
    hole[0, 3] = True
    left = torch.zeros(2, 12, dtype=torch.bool)
    left[1, :4] = True
    with pytest.raises(ValueError) as exc:           # checked by the kernel's padded call
        layer(x, x, x, key_padding_mask=hole)
    assert "left or right padding" in _one_line(exc) and "row 0" in str(exc.value)
    out = layer(x, x, x, key_padding_mask=left)[0]   # left padding (5bed78e): the item alone
    assert tm.rel_error(out[1, 4:], layer(x[1:, 4:], x[1:, 4:], x[1:, 4:])[0][0]) < TOL_FP32
    with pytest.raises(ValueError) as exc:
        layer(x, x, x, key_padding_mask=torch.zeros(2, 11, dtype=torch.bool))
    assert "key_padding_mask" in _one_line(exc)


def test_key_padding_mask_goes_to_the_padded_call(monkeypatch):
    """A right-padded batch goes, unpacked, to the padded call (here the float64 reference
    per item): the whole (B, N, H, D) projections, read in place, and the mask as given;
    each item's rows equal the torchscale encoder on that item alone (torchscale itself
    ignores the mask)."""
    _with_reference(monkeypatch)
    calls = []

    def padded(q, k, v, mask, spec):
        calls.append((tuple(q.shape), q.is_contiguous(), mask.clone()))
        return tm.each_item_alone(lambda *qkv: reference_attention(*qkv, spec), q, k, v, mask)
    monkeypatch.setattr(compat, "_attend_padded", padded)
    model, _ = tm.small_encoder()
    lengths = [45, 30, 9]
    x = torch.randn(3, 45, ARGS["embed_dim"], dtype=torch.float64)
    mask = torch.arange(45)[None, :] >= torch.tensor(lengths)[:, None]
    alone = [model(token_embeddings=x[i:i + 1, :n])["encoder_out"][0] for i, n in enumerate(lengths)]
    compat.patch(model, verbose=False)
    batch = model(token_embeddings=x, encoder_padding_mask=mask)["encoder_out"]
    H = ARGS["heads"]
    assert len(calls) == 2                                # one padded call per layer
    for shape, contiguous, seen in calls:
        assert shape == (3, 45, H, ARGS["embed_dim"] // H) and contiguous
        assert torch.equal(seen, mask)
    for i, n in enumerate(lengths):
        assert (batch[i, :n] - alone[i]).abs().max().item() < 1e-10


# --------------------------------------------------------------------------- through the kernels

TOL_FP32 = 1e-4          # SPEC §2.4, float32 (gradients: twice)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("case", ["h5_not_multiple_of_r", "h3_below_r8", "gigapath_like_d48"])
def test_kernel_equals_reexpression(case, causal):
    B, N, H, D, ws, rs = CASES[case]
    spec = _spec(H, D, ws, rs, causal)
    q, k, v = tm.qkv(B, N, H, D, seed=7, dtype=torch.float32, requires_grad=True)
    out = compat._attend(q, k, v, spec)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = tm.dilated_attention(q64, k64, v64, ws, rs, causal=causal, detach_weights=False)
    assert tm.rel_error(out, ref) < TOL_FP32
    dout = torch.randn_like(ref)
    (out * dout.float()).sum().backward()
    (ref * dout).sum().backward()
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert tm.rel_error(got, want) < 2 * TOL_FP32


def test_patched_encoder_through_kernels():
    model, _ = tm.small_encoder()
    x = torch.randn(1, 45, ARGS["embed_dim"], dtype=torch.float64)
    expected = model(token_embeddings=x)["encoder_out"]
    compat.patch(model.float(), verbose=False)
    got = model(token_embeddings=x.float())["encoder_out"]
    assert tm.rel_error(got, expected) < 10 * TOL_FP32     # two layers of fp32 around the kernels


def test_patched_gigapath_slide_encoder_through_kernels():
    model = tm.make_slide_encoder()
    tiles, coords = tm.make_slide(model, 1, 44, seed=4)
    expected = model(tiles, coords)[0]
    compat.patch(model.float(), verbose=False)
    assert tm.rel_error(model(tiles.float(), coords)[0], expected) < 10 * TOL_FP32


def test_key_padding_mask_computes_each_sequence_alone(monkeypatch):
    """Through the kernels: every layer calls Kernel.padded on its q, k, v projections in
    place (no packed copy), each item's outputs and input gradients equal the patched
    model's on that item alone, and the attention output of padded rows is 0 (a layer
    without sub-LN gives out_proj's bias there)."""
    from dilgen import compiler
    model, _ = tm.small_encoder()
    model = model.float()
    lengths = [45, 30]
    x = torch.randn(2, 45, ARGS["embed_dim"])
    mask = torch.arange(45)[None, :] >= torch.tensor(lengths)[:, None]
    alone = [model(token_embeddings=x[i:i + 1, :n])["encoder_out"] for i, n in enumerate(lengths)]
    compat.patch(model, verbose=False)
    xs = [x[i:i + 1, :n].clone().requires_grad_() for i, n in enumerate(lengths)]
    alone_dilgen = [model(token_embeddings=xi)["encoder_out"] for xi in xs]
    g = torch.randn(2, 45, ARGS["embed_dim"])
    for i, n in enumerate(lengths):
        (alone_dilgen[i][0] * g[i, :n]).sum().backward()

    projected, calls = {}, []
    for j, layer in enumerate(model.layers):
        layer.self_attn.q_proj.register_forward_hook(
            lambda mod, inp, out, j=j: projected.__setitem__(j, out.data_ptr()))
    real = compiler.Kernel.padded

    def spy(self, q, k, v, key_padding_mask, **kw):
        calls.append((tuple(q.shape), q.data_ptr(), key_padding_mask.clone()))
        return real(self, q, k, v, key_padding_mask, **kw)
    monkeypatch.setattr(compiler.Kernel, "padded", spy)
    xb = x.clone().requires_grad_()
    batch = model(token_embeddings=xb, encoder_padding_mask=mask)["encoder_out"]
    assert len(calls) == len(model.layers)
    for j, (shape, ptr, seen) in enumerate(calls):
        assert shape == (2, 45, ARGS["heads"], ARGS["embed_dim"] // ARGS["heads"])
        assert ptr == projected[j]                      # q_proj's output itself: no copy
        assert torch.equal(seen, mask)
    for i, n in enumerate(lengths):
        assert tm.rel_error(batch[i, :n], alone_dilgen[i][0]) < TOL_FP32
        assert tm.rel_error(batch[i, :n], alone[i][0].double()) < 10 * TOL_FP32
    assert math.isfinite(batch.sum().item())
    # gradients go through the padded call: item i's rows get its alone gradients
    sum((batch[i, :n] * g[i, :n]).sum() for i, n in enumerate(lengths)).backward()
    for i, n in enumerate(lengths):
        assert tm.rel_error(xb.grad[i, :n], xs[i].grad[0]) < 2 * TOL_FP32
    # padded rows: attention output 0 before out_proj
    layer = compat.DilatedAttention(tm.make_args([8, 16], [1, 2], embed_dim=96, heads=2), 96, 2,
                                    self_attention=True)
    y = torch.randn(2, 20, 96)
    short = torch.arange(20)[None, :] >= torch.tensor([20, 11])[:, None]
    out, _ = layer(y, y, y, key_padding_mask=short)
    assert torch.equal(out[1, 11:], layer.out_proj.bias.detach().expand(9, 96))
    assert tm.rel_error(out[1, :11], layer(y[1:, :11], y[1:, :11], y[1:, :11])[0][0]) < TOL_FP32
