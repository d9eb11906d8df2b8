"""attn_implementation="dilgen" as people train and ship (issue 57): mixed precision under
torch.autocast, EMA copies and checkpoints of a model after a forward, the config's attention
dropout in training (and turned off on a built model), attention weights asked for, and a saved model loaded where
dilgen is not imported. Tiny models built from configs, Triton's interpreter on the CPU."""
from __future__ import annotations

import copy
import io
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM  # noqa: E402

import dilgen.integrations.transformers as hf  # noqa: E402

from test_transformers_zoo import PATTERN, _build, _ids, _one_line  # noqa: E402


# -- mixed precision ---------------------------------------------------------------------------
def test_autocast_runs_in_the_autocast_dtype():
    """A float32 model under torch.autocast(bfloat16): q and k come in float32 (RoPE), v in
    bf16; the call runs in bf16 as sdpa does, equal to the same call on bf16 tensors, and a
    training step's loss is the float32 one to bf16's precision."""
    _, model = _build(transformers.LlamaConfig)
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 24, 16, generator=g), torch.randn(1, 2, 24, 16, generator=g), \
        torch.randn(1, 2, 24, 16, generator=g).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = hf.dilgen_attention_forward(attn, q, k, v, None)
    want, _ = hf.dilgen_attention_forward(attn, q.bfloat16(), k.bfloat16(), v, None)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    with pytest.raises(ValueError, match="different dtypes") as info:       # outside autocast
        hf.dilgen_attention_forward(attn, q, k, v, None)
    assert "torch.autocast" in _one_line(info)
    ids = _ids(2, 24)
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, labels=ids).loss
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    with torch.no_grad():
        assert abs(loss.item() - model(ids, labels=ids).loss.item()) < 2e-2 * loss.item()


# -- copies and checkpoints ----------------------------------------------------------------------
def test_deepcopy_and_torch_save_after_a_forward():
    """An EMA copy (copy.deepcopy) and a whole-model checkpoint (torch.save) of a model that
    has run: both work and compute what the model computes."""
    _, model = _build(transformers.LlamaConfig)
    ids = _ids(1, 24)
    with torch.no_grad():
        want = model(ids).logits
        twin = copy.deepcopy(model)
        assert torch.equal(twin(ids).logits, want)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        back = torch.load(buffer, weights_only=False)
        assert torch.equal(back(ids).logits, want)


# -- attention weights ---------------------------------------------------------------------------
def test_output_attentions_is_refused_in_one_line():
    _, model = _build(transformers.LlamaConfig)
    with pytest.raises(ValueError, match="does not return attention weights") as info:
        model(_ids(1, 16), output_attentions=True)
    assert "'eager'" in _one_line(info)


# -- attention dropout: the config's own field, honoured; refused where it does not run yet ----
BERT_LIKE = dict(vocab_size=61, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                 max_position_embeddings=64, type_vocab_size=2, dim=32, n_layers=1, n_heads=2, hidden_dim=64,
                 d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                 encoder_ffn_dim=64, decoder_ffn_dim=64, n_embd=32, n_layer=1, n_head=2, n_positions=64,
                 head_dim=16, num_key_value_heads=2)
DROPOUT = [("bert", "attention_probs_dropout_prob"), ("roberta", "attention_probs_dropout_prob"),
           ("electra", "attention_probs_dropout_prob"), ("xlm-roberta", "attention_probs_dropout_prob"),
           ("distilbert", "attention_dropout"), ("plbart", "attention_dropout"), ("gpt2", "attn_pdrop"),
           ("llama", "attention_dropout")]


@pytest.mark.parametrize("model_type, field", DROPOUT, ids=[m for m, _ in DROPOUT])
def test_the_configs_attention_dropout_runs_in_training(model_type, field, monkeypatch):
    """In training, each layer's attention dropout (the config's own field) reaches the kernels
    as dropout_p, padded batches included (eval: 0, the kernel without dropout);
    torch.manual_seed reproduces a step; no_attention_dropout(model) turns it off on a built
    model (PLBart's decoder meets the cross-attention refusal, not a dropout one)."""
    from dilgen.runtime import dropout_call
    config = AutoConfig.for_model(model_type, **BERT_LIKE, **{field: 0.25})
    config.dilgen_spec = dict(PATTERN)
    torch.manual_seed(0)
    model = AutoModel.from_config(config, attn_implementation="dilgen").train()
    ids = _ids(2, 16)
    kwargs = {"decoder_input_ids": ids} if model_type == "plbart" else {}
    seen = []
    real = dropout_call.dropout_attention
    monkeypatch.setattr(dropout_call, "dropout_attention",
                        lambda attn, *a, **kw: seen.append(a[3]) or real(attn, *a, **kw))
    import dilgen.runtime.attention as attention_module
    monkeypatch.setattr(attention_module, "dropout_attention", dropout_call.dropout_attention)
    try:
        torch.manual_seed(1)
        first = model(ids, **kwargs)[0]
        torch.manual_seed(1)
        again = model(ids, **kwargs)[0]
        assert torch.equal(first, again), "torch.manual_seed reproduces a training step"
        assert seen and set(seen) == {0.25}, seen
        first.sum().backward()
    except ValueError as exc:
        assert model_type == "plbart" and "cross-attention" in str(exc), exc
        return
    seen.clear()
    model.eval()
    model(ids, **kwargs)
    assert not seen, "eval: no dropout"
    model.train()
    padded = torch.ones(2, 16, dtype=torch.long)
    padded[1, 12:] = 0
    torch.manual_seed(2)
    model(ids, attention_mask=padded)[0].sum().backward()           # padded rows: dropout too
    assert seen == [0.25] * len(seen) and seen
    seen.clear()
    hf.no_attention_dropout(model)                                  # turned off on a built model
    model(ids, attention_mask=padded)[0].sum().backward()
    assert not seen


# -- a saved model, loaded where dilgen is not imported ------------------------------------------
def test_a_saved_dilgen_model_is_refused_where_dilgen_is_not_imported(tmp_path, monkeypatch):
    """config.json says attn_implementation "dilgen": with dilgen imported the model comes back
    with it; without (transformers as it is with no dilgen: no "dilgen" registered, no build
    check), from_pretrained refuses it in one line instead of running sdpa silently, and
    attn_implementation="sdpa", asked for, loads. A model switched to sdpa saves no mark."""
    _, model = _build(transformers.LlamaConfig)
    model.save_pretrained(tmp_path / "dilgen")
    assert json.loads((tmp_path / "dilgen" / "config.json").read_text())["attn_implementation"] == "dilgen"
    assert "attn_implementation" not in model.config.__dict__
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "dilgen").config._attn_implementation == "dilgen"
    model.set_attn_implementation("sdpa")
    model.save_pretrained(tmp_path / "sdpa")
    assert "attn_implementation" not in json.loads((tmp_path / "sdpa" / "config.json").read_text())

    from transformers import PreTrainedModel
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    monkeypatch.delitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "dilgen")
    monkeypatch.delitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "dilgen")
    monkeypatch.setattr(PreTrainedModel, "_check_and_adjust_attn_implementation",
                        PreTrainedModel._check_and_adjust_attn_implementation.__wrapped__)
    with pytest.raises(ValueError, match='attn_implementation="dilgen"') as info:
        AutoModelForCausalLM.from_pretrained(tmp_path / "dilgen")
    assert "not supported" in str(info.value)
    sdpa = AutoModelForCausalLM.from_pretrained(tmp_path / "dilgen", attn_implementation="sdpa")
    assert sdpa.config._attn_implementation == "sdpa"
