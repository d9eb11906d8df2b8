"""attn_implementation="dilgen" at the edges of the transformers model zoo (issue 40): every
case either computes the dilated attention exactly or is refused by name in one line, and
every refusal's advice, followed, works. Tiny models built from configs (nothing
downloaded), Triton's interpreter on the CPU."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

import dilgen.integrations.transformers as hf  # noqa: E402
import dilgen  # noqa: E402,F401

from conftest import rel_error  # noqa: E402

PATTERN = {"segment_lengths": [8, 16], "dilation_rates": [1, 2]}
SMALL = dict(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0)


def _build(config_cls, fields=None, how="from_config", **extra):
    config = config_cls(**{**SMALL, **(fields or {})})
    for key, value in extra.items():
        setattr(config, key, value)
    config.dilgen_spec = dict(PATTERN)
    torch.manual_seed(0)
    return config, AutoModelForCausalLM.from_config(config, attn_implementation="dilgen").eval()


def _ids(b, n, seed=0):
    return torch.randint(3, 61, (b, n), generator=torch.Generator().manual_seed(seed))


def _one_line(info):
    assert "\n" not in str(info.value)
    return str(info.value)


# -- sliding windows and chunked attention: refused, and full_attention(config) is the fix ---
LOCAL = [
    ("mistral", "MistralConfig", dict(sliding_window=8)),
    ("gemma3", "Gemma3TextConfig", dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    ("gemma4", "Gemma4TextConfig", dict(sliding_window=8, global_head_dim=32, num_global_key_value_heads=2,
                                        layer_types=["sliding_attention", "full_attention"])),
    ("gemma4_unified", "Gemma4UnifiedTextConfig", dict(sliding_window=8, global_head_dim=32,
                                                       num_global_key_value_heads=2,
                                                       layer_types=["sliding_attention", "full_attention"])),
    ("qwen2_moe", "Qwen2MoeConfig", dict(use_sliding_window=True, sliding_window=8, max_window_layers=2,
                                         moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                         num_experts=2, num_experts_per_tok=1)),
    ("phimoe", "PhimoeConfig", dict(sliding_window=8, num_local_experts=2, num_experts_per_tok=1)),
    ("cohere2", "Cohere2Config", dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    ("llama4_chunked", "Llama4TextConfig", dict(attention_chunk_size=8, intermediate_size_mlp=96, num_local_experts=2)),
]


@pytest.mark.parametrize("name, cls, fields", LOCAL, ids=[c[0] for c in LOCAL])
def test_sliding_windows_are_refused_and_full_attention_fixes_them(name, cls, fields):
    """Refused in one line; full_attention(config), followed, gives the dilated model exactly
    (the same weights with SPEC §2's attention in float64): on every transformers version
    (Llama4 on 5.17 builds its chunked mask for every forward, whatever its layer_types)."""
    import test_transformers  # noqa: F401 - registers the "dilgen_reference" attention
    config_cls = getattr(transformers, cls)
    config, model = _build(config_cls, fields)
    with pytest.raises(ValueError, match="full_attention") as info:
        model(_ids(1, 24))
    assert "of 8 tokens" in _one_line(info)
    # the advice, followed
    config = hf.full_attention(config_cls(**{**SMALL, **fields}))
    config.dilgen_spec = dict(PATTERN)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="dilgen").eval()
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="dilgen_reference").eval()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert rel_error(model(_ids(1, 24)).logits, ref(_ids(1, 24)).logits) < 1e-4


# -- packed rows with batch > 1: each document alone ----------------------------------------
def test_packed_rows_with_batch_two_keep_documents_apart():
    _, model = _build(transformers.LlamaConfig)
    ids = _ids(2, 30, 1)
    lens = [[12, 18], [7, 9, 14]]
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lens])
    with torch.no_grad():
        got = model(ids, position_ids=pos).logits
        for b, row in enumerate(lens):
            a = 0
            for n in row:
                alone = model(ids[b:b + 1, a:a + n]).logits[0]
                assert rel_error(got[b, a:a + n], alone) < 1e-4
                a += n


# -- models that compute their own attention: refused when built ----------------------------
@pytest.mark.parametrize("cls", ["BloomConfig", "XGLMConfig", "FalconConfig", "MptConfig"])
def test_models_that_never_call_the_interface_are_refused(cls):
    config = getattr(transformers, cls)(vocab_size=61, hidden_size=32, n_layer=1, num_layers=1, n_head=2,
                                        attention_heads=2, d_model=32, ffn_dim=64, num_hidden_layers=1,
                                        num_attention_heads=2, n_layers=1, n_heads=2)
    config.dilgen_spec = dict(PATTERN)
    with pytest.raises(ValueError, match="computes attention in its own code") as info:
        AutoModelForCausalLM.from_config(config, attn_implementation="dilgen")
    _one_line(info)


# -- arguments dilgen does not implement, cross-attention: refused by name -----------------
def test_t5_position_bias_is_refused_by_name():
    config = transformers.T5Config(vocab_size=61, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                   decoder_start_token_id=0)
    config.dilgen_spec = dict(PATTERN)
    model = transformers.T5ForConditionalGeneration._from_config(config, attn_implementation="dilgen").eval()
    with pytest.raises(ValueError, match="'position_bias'") as info:
        model(input_ids=_ids(1, 16), decoder_input_ids=_ids(1, 16))
    _one_line(info)


def test_cross_attention_is_refused():
    config = transformers.BartConfig(vocab_size=61, d_model=32, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
                                     attention_dropout=0.0)
    config.dilgen_spec = dict(PATTERN)
    model = transformers.BartForConditionalGeneration._from_config(config, attn_implementation="dilgen").eval()
    with pytest.raises(ValueError, match="cross-attention") as info:
        model(input_ids=_ids(1, 16), decoder_input_ids=_ids(1, 16))   # equal lengths: no shape tells
    _one_line(info)


def test_unknown_tensor_arguments_and_sinks_are_refused_by_name():
    _, model = _build(transformers.LlamaConfig)
    attn = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 8, 16)
    k = torch.randn(1, 2, 8, 16)
    for name in ("sinks", "indices", "block_indices", "my_bias"):
        with pytest.raises(ValueError, match=f"'{name}'"):
            hf.dilgen_attention_forward(attn, q, k, k, None, **{name: torch.zeros(4)})


# -- a pattern changed in place, a saved model loaded back ---------------------------------
def test_changing_the_pattern_in_place_takes_effect():
    _, model = _build(transformers.LlamaConfig)
    ids = _ids(1, 24, 2)
    with torch.no_grad():
        model(ids)
        model.config.dilgen_spec["dilation_rates"][1] = 4       # in place, after a call
        got = model(ids).logits
    config, fresh = _build(transformers.LlamaConfig)           # the same weights (seed), built with r = 4
    fresh.config.dilgen_spec = {"segment_lengths": [8, 16], "dilation_rates": [1, 4]}
    with torch.no_grad():
        want = fresh(ids).logits
    assert torch.equal(got, want)


def test_a_saved_dilgen_model_comes_back_with_dilgen(tmp_path):
    _, model = _build(transformers.LlamaConfig)
    ids = _ids(1, 24, 3)
    model.save_pretrained(tmp_path)
    back = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert back.config._attn_implementation == "dilgen"
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
    sdpa = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")   # asked for: given
    assert sdpa.config._attn_implementation == "sdpa"


# -- MLA (v_head_dim != qk head_dim), a static cache with a left-padded batch ---------------
def test_mla_value_head_dim_differs_from_the_query_head_dim():
    from dilgen.reference import differentiable_reference
    config, model = _build(transformers.LlamaConfig)
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(1, h, 24, 24, generator=g) for h in (4, 2))
    v = torch.randn(1, 2, 24, 16, generator=g)
    out, _ = hf.dilgen_attention_forward(attn, q, k, v, None, scaling=0.3, is_causal=True)
    spec = dilgen.Spec(name="mla_ref", num_heads=4, num_kv_heads=2, head_dim=24, dtype="float32", causal=True,
                          softmax_scale=0.3, **PATTERN)
    want, _ = differentiable_reference(*(t.transpose(1, 2).double() for t in (q, k, v)), spec)
    assert out.shape == (1, 24, 4, 16) and rel_error(out, want) < 1e-4


def test_static_cache_generate_with_left_padding_equals_full_forwards():
    _, model = _build(transformers.LlamaConfig)
    ids = _ids(2, 13, 6)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ids[1, :5] = 0
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                         cache_implementation="static")
    from test_transformers import _greedy_by_full_forwards      # (registers dilgen_reference)
    _, ref = _build(transformers.LlamaConfig)                    # the same weights (seed 0)
    ref = ref.double()
    ref.set_attn_implementation("dilgen_reference")
    assert torch.equal(out, _greedy_by_full_forwards(ref, ids, mask, 3))


# -- the zoo: decoder architectures that route attention through AttentionInterface ---------
ZOO = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo2", "gpt_neox", "gpt2", "cohere",
       "starcoder2", "granite", "smollm3", "mixtral", "opt", "phi", "stablelm", "glm", "qwen2_moe"]
TINY = dict(SMALL, num_hidden_layers=1, bos_token_id=1, eos_token_id=2, n_embd=64, n_layer=1, n_head=4, n_positions=256,
            attention_dropout=0.0, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, hidden_dropout=0.0)


@pytest.mark.parametrize("model_type", ZOO)
def test_zoo_is_exact_or_refused_by_name(model_type):
    """Each architecture's logits with dilgen equal the same weights with SPEC §2's attention in
    float64 (test_transformers' dilgen_reference), or the call is one ValueError line."""
    import test_transformers  # noqa: F401 - registers the "dilgen_reference" attention
    config = transformers.AutoConfig.for_model(model_type, **TINY)
    config.dilgen_spec = dict(PATTERN)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="dilgen").eval()
    ids = _ids(1, 24, 7)
    try:
        with torch.no_grad():
            got = model(ids).logits
    except ValueError as exc:
        assert "\n" not in str(exc) and "attn_implementation='dilgen'" in str(exc)
        return
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="dilgen_reference").eval()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        want = ref(ids).logits
    assert rel_error(got, want) < 1e-4
