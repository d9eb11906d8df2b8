"""Hugging Face transformers: `attn_implementation="dilgen"`.

    import dilgen.integrations.transformers      # registers "dilgen" with transformers
    config.dilgen_spec = {"segment_lengths": [2048, 4096, 8192], "dilation_rates": [1, 2, 4]}
    model = AutoModelForCausalLM.from_config(config, attn_implementation="dilgen")

The dilated pattern is `config.dilgen_spec` (segment_lengths, dilation_rates, optionally
hilbert); heads, kv heads, head_dim, dtype, causal and the scale come from the model, so
one model may hold several specs (one per dtype or head shape). What each call runs:

    training, prefill (keys = queries)  the fused kernels, autograd-aware
      packed rows (cu_seq_lens_q / max_length_q, or position_ids that restart, batch 1):
                                        the packed kernels (cu_seqlens)
      a 2-D attention_mask with padding: each item at its own valid rows, its segments
                                        starting at its first valid token (left or right
                                        padding; a mask with holes is refused)
    generation (fewer queries than keys) the decode kernel over the cached keys, rows
                                        [first valid, last written] of each item

transformers passes q (B, H, T, D) and k, v (B, H_kv, S, D); dilgen reads (B, T, heads, D)
views of them, with no copy, and returns out (B, T, H, D) as transformers expects.
"""
from __future__ import annotations

import re

import torch

from ..compiler import Kernel
from ..spec import SpecError, spec_from_dict
from . import hf_rows
from .hf_rows import valid_runs  # noqa: F401  (public: the token run of each row of a mask)

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("dilgen.integrations.transformers needs transformers >= 5: "
                      "pip install 'dilgen[hf]'") from exc

if int(transformers.__version__.split(".")[0]) < 5:  # pragma: no cover
    raise ImportError(f"dilgen.integrations.transformers needs transformers >= 5, found "
                      f"{transformers.__version__}: pip install -U 'transformers>=5'")

NAME = "dilgen"
#: the fields of config.dilgen_spec; the rest of a spec comes from the model
PATTERN_FIELDS = ("segment_lengths", "dilation_rates", "hilbert")
_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_KERNELS: dict[tuple, Kernel] = {}


def _pattern(pattern) -> dict:
    """config.dilgen_spec, checked: a dict of PATTERN_FIELDS with both lists."""
    example = '{"segment_lengths": [2048, 4096], "dilation_rates": [1, 2]}'
    if pattern is None:
        raise SpecError(f"config.dilgen_spec is missing: attn_implementation='dilgen' needs the "
                        f"dilated pattern, e.g. config.dilgen_spec = {example}")
    if not isinstance(pattern, dict):
        raise SpecError(f"config.dilgen_spec must be a dict like {example}, got "
                        f"{type(pattern).__name__}")
    for field in pattern:
        if field not in PATTERN_FIELDS:
            raise SpecError(f"config.dilgen_spec: unknown field {field!r} (allowed: "
                            f"{', '.join(PATTERN_FIELDS)}; heads, head_dim, dtype, causal and "
                            f"scale come from the model)")
    for field in PATTERN_FIELDS[:2]:
        if field not in pattern:
            raise SpecError(f"config.dilgen_spec: missing field {field!r} (a list with one "
                            f"entry per branch), e.g. {example}")
    return pattern


def kernel_for(module, query: torch.Tensor, key: torch.Tensor, scaling, causal: bool) -> Kernel:
    """The dilgen Kernel of one attention module's call: the config's pattern with the
    call's heads, head_dim, dtype, causality and scale (kept per spec across modules)."""
    return _prepared(module, query, key, scaling, causal)[0]


class _TracedKernel:
    """The kernel of a call traced by torch.compile: the registry key of a dilgen.Kernel
    made while tracing, outside the graph (runtime.registry.constant_key)."""

    def __init__(self, key: str):
        self.key = key

    def __call__(self, q, k, v, **kwargs):
        from ..runtime.dispatch import kernel_call
        return kernel_call(self.key, q, k, v, **kwargs)

    def decode(self, q, k_cache, v_cache, cache_seqlens):
        from ..runtime.dispatch import kernel_decode
        return kernel_decode(self.key, q, k_cache, v_cache, cache_seqlens)


def _kernel_key(call) -> str:
    """The registry key of the Kernel of a traced call, from constants only (what
    torch.compiler.assume_constant_result takes): _build's arguments, dtype by name."""
    model_type, pattern, H, H_kv, D, dtype, causal, scaling = call
    return _build(model_type, pattern, H, H_kv, D, getattr(torch, dtype), causal, scaling)._op_key


def _model_type(config) -> str:
    return str(getattr(config, "model_type", "") or "model")


def _build(model_type: str, pattern, H: int, H_kv: int, D: int, dtype, causal: bool, scaling) -> Kernel:
    """The dilgen Kernel of the pattern (config.dilgen_spec) with these heads, head_dim,
    dtype, causality and scale (one per spec across modules)."""
    pattern = _pattern(pattern)
    if dtype not in _DTYPES:
        raise SpecError(f"attn_implementation='dilgen' takes float16, bfloat16 or float32 "
                        f"activations, got {dtype}")
    model_type = re.sub(r"[^a-z0-9_]", "_", model_type.lower())
    fields = {"name": f"hf_{model_type}", **pattern, "num_heads": H, "num_kv_heads": H_kv,
              "head_dim": D, "dtype": _DTYPES[dtype], "causal": bool(causal)}
    if scaling is not None:
        fields["softmax_scale"] = float(scaling)
    spec = spec_from_dict(fields, source="config.dilgen_spec")
    key = spec.key()
    if key not in _KERNELS:
        _KERNELS[key] = Kernel(spec)
    return _KERNELS[key]


def _prepared(module, query, key, scaling, causal):
    """(Kernel, its GeneratedAttention for query's device), kept on the module: a decode
    step pays one tuple comparison. Traced by torch.compile: (a _TracedKernel, None)."""
    if torch.compiler.is_compiling():
        from ..runtime.registry import constant_key
        config = module.config
        call = (_model_type(config), getattr(config, "dilgen_spec", None), query.shape[1],
                key.shape[1], query.shape[3], str(query.dtype).removeprefix("torch."), bool(causal),
                scaling)
        return _TracedKernel(constant_key(_kernel_key, call)), None
    pattern = getattr(module.config, "dilgen_spec", None)
    # repr, not id: a config.dilgen_spec changed in place after a call makes a new kernel
    sig = (repr(pattern), query.dtype, query.device, causal, scaling, query.shape[1], key.shape[1],
           query.shape[3])
    hit = module.__dict__.get("_dilgen_kernel")
    if hit is not None and hit[0] == sig:
        return hit[1]
    kernel = _build(_model_type(module.config), pattern, query.shape[1], key.shape[1],
                    query.shape[3], query.dtype, causal, scaling)
    prepared = (kernel, kernel.compiled_for(query.device).attention)
    module.__dict__["_dilgen_kernel"] = (sig, prepared)
    return prepared


#: config fields that turn on a sliding window or chunked attention (full_attention clears them)
_LOCAL_FIELDS = {"sliding_window": None, "use_sliding_window": False, "attention_chunk_size": None}
#: attention-dropout fields of the configs, the first present is named in the advice
_DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout",
                   "dropout_rate", "dropout")
#: keyword arguments that change the attention's math: dilgen does not implement them
_REFUSED_KWARGS = ("position_bias", "sinks", "s_aux", "indices", "block_indices", "alibi", "attn_bias",
                   "head_mask", "layer_head_mask", "relative_position_bias", "attention_bias")
#: keyword arguments transformers passes that dilgen reads or that do not change the math
_KNOWN_KWARGS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
                 "cache_position", "output_attentions", "use_cache", "past_key_values", "cache",
                 "position_embeddings", "is_causal", "layer_idx", "token_type_ids")
_FIX = "call dilgen.integrations.transformers.full_attention(config) before building the model"


def full_attention(config):
    """Turn a config's sliding-window or chunked layers into full attention, which dilgen's
    pattern then replaces: every layer_types entry "full_attention", sliding_window and
    attention_chunk_size None, use_sliding_window False (text and sub-configs too). Returns
    the config."""
    for cfg in [config] + [getattr(config, name) for name in ("text_config", "decoder", "encoder")
                           if hasattr(config, name) and getattr(config, name) is not None]:
        types = getattr(cfg, "layer_types", None)
        for field, off in _LOCAL_FIELDS.items():
            # with layer_types the window stays: such models build its mask for no layer then
            if getattr(cfg, field, None) not in (None, False, 0) and not (
                    isinstance(types, (list, tuple)) and field == "sliding_window"):
                setattr(cfg, field, off)
        if isinstance(types, (list, tuple)):
            cfg.layer_types = ["full_attention"] * len(types)
    return config


class LocalMask:
    """What dilgen_mask returns for a sliding-window or chunked mask (local_size): a layer
    that takes it is refused (dilgen's pattern would drop the window)."""

    def __init__(self, size: int, model: str):
        self.size, self.model = size, model


def _dropout_field(config) -> str:
    return next((f for f in _DROPOUT_FIELDS if getattr(config, f, None)), "attention_dropout")


def _refuse_unsupported(module, dropout, sliding_window, softcap, kwargs) -> None:
    if dropout:
        raise ValueError(f"attn_implementation='dilgen' has no attention dropout (got {dropout}): call "
                         f"model.eval(), or set config.{_dropout_field(module.config)} = 0.0 for training")
    if sliding_window is not None:
        raise ValueError(f"attn_implementation='dilgen' replaces the attention pattern; this layer has a "
                         f"sliding window of {sliding_window} tokens: {_FIX}")
    if softcap is not None:
        raise ValueError("attn_implementation='dilgen' has no logit soft-capping: use 'eager' "
                         "or 'sdpa' for this model")
    for name in _REFUSED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"attn_implementation='dilgen' does not implement the attention argument "
                             f"{name!r} this model passes (a bias, sinks or a sparse index set): use "
                             f"'eager' or 'sdpa' for this model")
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor) and name not in _KNOWN_KWARGS:
            raise ValueError(f"attn_implementation='dilgen' does not know the attention argument "
                             f"{name!r} (a tensor) this model passes, so it cannot honour it: use "
                             f"'eager' or 'sdpa' for this model")
    if getattr(module, "is_cross_attention", False) or (getattr(module, "is_decoder", False)
                                                       and not getattr(module, "is_causal", True)):
        raise ValueError("attn_implementation='dilgen' computes self-attention over one sequence; this "
                         "is cross-attention (decoder queries over encoder keys), which dilated "
                         "segments do not define: use 'eager' or 'sdpa' for this model")


_ROUTED: dict[str, bool] = {}


def routes_attention(model_class) -> bool:
    """Whether a transformers model class computes attention through AttentionInterface (its
    modeling module looks attention functions up in ALL_ATTENTION_FUNCTIONS), so that
    attn_implementation='dilgen' is what runs; Bloom, XGLM, Falcon, MPT ... compute their own."""
    module = getattr(model_class, "__module__", "")
    hit = _ROUTED.get(module)
    if hit is None:
        import inspect
        import sys
        try:
            hit = "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(sys.modules[module])
        except (KeyError, OSError, TypeError):
            hit = True            # no source to read (a compiled or dynamic module): trust it
        _ROUTED[module] = hit
    return hit


def dilgen_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling=None, sliding_window=None, softcap=None, is_causal=None,
                             **kwargs):
    """transformers' attention interface: query (B, H, T, D), key and value (B, H_kv, S, D)
    (the cache included), attention_mask the 2-D mask of `dilgen_mask` or None. Returns
    (out (B, T, H, D), None)."""
    _refuse_unsupported(module, dropout, sliding_window, softcap, kwargs)
    if isinstance(attention_mask, LocalMask):
        raise ValueError(f"attn_implementation='dilgen' replaces the attention pattern; this layer of "
                         f"{attention_mask.model} takes sliding-window or chunked attention over "
                         f"{attention_mask.size} tokens: {_FIX}")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"attn_implementation='dilgen' applies its own pattern and takes a 2-D "
                         f"padding mask (B, keys) or none; got a {attention_mask.dim()}-D mask (a "
                         f"custom mask passed to the model?): pass attention_mask as (B, tokens) of 0/1")
    causal = module.is_causal if is_causal is None else is_causal
    dq, dv = query.shape[-1], value.shape[-1]
    if dq != dv:
        # MLA (v_head_dim != qk head_dim): zero columns change neither q.k nor the kept
        # columns of the output, so both are padded to the larger and out is cut back
        scaling = dq ** -0.5 if scaling is None else scaling
        width = max(dq, dv)
        query, key, value = (torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in (query, key, value))
    kernel, attention = _prepared(module, query, key, scaling, causal)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))   # (B, T, heads, D) views
    if k.shape[1] == q.shape[1]:
        out = hf_rows.prefill(kernel, q, k, v, attention_mask, kwargs)
    elif not causal:
        raise ValueError("attn_implementation='dilgen': fewer queries than keys (a KV cache) "
                         "needs a causal model")
    elif attention is None:             # traced: torch.ops.dilgen.decode (a static cache)
        out = hf_rows.traced_decode(kernel, q, k, v, attention_mask)
    else:
        out = hf_rows.decode(attention, q, k, v, attention_mask)
    return (out if dq == dv else out[..., :dv]), None


def dilgen_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                kv_offset: int = 0, attention_mask=None, **kwargs):
    """transformers' mask interface: the keys of each item that hold a token, as a 2-D
    bool (B, kv_length), or None when every key does (the common case, no tensor made).
    Keys past the written ones (a static cache) and padding are False; dilgen's own
    pattern (segments, dilation, causality) is applied by the kernels. A sliding-window or
    chunked mask (local_size) is refused: dilgen would drop it."""
    if kwargs.get("local_size") is not None:
        # models build this mask whether or not a layer takes it: refused where one does
        return LocalMask(kwargs["local_size"], str(getattr(kwargs.get("config"), "model_type", "the model")))
    written = q_offset + q_length - kv_offset
    dynamic = isinstance(written, torch.Tensor)        # traced over a static cache: on the device
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:].bool()
        short = kv_length - attention_mask.shape[1]      # a static cache longer than the mask
        if short > 0:
            attention_mask = torch.nn.functional.pad(attention_mask, (0, short), value=False)
        elif not dynamic and written >= kv_length and not torch.compiler.is_compiling() \
                and bool(attention_mask.all()):
            return None                                  # (traced: the mask goes to the kernels)
    elif not dynamic and written >= kv_length:
        return None
    else:
        device = kwargs.get("device") or "cpu"
        attention_mask = torch.ones((batch_size, kv_length), dtype=torch.bool, device=device)
    if dynamic or written < kv_length:
        keys = torch.arange(kv_length, device=attention_mask.device)
        attention_mask = attention_mask & (keys < written)[None, :]
    return attention_mask


def _composite(config) -> bool:
    """A model made of models (sub-configs of model types: vision, text ...): its attention
    runs in its parts' modules, which routes_attention cannot see from the top class."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
    return any(c is AutoConfig or getattr(c, "model_type", None) in MODEL_MAPPING_NAMES
               for c in (getattr(config, "sub_configs", None) or {}).values())


def _checked_implementation(check):
    """PreTrainedModel._check_and_adjust_attn_implementation, wrapped: a model whose config
    holds dilgen_spec and names no attention comes back with dilgen (a saved dilgen model,
    from_pretrained(dir)); "dilgen" on a model that computes its own attention is refused."""
    if getattr(check, "_dilgen", False):
        return check

    def checked(self, attn_implementation, *args, **kwargs):
        config = getattr(self, "config", None)
        if attn_implementation is None and getattr(config, "dilgen_spec", None) is not None:
            attn_implementation = NAME
        if attn_implementation == NAME and not _composite(config) and not routes_attention(type(self)):
            raise ValueError(f"{type(self).__name__} computes attention in its own code, not through "
                             f"transformers' AttentionInterface, so attn_implementation='dilgen' would "
                             f"never run (nor its causal mask): use 'eager' or 'sdpa' for this model")
        return check(self, attn_implementation, *args, **kwargs)
    checked._dilgen = True
    return checked


def register() -> None:
    """Register "dilgen" with transformers' attention and mask interfaces (done on import),
    and check model builds (_checked_implementation)."""
    AttentionInterface.register(NAME, dilgen_attention_forward)
    AttentionMaskInterface.register(NAME, dilgen_mask)
    from transformers import PreTrainedModel
    PreTrainedModel._check_and_adjust_attn_implementation = _checked_implementation(
        PreTrainedModel._check_and_adjust_attn_implementation)


register()
