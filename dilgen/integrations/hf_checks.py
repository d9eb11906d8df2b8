"""What attn_implementation="dilgen" refuses, and the advice that fixes it
(dilgen.integrations.transformers): each refusal is one ValueError line naming what dilgen
does not implement, and the advice it gives works when followed.

- at each attention call (`refuse_call`): sinks, biases and sparse index sets, soft-capping,
  attention weights asked for, attention dropout, a sliding window or chunk of the layer
  (whether transformers passes it or the layer carries it), cross-attention;
- when a model is built (`checked_implementation`): models whose attention never goes
  through AttentionInterface, models that pick their attention class from their own table,
  DeepSeek Sparse Attention (an indexer that reads the 4-D mask), config.dilgen_spec on a
  composite config's top level.

`full_attention(config)` removes windows and chunks and keeps the rest of the model
(layer_types, and so RoPE per layer type and per-layer shapes); `no_attention_dropout`
turns attention dropout off in a config or a built model.
"""
from __future__ import annotations

import re

import torch

from .hf_masks import NO_WINDOW, is_window

NAME = "dilgen"
_USE = "use 'eager' or 'sdpa' for this model"
_FIX = "call dilgen.integrations.transformers.full_attention(config) before building the model"

#: config fields that hold a window or chunk size (tokens); full_attention sets them to NO_WINDOW
WINDOW_FIELDS = ("sliding_window", "attention_chunk_size")
#: attention-dropout fields of the configs (the first a config has is named in the advice)
DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout",
                  "attention_dropout_prob", "dropout_rate")
#: attributes an attention layer keeps its dropout in (a float, or an nn.Dropout), by preference
_DROPOUT_ATTRS = ("attention_dropout", "attn_dropout", "attn_pdrop", "dropout_p", "dropout")
#: keyword arguments that change the attention's math: dilgen does not implement them
REFUSED_KWARGS = ("position_bias", "sinks", "s_aux", "indices", "block_indices", "alibi", "attn_bias",
                  "head_mask", "layer_head_mask", "relative_position_bias", "attention_bias")
#: keyword arguments transformers passes that dilgen reads or that do not change the math
#: (shift_labels, num_items_in_batch: the loss's, which a model's forward hands to every layer)
KNOWN_KWARGS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
                "cache_position", "output_attentions", "use_cache", "past_key_values", "cache",
                "position_embeddings", "is_causal", "layer_idx", "token_type_ids", "shift_labels",
                "num_items_in_batch")


def _configs(config) -> list:
    """A config and every config inside it (text, vision, encoder, decoder ...)."""
    out, todo = [], [config]
    while todo:
        cfg = todo.pop()
        if cfg is None or any(cfg is c for c in out):
            continue
        out.append(cfg)
        names = set(getattr(cfg, "sub_configs", None) or {}) | {"text_config", "vision_config", "encoder",
                                                                 "decoder"}
        todo.extend(getattr(cfg, name, None) for name in names
                    if hasattr(getattr(cfg, name, None), "to_dict"))
    return out


def full_attention(config):
    """Turn a config's sliding-window and chunked layers into full attention, which dilgen's
    pattern then replaces: every window or chunk size (sliding_window,
    attention_chunk_size) of the config and its sub-configs becomes NO_WINDOW (2**31 - 1
    tokens: more than any sequence, so no key is cut). Nothing else changes: layer_types,
    and with them each layer type's RoPE, head shapes and caches, stay as they were. Call it
    before building the model (layers copy their window when built). Returns the config."""
    for cfg in _configs(config):
        for field in WINDOW_FIELDS:
            if is_window(getattr(cfg, field, None)):
                setattr(cfg, field, NO_WINDOW)
    return config


_WINDOW_WORDS = {"sliding_window": "a sliding window of {} tokens",
                 "attention_chunk_size": "chunked attention over chunks of {} tokens"}


def layer_window(module, sliding_window) -> str | None:
    """The window or chunk this attention layer restricts its keys to, in words, or None:
    the sliding_window transformers passes, else the layer's own: its layer_types entry
    in the config ("sliding_attention" / "chunked_attention"), or, with no layer_types, the
    window the module carries (sliding_window / attention_chunk_size)."""
    if is_window(sliding_window):
        return _WINDOW_WORDS["sliding_window"].format(sliding_window)
    config, idx = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if isinstance(idx, int) and isinstance(types, (list, tuple)) and 0 <= idx < len(types):
        field = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}.get(types[idx])
        size = getattr(config, field, None) if field else None
        return _WINDOW_WORDS[field].format(size) if is_window(size) else None
    if getattr(module, "is_sliding", True) is False:
        return None
    for field in WINDOW_FIELDS:
        size = getattr(module, field, None)
        if is_window(size):
            return _WINDOW_WORDS[field].format(size)
    return None


def dropout_field(config) -> str:
    """The config field of the attention dropout (the first of DROPOUT_FIELDS it has)."""
    return next((f for f in DROPOUT_FIELDS if hasattr(config, f)), "attention_dropout")


def _dropout_attr(module):
    """(name, holder) of the attribute an attention layer keeps its dropout in, or None."""
    for name in _DROPOUT_ATTRS:
        value = getattr(module, name, None)
        if isinstance(value, torch.nn.Dropout) or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            return name, value
    return None


def _is_attention(module) -> bool:
    return "Attention" in type(module).__name__ and hasattr(module, "config")


def no_attention_dropout(obj):
    """Turn attention dropout off, which dilgen does not implement: on a config (and its
    sub-configs) every attention-dropout field (DROPOUT_FIELDS) becomes 0.0; on a built
    model its config's too, and each attention layer's own copy (layers read the config
    when built), the float or nn.Dropout they pass as `dropout`. Other dropout (hidden,
    residual) is kept. Returns obj."""
    config = getattr(obj, "config", obj)
    for cfg in _configs(config):
        for field in DROPOUT_FIELDS:
            if isinstance(getattr(cfg, field, None), (int, float)):
                setattr(cfg, field, 0.0)
    if isinstance(obj, torch.nn.Module):
        for module in obj.modules():
            found = _dropout_attr(module) if _is_attention(module) else None
            if found is None:
                continue
            name, value = found
            if isinstance(value, torch.nn.Dropout):
                value.p = 0.0
            else:
                setattr(module, name, 0.0)
    return obj


def refuse_call(module, sliding_window, softcap, kwargs) -> None:
    """One ValueError line for what this attention call asks and dilgen does not implement.
    What no advice but another attention fixes comes first, so that the advice a refusal
    gives (full_attention) is the last thing in the way. Attention dropout is refused where
    the call runs without it (dropout_refusal)."""
    if softcap is not None:
        raise ValueError(f"attn_implementation='dilgen' has no logit soft-capping: {_USE}")
    for name in REFUSED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"attn_implementation='dilgen' does not implement the attention argument "
                             f"{name!r} this model passes (a bias, sinks or a sparse index set): {_USE}")
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor) and name not in KNOWN_KWARGS:
            raise ValueError(f"attn_implementation='dilgen' does not know the attention argument "
                             f"{name!r} (a tensor) this model passes, so it cannot honour it: {_USE}")
    if getattr(module, "is_cross_attention", False):
        raise ValueError(f"attn_implementation='dilgen' computes self-attention over one sequence; this "
                         f"{type(module).__name__} is cross-attention (decoder queries over encoder keys), "
                         f"which dilated segments do not define: {_USE}")
    if getattr(module, "is_decoder", False) and not getattr(module, "is_causal", True):
        raise ValueError(f"attn_implementation='dilgen': this {type(module).__name__} is a decoder's attention "
                         f"that is not causal (is_causal=False): cross-attention (decoder queries over encoder "
                         f"keys), which dilated segments do not define, or self-attention whose causality only "
                         f"its mask carries, which dilgen does not read: {_USE}")
    if kwargs.get("output_attentions"):
        raise ValueError("attn_implementation='dilgen' does not return attention weights "
                         "(output_attentions=True): use attn_implementation='eager' for them")
    window = layer_window(module, sliding_window)
    if window is not None:
        raise ValueError(f"attn_implementation='dilgen' replaces the attention pattern; this layer has "
                         f"{window}: {_FIX}")


def dropout_refusal(module, dropout, where: str) -> ValueError:
    """The one-line error of attention dropout on a call dilgen runs without it (`where`:
    padded rows, a ring, a KV cache, torch.compile)."""
    field = dropout_field(module.config)
    found = _dropout_attr(module)
    own = f" and each attention layer's {found[0]}" if found else ""
    return ValueError(f"attn_implementation='dilgen' has no attention dropout on {where} yet (this layer's "
                      f"is {dropout}): call model.eval(), or dilgen.integrations.transformers."
                      f"no_attention_dropout(model) to train (it sets config.{field}{own} to 0; a config "
                      f"field set after the model is built is not read)")


#: model types whose attention goes through AttentionInterface only in part, or with more
#: than a mask: what they do that dilgen cannot
_OWN_ATTENTION = {
    "doge": "adds learned scores to the attention of every layer (its dynamic mask, built in its own code)",
    "bigbird_pegasus": "computes its encoder's attention in its own code (block-sparse or full), where dilgen "
                       "does not run",
}
_ROUTED: dict[str, bool] = {}
_TABLE = re.compile(r"\b([A-Z][A-Z0-9_]*_ATTENTION_CLASSES)\s*\[")


def _source(model_class) -> str:
    import inspect
    import sys
    try:
        return inspect.getsource(sys.modules[getattr(model_class, "__module__", "")])
    except (KeyError, OSError, TypeError):
        return ""


def routes_attention(model_class) -> bool:
    """Whether a transformers model class computes attention through AttentionInterface (its
    modeling module looks attention functions up in ALL_ATTENTION_FUNCTIONS), so that
    attn_implementation='dilgen' is what runs; Bloom, XGLM, Falcon, MPT ... compute their own."""
    module = getattr(model_class, "__module__", "")
    hit = _ROUTED.get(module)
    if hit is None:
        source = _source(model_class)
        hit = not source or "ALL_ATTENTION_FUNCTIONS" in source   # no source to read: trust it
        _ROUTED[module] = hit
    return hit


def _composite(config) -> bool:
    """A model made of models (sub-configs of model types: vision, text ...): its attention
    runs in its parts' modules, which routes_attention cannot see from the top class."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
    return any(c is AutoConfig or getattr(c, "model_type", None) in MODEL_MAPPING_NAMES
               for c in (getattr(config, "sub_configs", None) or {}).values())


def _refuse_build(model, config) -> None:
    """One ValueError line when attn_implementation='dilgen' cannot run this model as built."""
    cls = type(model).__name__
    own = _OWN_ATTENTION.get(getattr(config, "model_type", None))
    if own:
        raise ValueError(f"{cls} {own}: attn_implementation='dilgen' cannot run it: {_USE}")
    if not _composite(config) and not routes_attention(type(model)):
        raise ValueError(f"{cls} computes attention in its own code, not through transformers' "
                         f"AttentionInterface, so attn_implementation='dilgen' would never run (nor its causal "
                         f"mask): {_USE}")
    table = _TABLE.search(_source(type(model)))
    if table:
        raise ValueError(f"{cls} picks its attention classes by name from its own table ({table.group(1)}), "
                         f"which has no 'dilgen': attn_implementation='dilgen' cannot run it: {_USE}")
    for cfg in _configs(config):
        if getattr(cfg, "index_topk", None) is not None:
            raise ValueError(f"{cls} selects each query's keys with a sparse indexer (DeepSeek Sparse "
                             f"Attention, index_topk={cfg.index_topk}) that reads the 4-D attention mask, a "
                             f"selection dilgen's dilated pattern would replace: {_USE}")
    parts = [name for name in (getattr(config, "sub_configs", None) or {}) if getattr(config, name, None) is not None]
    if getattr(config, "dilgen_spec", None) is not None and parts and not any(
            getattr(getattr(config, name), "dilgen_spec", None) is not None for name in parts):
        raise ValueError(f"config.dilgen_spec is on {type(config).__name__}'s top level, which no attention layer "
                         f"reads: {cls}'s attention runs in its parts; set it on their configs: "
                         + ", ".join(f"config.{name}.dilgen_spec" for name in parts))


def _asks_dilgen(attn_implementation) -> bool:
    if isinstance(attn_implementation, dict):
        return any(_asks_dilgen(v) for v in attn_implementation.values())
    return attn_implementation == NAME


def checked_implementation(check):
    """PreTrainedModel._check_and_adjust_attn_implementation, wrapped: a model whose config
    holds dilgen_spec and names no attention comes back with dilgen (a saved dilgen model,
    from_pretrained(dir)); "dilgen" on a model it cannot run is refused (_refuse_build)."""
    if getattr(check, "_dilgen", False):
        return check

    def checked(self, attn_implementation, *args, **kwargs):
        config = getattr(self, "config", None)
        if attn_implementation is None and getattr(config, "dilgen_spec", None) is not None:
            attn_implementation = NAME
        if _asks_dilgen(attn_implementation):
            _refuse_build(self, config)
        return check(self, attn_implementation, *args, **kwargs)
    checked._dilgen = True
    checked.__wrapped__ = check
    return checked


def saving_implementation(save):
    """PreTrainedConfig.save_pretrained, wrapped: a config (or sub-config) whose model runs
    dilgen is written with "attn_implementation": "dilgen", so that from_pretrained
    comes back with dilgen where dilgen.integrations.transformers is imported, and is refused
    by transformers in one line (attn_implementation="dilgen" is not supported) where it is
    not, instead of running another attention silently."""
    if getattr(save, "_dilgen", False):
        return save

    def saving(self, *args, **kwargs):
        marked = [cfg for cfg in _configs(self)
                  if getattr(cfg, "_attn_implementation_internal", None) == NAME and "attn_implementation"
                  not in cfg.__dict__]
        for cfg in marked:
            cfg.__dict__["attn_implementation"] = NAME
        try:
            return save(self, *args, **kwargs)
        finally:
            for cfg in marked:
                cfg.__dict__.pop("attn_implementation", None)
    saving._dilgen = True
    saving.__wrapped__ = save
    return saving
