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
views of them, with no copy, and returns out (B, T, H, D) as transformers expects. Under
torch.autocast, q, k and v are cast to the autocast dtype first (what sdpa does).

Over several GPUs, dilgen.integrations.context_parallel places the attention layers on a
process group: each call then runs the ring on the rank's rows (hf_ring).

What dilgen does not implement is refused in one line (hf_checks: at each call, and when a
model is built; hf_masks: the masks), never dropped.
"""
from __future__ import annotations

import re
import weakref

import torch

from ..compiler import Kernel
from ..spec import SpecError, spec_from_dict
from . import hf_ring, hf_rows
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

from .hf_checks import (NAME, checked_implementation, full_attention,  # noqa: E402,F401 (public)
                        dropout_refusal, no_attention_dropout, refuse_call, routes_attention,
                        saving_implementation)
from .hf_masks import (NO_WINDOW, Bidirectional, LocalMask, MaskRefusal, dilgen_mask,  # noqa: E402,F401
                       key_padding)

_USE = "use 'eager' or 'sdpa' for this model"

#: the fields of config.dilgen_spec; the rest of a spec comes from the model
PATTERN_FIELDS = ("segment_lengths", "dilation_rates", "hilbert")
_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_KERNELS: dict[tuple, Kernel] = {}
#: module -> (signature, (Kernel, GeneratedAttention)) of its last call: held beside the module,
#: not in it, so that copy.deepcopy(model) and torch.save(model) copy no compiled kernel
_PREPARED: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _pattern(pattern) -> dict:
    """config.dilgen_spec, checked: a dict of PATTERN_FIELDS with both lists."""
    example = '{"segment_lengths": [2048, 4096], "dilation_rates": [1, 2]}'
    if pattern is None:
        raise SpecError(f"config.dilgen_spec is missing: attn_implementation='dilgen' needs the "
                        f"dilated pattern, e.g. config.dilgen_spec = {example} (on a composite "
                        f"model's part: config.text_config.dilgen_spec ...)")
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
    model_type, pattern, H, H_kv, D, dtype, causal, scaling, ring_size = call
    return _build(model_type, pattern, H, H_kv, D, getattr(torch, dtype), causal, scaling, ring_size)._op_key


def _model_type(config) -> str:
    return str(getattr(config, "model_type", "") or "model")


def _build(model_type: str, pattern, H: int, H_kv: int, D: int, dtype, causal: bool, scaling,
           ring_size: int = 1) -> Kernel:
    """The dilgen Kernel of the pattern (config.dilgen_spec) with these heads, head_dim,
    dtype, causality and scale (one per spec across modules); ring_size > 1: the same spec
    over the ranks of a context-parallel group (hf_ring)."""
    pattern = _pattern(pattern)
    if dtype not in _DTYPES:
        raise SpecError(f"attn_implementation='dilgen' takes float16, bfloat16 or float32 "
                        f"activations, got {dtype}")
    model_type = re.sub(r"[^a-z0-9_]", "_", model_type.lower())
    fields = {"name": f"hf_{model_type}", **pattern, "num_heads": H, "num_kv_heads": H_kv,
              "head_dim": D, "dtype": _DTYPES[dtype], "causal": bool(causal)}
    if scaling is not None:
        fields["softmax_scale"] = float(scaling)
    if ring_size > 1:
        fields["ring_size"] = int(ring_size)
    spec = spec_from_dict(fields, source="config.dilgen_spec")
    key = spec.key()
    if key not in _KERNELS:
        _KERNELS[key] = Kernel(spec)
    return _KERNELS[key]


def _prepared(module, query, key, scaling, causal, ring_size: int = 1):
    """(Kernel, its GeneratedAttention for query's device), kept per module (_PREPARED): a
    decode step pays one lookup and one tuple comparison. Traced by torch.compile: (a _TracedKernel, None)."""
    if torch.compiler.is_compiling():
        from ..runtime.registry import constant_key
        config = module.config
        call = (_model_type(config), getattr(config, "dilgen_spec", None), query.shape[1],
                key.shape[1], query.shape[3], str(query.dtype).removeprefix("torch."), bool(causal),
                scaling, int(ring_size))
        return _TracedKernel(constant_key(_kernel_key, call)), None
    pattern = getattr(module.config, "dilgen_spec", None)
    # repr, not id: a config.dilgen_spec changed in place after a call makes a new kernel
    sig = (repr(pattern), query.dtype, query.device, causal, scaling, query.shape[1], key.shape[1],
           query.shape[3], ring_size)
    hit = _PREPARED.get(module)
    if hit is not None and hit[0] == sig:
        return hit[1]
    kernel = _build(_model_type(module.config), pattern, query.shape[1], key.shape[1],
                    query.shape[3], query.dtype, causal, scaling, ring_size)
    prepared = (kernel, kernel.compiled_for(query.device).attention)
    _PREPARED[module] = (sig, prepared)
    return prepared


def dilgen_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling=None, sliding_window=None, softcap=None, is_causal=None,
                             **kwargs):
    """transformers' attention interface: query (B, H, T, D), key and value (B, H_kv, S, D)
    (the cache included), attention_mask the 2-D mask of `dilgen_mask`, None, or a 4-D
    mask that is padding (hf_masks.key_padding). Returns (out (B, T, H, D), None)."""
    refuse_call(module, sliding_window, softcap, kwargs)
    if isinstance(attention_mask, MaskRefusal):
        raise ValueError(attention_mask.message)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if isinstance(attention_mask, Bidirectional):
        if causal:
            raise ValueError(f"attn_implementation='dilgen': this causal {type(module).__name__} takes a "
                             f"bidirectional mask (queries see later keys: config.is_causal=False or "
                             f"bidirectional attention asked for), whose causality dilgen does not follow: {_USE}")
        attention_mask = attention_mask.mask
    if attention_mask is not None and attention_mask.dim() != 2:
        attention_mask = key_padding(attention_mask, module)
    query, key, value = _common_dtype(query, key, value)
    dq, dv = query.shape[-1], value.shape[-1]
    if dq != dv:
        # MLA (v_head_dim != qk head_dim): zero columns change neither q.k nor the kept
        # columns of the output, so both are padded to the larger and out is cut back
        scaling = dq ** -0.5 if scaling is None else scaling
        width = max(dq, dv)
        query, key, value = (torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in (query, key, value))
    ring = hf_ring.placement(module)          # context parallelism: this rank's rows of each sequence
    kernel, attention = _prepared(module, query, key, scaling, causal, 1 if ring is None else ring.size)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))   # (B, T, heads, D) views
    if dropout and k.shape[1] != q.shape[1]:
        raise dropout_refusal(module, dropout, "a KV cache")
    if ring is not None:
        out = hf_ring.attention(kernel, ring, q, k, v, attention_mask, kwargs, causal, dropout)
    elif k.shape[1] == q.shape[1]:
        out = hf_rows.prefill(kernel, q, k, v, attention_mask, kwargs, dropout)
    elif not causal:
        raise ValueError("attn_implementation='dilgen': fewer queries than keys (a KV cache) "
                         "needs a causal model")
    elif attention is None:             # traced: torch.ops.dilgen.decode (a static cache)
        out = hf_rows.traced_decode(kernel, q, k, v, attention_mask)
    else:
        out = hf_rows.decode(attention, q, k, v, attention_mask)
    return (out if dq == dv else out[..., :dv]), None


def _common_dtype(query, key, value):
    """q, k, v in the dtype the kernels run: under torch.autocast the autocast dtype (a
    float32 model trained in bf16 mixed precision: q may come in float32 after RoPE, v in
    bf16); otherwise they must agree."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        return tuple(t if t.dtype == dtype else t.to(dtype) for t in (query, key, value))
    if not query.dtype == key.dtype == value.dtype:
        raise ValueError(f"attn_implementation='dilgen': query, key and value come in different dtypes "
                         f"({query.dtype}, {key.dtype}, {value.dtype}) outside torch.autocast: cast the "
                         f"model to one dtype, or run it under torch.autocast")
    return query, key, value


def register() -> None:
    """Register "dilgen" with transformers' attention and mask interfaces (done on import),
    check model builds (hf_checks.checked_implementation) and mark saved configs
    (hf_checks.saving_implementation)."""
    AttentionInterface.register(NAME, dilgen_attention_forward)
    AttentionMaskInterface.register(NAME, dilgen_mask)
    from transformers import PreTrainedConfig, PreTrainedModel
    PreTrainedModel._check_and_adjust_attn_implementation = checked_implementation(
        PreTrainedModel._check_and_adjust_attn_implementation)
    PreTrainedConfig.save_pretrained = saving_implementation(PreTrainedConfig.save_pretrained)


register()
