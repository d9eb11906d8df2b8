"""attn_implementation="dilgen" in Hugging Face transformers (dilgen.integrations.transformers):
a tiny Llama built from a config (nothing downloaded), each path transformers takes against
the float64 reference of the same dilated model (the same weights in float64, attention by
dilgen.reference per item, packed sequence or cached prefix)."""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

import dilgen  # noqa: E402
import dilgen.integrations.transformers as hf  # noqa: E402
from dilgen.reference import differentiable_reference  # noqa: E402

from conftest import rel_error  # noqa: E402

PATTERN = {"segment_lengths": [8, 16], "dilation_rates": [1, 2]}
VOCAB = 61


def _config(**kw) -> LlamaConfig:
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    fields.update(kw)
    config = LlamaConfig(**fields)
    config.dilgen_spec = dict(PATTERN)
    return config


def _reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                         is_causal=None, **kwargs):
    """SPEC §2 in float64, per item / packed sequence / cached prefix: what the dilated model
    means, independently of dilgen's runtime (causal as the layer is: is_causal, or the
    module's; a bidirectional mask of hf.dilgen_mask gives its padding)."""
    if isinstance(attention_mask, hf.Bidirectional):
        attention_mask = attention_mask.mask
    spec = dilgen.spec_from_dict({"name": "hf_ref", **module.config.dilgen_spec,
                                  "num_heads": query.shape[1], "num_kv_heads": key.shape[1],
                                  "head_dim": query.shape[3], "dtype": "float32",
                                  "causal": bool(getattr(module, "is_causal", True) if is_causal is None
                                                 else is_causal), "softmax_scale": scaling})
    q, k, v = (t.transpose(1, 2).double() for t in (query, key, value))
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    runs = [(0, S)] * B
    if attention_mask is not None:
        first, end = hf.valid_runs(attention_mask)
        runs = list(zip(first, end))
    pieces = [[(0, S)] for _ in range(B)]
    pos = kwargs.get("position_ids")
    if T == S and B == 1 and pos is not None and T > 1:     # packed rows restart at 0
        starts = (pos.reshape(-1) == 0).nonzero().view(-1).tolist() or [0]
        starts = ([0] if starts[0] else []) + starts
        pieces = [[(a, e) for a, e in zip(starts, starts[1:] + [S])]]
    out = torch.zeros_like(q)
    for b in range(B):
        a0, e0 = runs[b]
        if T < S:       # decoding: the T queries are the rows of the last T written keys
            qb = torch.zeros((1, e0 - a0) + q.shape[2:], dtype=q.dtype)
            qb[:, -T:] = q[b:b + 1]
            o, _ = differentiable_reference(qb, k[b:b + 1, a0:e0], v[b:b + 1, a0:e0], spec)
            out[b] = o[0, -T:]
            continue
        for a, e in pieces[b]:
            a, e = max(a, a0), min(e, e0)
            if e > a:
                o, _ = differentiable_reference(q[b:b + 1, a:e], k[b:b + 1, a:e], v[b:b + 1, a:e], spec)
                out[b, a:e] = o[0]
    return out.to(query.dtype), None


AttentionInterface.register("dilgen_reference", _reference_attention)
transformers.masking_utils.AttentionMaskInterface.register("dilgen_reference", hf.dilgen_mask)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(_config(), attn_implementation="dilgen").eval()
    ref = copy.deepcopy(model).double()
    ref.set_attn_implementation("dilgen_reference")
    return model, ref


def _tokens(b, n, seed):
    return torch.randint(3, VOCAB, (b, n), generator=torch.Generator().manual_seed(seed))


def test_the_three_ways_to_choose_dilgen():
    config = _config()
    a = AutoModelForCausalLM.from_config(config, attn_implementation="dilgen")
    assert a.config._attn_implementation == "dilgen"
    b = LlamaForCausalLM(_config())
    b.set_attn_implementation("dilgen")
    assert b.config._attn_implementation == "dilgen"
    config = _config()
    config._attn_implementation = "dilgen"
    assert LlamaForCausalLM(config).config._attn_implementation == "dilgen"


@pytest.mark.parametrize("pattern, match", [
    (None, "config.dilgen_spec is missing"),
    ({"segment_lengths": [8], "dilation_rates": [1], "num_heads": 4}, "unknown field 'num_heads'"),
    ({"segment_lengths": [8, 16]}, "missing field 'dilation_rates'"),
    ({"segment_lengths": [8, 16], "dilation_rates": [1, 0]}, "dilation_rates"),
])
def test_a_missing_or_bad_pattern_is_one_line(pattern, match):
    config = _config()
    config.dilgen_spec = pattern
    model = LlamaForCausalLM._from_config(config, attn_implementation="dilgen")
    with pytest.raises(dilgen.SpecError, match=match) as info:
        model(_tokens(1, 8, 0))
    assert "\n" not in str(info.value)


def test_training_forward_and_gradients_match_the_float64_model(models):
    model, ref = models
    ids = _tokens(2, 40, 1)                  # 40: a short last segment of both branches
    model.zero_grad()
    ref.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    loss_ref = ref(ids, labels=ids).loss
    loss_ref.backward()
    assert abs(loss.item() - loss_ref.item()) < 1e-4
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        assert rel_error(p.grad, p_ref.grad) < 1e-3, name


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_items_equal_the_item_alone(models, side):
    model, ref = models
    ids = _tokens(2, 30, 2)
    mask = torch.ones_like(ids)
    if side == "right":
        mask[1, 19:] = 0
        valid, alone = slice(0, 19), ids[1:, :19]
    else:
        mask[1, :11] = 0
        valid, alone = slice(11, 30), ids[1:, 11:]
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
        one = model(alone).logits
        want = ref(ids, attention_mask=mask).logits
    assert rel_error(got[1, valid], one[0]) < 1e-4
    assert rel_error(got[1, valid], want[1, valid]) < 1e-4
    assert rel_error(got[0], want[0]) < 1e-4


def test_a_mask_with_holes_is_refused(models):
    model, _ = models
    ids = _tokens(1, 16, 3)
    mask = torch.ones_like(ids)
    mask[0, 5] = 0
    with pytest.raises(ValueError, match="padding between tokens") as info:
        model(ids, attention_mask=mask)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("how", ["position_ids", "cu_seq_lens"])
def test_packed_sequences_equal_each_sequence_alone(models, how):
    model, ref = models
    lens = [13, 20, 7]
    ids = _tokens(1, sum(lens), 4)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    kw = {"position_ids": pos}
    if how == "cu_seq_lens":
        cu = torch.tensor([0, 13, 33, 40], dtype=torch.int32)
        kw.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=20, max_length_k=20)
    with torch.no_grad():
        got = model(ids, **kw).logits[0]
        want = ref(ids, position_ids=pos).logits[0]
        a = 0
        for n in lens:
            alone = model(ids[:, a:a + n]).logits[0]
            assert rel_error(got[a:a + n], alone) < 1e-4
            a += n
    assert rel_error(got, want) < 1e-4


def _greedy_by_full_forwards(model, ids, mask, steps):
    """Greedy tokens from full forwards of `model` (the float64 reference model: what the
    dilated model means), one more token per forward."""
    ids, mask = ids.clone(), mask.clone()
    for _ in range(steps):
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, position_ids=pos).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return ids


def test_one_left_padded_prompt_is_padding_not_packing(models):
    """generate() gives a left-padded row position ids 0, 0, ..., 0, 1, 2: with its mask
    that is padding, not packed sequences."""
    model, _ = models
    ids = _tokens(1, 24, 6)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        got = model(ids, attention_mask=mask, position_ids=pos).logits[0, 5:]
        alone = model(ids[:, 5:]).logits[0]
    assert rel_error(got, alone) < 1e-4


@pytest.mark.parametrize("batch", [1, 2])
def test_generate_runs_the_decode_kernel_and_equals_full_forwards(models, batch, monkeypatch):
    model, ref = models
    ids = _tokens(batch, 21, 5)
    mask = torch.ones_like(ids)
    if batch == 2:
        mask[1, :6] = 0                       # left padding, as generate() wants it
        ids[1, :6] = 0
    decodes = []
    from dilgen.runtime import GeneratedAttention
    real = GeneratedAttention.decode
    monkeypatch.setattr(GeneratedAttention, "decode", lambda self, *a, **k: decodes.append(1) or real(self, *a, **k))
    steps = 5
    out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                         do_sample=False, use_cache=True)
    assert len(decodes) >= (steps - 1) * model.config.num_hidden_layers
    monkeypatch.setattr(GeneratedAttention, "decode", real)
    want = _greedy_by_full_forwards(ref, ids, mask, steps)
    assert torch.equal(out, want)


def test_masks_and_position_ids_are_read_on_the_host_once_a_forward(models, monkeypatch):
    """Every layer gets the same attention mask (or packed position_ids): it is read on the
    host (a device sync on a GPU) by the first layer only, and a new mask is read again."""
    from dilgen.integrations import hf_rows
    model, _ = models
    assert model.config.num_hidden_layers > 1
    reads = []
    for fn in ("valid_runs", "_restarts"):
        real = getattr(hf_rows, fn)
        monkeypatch.setattr(hf_rows, fn, lambda *a, real=real, fn=fn: reads.append(fn) or real(*a))
    ids = _tokens(2, 24, 6)
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    with torch.no_grad():
        model(ids, attention_mask=mask)
        assert reads == ["valid_runs"]
        model(ids, attention_mask=mask.clone())
        assert reads == ["valid_runs"] * 2
        pos = torch.cat([torch.arange(9), torch.arange(15)])[None]
        model(ids[:1], position_ids=pos)
    assert reads == ["valid_runs"] * 2 + ["_restarts"]
