"""attn_implementation="dilgen" (issue 57): what a model's masks and layers ask is read
whole (a layer's own window, an image block, a 4-D mask the model builds), each refusal
names what is wrong in one line, and the advice it gives works when followed. Tiny models
built from configs (nothing downloaded), Triton's interpreter on the CPU; transformers 5.17
and 5.24."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM  # noqa: E402

import dilgen.integrations.transformers as hf  # noqa: E402

from conftest import rel_error  # noqa: E402
from test_transformers_zoo import PATTERN, SMALL, _build, _ids, _one_line  # noqa: E402

QWEN2_MOE_SLIDING = dict(use_sliding_window=True, sliding_window=8, max_window_layers=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=32, num_experts=2, num_experts_per_tok=1)
GEMMA3_TEXT = dict(SMALL, sliding_window=32, layer_types=["sliding_attention", "full_attention"])


def _without(config_dict: dict, *fields) -> dict:
    return {k: v for k, v in config_dict.items() if k not in fields}


# -- full_attention(config): the window goes, nothing else -------------------------------------
def test_full_attention_keeps_everything_but_the_window():
    """Gemma3's sliding layers have a RoPE of their own: full_attention keeps layer_types (and
    with them that RoPE), so on a sequence shorter than the window the dense model (sdpa)
    computes exactly what it did before the advice."""
    before = transformers.Gemma3TextConfig(**GEMMA3_TEXT)
    after = hf.full_attention(transformers.Gemma3TextConfig(**GEMMA3_TEXT))
    assert after.sliding_window == hf.NO_WINDOW
    assert _without(after.to_dict(), "sliding_window") == _without(before.to_dict(), "sliding_window")
    logits = []
    for config in (before, after):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
        with torch.no_grad():
            logits.append(model(_ids(1, 24)).logits)
    assert torch.equal(*logits)


@pytest.mark.parametrize("model_type", ["deepseek_v4", "gemma4_text", "gemma4_unified_text"])
def test_full_attention_keeps_models_buildable(model_type):
    """DeepSeek-V4 has no "full_attention" layer type, Gemma4's full layers have another head
    dim: after full_attention both build and run densely ("eager"); DeepSeek-V4 with dilgen is
    refused when built, in one line, for its sparse indexer (not its window)."""
    fields = dict(SMALL, sliding_window=8, global_head_dim=32, num_global_key_value_heads=2)
    config = hf.full_attention(AutoConfig.for_model(model_type, **fields))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.isfinite(model(_ids(1, 12)).logits).all()
    if model_type == "deepseek_v4":
        config.dilgen_spec = dict(PATTERN)
        with pytest.raises(ValueError, match="sparse indexer") as info:
            AutoModelForCausalLM.from_config(config, attn_implementation="dilgen")
        _one_line(info)


# -- a layer's own window ------------------------------------------------------------------
def test_a_layers_own_window_is_refused_whatever_mask_it_gets():
    """Qwen2-MoE's sliding layers carry their window (layer_types, the module's sliding_window)
    and do not pass it to the attention: a mask made without it (a prepared mask dict, as
    generate() passes) or none is refused all the same; its full layer runs."""
    _, model = _build(transformers.Qwen2MoeConfig, QWEN2_MOE_SLIDING)
    with pytest.raises(ValueError, match="sliding window of 8 tokens") as info:
        model(_ids(1, 24), attention_mask={"full_attention": None, "sliding_attention": None})
    assert "full_attention(config)" in _one_line(info)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 24, 16, generator=g), torch.randn(1, 2, 24, 16, generator=g)
    with pytest.raises(ValueError, match="sliding window of 8 tokens"):
        hf.dilgen_attention_forward(model.model.layers[0].self_attn, q, k, k, None)
    out, _ = hf.dilgen_attention_forward(model.model.layers[1].self_attn, q, k, k, None)
    assert torch.isfinite(out).all()


# -- Gemma3 multimodal: an image block's bidirectional attention -----------------------------
def _gemma3(attn: str):
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    config = transformers.Gemma3Config(text_config=dict(GEMMA3_TEXT), vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=5, boi_token_index=3, eoi_token_index=4)
    hf.full_attention(config)
    config.text_config.dilgen_spec = dict(PATTERN)
    torch.manual_seed(0)
    return transformers.Gemma3ForConditionalGeneration._from_config(config, attn_implementation=attn).eval()


def test_an_image_block_is_refused_and_text_runs():
    """token_type_ids mark an image's tokens, which attend to each other both ways (sdpa: the
    logits change): dilgen refuses that in one line; text (no block marked) runs."""
    ids, image = _ids(1, 24), torch.zeros(1, 24, dtype=torch.long)
    image[0, 6:10] = 1
    sdpa = _gemma3("sdpa")
    with torch.no_grad():
        assert (sdpa(ids, token_type_ids=image).logits - sdpa(ids).logits).abs().max() > 1e-3
    model = _gemma3("dilgen")
    with pytest.raises(ValueError, match="token_type_ids") as info:
        model(ids, token_type_ids=image)
    assert "bidirectional attention within blocks" in _one_line(info)
    with torch.no_grad():
        assert torch.equal(model(ids, token_type_ids=torch.zeros_like(ids)).logits, model(ids).logits)


def test_dilgen_spec_on_a_composite_top_level_says_where_it_goes():
    config = transformers.Gemma3Config(text_config=dict(GEMMA3_TEXT), vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    config.dilgen_spec = dict(PATTERN)
    with pytest.raises(ValueError, match=r"top level.*config\.text_config\.dilgen_spec") as info:
        transformers.Gemma3ForConditionalGeneration._from_config(config, attn_implementation="dilgen")
    assert "config.vision_config.dilgen_spec" in _one_line(info)


# -- masks a model builds in its own code ---------------------------------------------------
def test_a_4d_padding_mask_the_model_builds_is_read_as_padding():
    """LayoutLM turns the 2-D mask into an additive (B, 1, 1, keys) one itself: read as the
    padding it is, each item equal to the item alone (no mask at all: one of ones)."""
    config = transformers.LayoutLMConfig(vocab_size=61, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                         intermediate_size=96, max_position_embeddings=64)
    config.dilgen_spec = dict(PATTERN)
    torch.manual_seed(0)
    model = transformers.LayoutLMModel._from_config(config, attn_implementation="dilgen").eval()
    ids = _ids(2, 24)
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    with torch.no_grad():
        got = model(ids, attention_mask=mask).last_hidden_state
        alone = model(ids[1:, :17]).last_hidden_state
        whole = model(ids[:1]).last_hidden_state
    assert rel_error(got[1, :17], alone[0]) < 1e-4 and rel_error(got[0], whole[0]) < 1e-4


def test_other_4d_masks_are_refused_for_what_they_are():
    _, model = _build(transformers.LlamaConfig)
    attn = model.model.layers[0].self_attn
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    per_query = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="varies per query") as info:
        hf.dilgen_attention_forward(attn, q, k, k, per_query)
    assert "built by the model itself, or passed to it" in _one_line(info)
    bias = torch.zeros(1, 1, 1, 8)
    bias[..., 3] = 0.5
    with pytest.raises(ValueError, match="adds scores other than 0 and -inf"):
        hf.dilgen_attention_forward(attn, q, k, k, bias)
    padding = torch.zeros(1, 1, 1, 8)
    padding[..., 6:] = torch.finfo(torch.float32).min
    out, _ = hf.dilgen_attention_forward(attn, q, k, k, padding)
    want, _ = hf.dilgen_attention_forward(attn, q, k, k, torch.arange(8)[None] < 6)
    assert torch.equal(out, want)


# -- models dilgen cannot run: refused when built, in one line ------------------------------
REFUSED_AT_BUILD = [("deepseek_v32", "sparse indexer"), ("glm_moe_dsa", "sparse indexer"),
                    ("axk2", "sparse indexer"), ("hy_v4", "sparse indexer"),
                    ("git", "GIT_SELF_ATTENTION_CLASSES"), ("doge", "dynamic mask"),
                    ("bigbird_pegasus", "encoder's attention in its own code")]


@pytest.mark.parametrize("model_type, says", REFUSED_AT_BUILD, ids=[m for m, _ in REFUSED_AT_BUILD])
def test_models_dilgen_cannot_run_are_refused_when_built(model_type, says):
    fields = dict(SMALL, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96)
    if model_type == "git":
        fields["vision_config"] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=32, patch_size=16)
    config = AutoConfig.for_model(model_type, **fields)
    config.dilgen_spec = dict(PATTERN)
    auto = AutoModel if model_type == "bigbird_pegasus" else AutoModelForCausalLM
    with pytest.raises(ValueError, match=says) as info:
        auto.from_config(config, attn_implementation="dilgen")
    assert "use 'eager' or 'sdpa'" in _one_line(info)


def test_a_decoder_attention_that_is_not_causal_is_not_called_cross_attention():
    """BigBirdPegasus's decoder self-attention says is_causal=False (its causality is in its
    mask), as cross-attention does: the refusal names both, not "this is cross-attention"."""
    config = transformers.BigBirdPegasusConfig(vocab_size=61, d_model=32, encoder_layers=1, decoder_layers=1,
                                               encoder_attention_heads=2, decoder_attention_heads=2,
                                               encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                                               attention_type="original_full")
    config.dilgen_spec = dict(PATTERN)
    model = transformers.BigBirdPegasusModel._from_config(config, attn_implementation="eager")
    attn = model.decoder.layers[0].self_attn
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="is_causal=False") as info:
        hf.dilgen_attention_forward(attn, q, q, q, None)
    msg = _one_line(info)
    assert "BigBirdPegasusDecoderAttention" in msg and "self-attention whose causality only its mask carries" in msg


# -- bidirectional masks: the layer's causality is what runs ------------------------------------
@pytest.mark.parametrize("model_type, fields", [
    ("llama", dict(is_causal=False)),                              # transformers' bidirectional decoder
    ("gemma3_text", dict(use_bidirectional_attention=True, sliding_window=8,      # EmbeddingGemma-like
                         layer_types=["sliding_attention", "full_attention"])),
], ids=["llama_is_causal_false", "gemma3_bidirectional"])
def test_bidirectional_models_are_exact(model_type, fields):
    """A bidirectional mask (config.is_causal=False, or Gemma3's or_mask_function that keeps
    every key) on layers that run non-causal: exact against SPEC §2 in float64."""
    import test_transformers  # noqa: F401 - registers the "dilgen_reference" attention
    config = hf.full_attention(AutoConfig.for_model(model_type, **SMALL, **fields))
    config.dilgen_spec = dict(PATTERN)
    torch.manual_seed(0)
    model = AutoModel.from_config(config, attn_implementation="dilgen").eval()
    ref = AutoModel.from_config(config, attn_implementation="dilgen_reference").eval()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert rel_error(model(_ids(1, 24)).last_hidden_state, ref(_ids(1, 24)).last_hidden_state) < 1e-4


def test_a_bidirectional_mask_on_a_causal_layer_is_refused():
    _, model = _build(transformers.LlamaConfig)
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="bidirectional mask") as info:
        hf.dilgen_attention_forward(model.model.layers[0].self_attn, q, k, k, hf.Bidirectional(None))
    _one_line(info)


def test_mask_overlays_and_own_code_uses_of_the_mask_are_refused():
    """An or_mask_function that makes keys visible (here: every query sees key 0) is refused
    by the layer that takes it; an and_mask_function dilgen does not know is refused too; a
    model's own attention code using dilgen's mask (not through AttentionInterface) gets one
    line, not a TypeError."""
    from transformers.masking_utils import create_causal_mask
    config, _ = _build(transformers.LlamaConfig)
    embeds = torch.zeros(1, 8, 64)
    seen = create_causal_mask(config, embeds, None, None, or_mask_function=lambda b, h, q, kv: kv == 0)
    assert isinstance(seen, hf.MaskRefusal) and "makes more keys visible" in seen.message
    cut = create_causal_mask(config, embeds, None, None, and_mask_function=lambda b, h, q, kv: kv != 0)
    assert isinstance(cut, hf.MaskRefusal) and "test_mask_overlays" in cut.message
    assert "\n" not in seen.message + cut.message
    with pytest.raises(ValueError, match="attention code of its own") as info:
        torch.zeros(1, 2, 8, 8) + hf.Bidirectional(None)
    _one_line(info)
