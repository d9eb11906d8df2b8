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


def _pattern(config) -> dict:
    """config.dilgen_spec, checked: a dict of PATTERN_FIELDS with both lists."""
    pattern = getattr(config, "dilgen_spec", None)
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


def _prepared(module, query, key, scaling, causal):
    """(Kernel, its GeneratedAttention for query's device), kept on the module: a decode
    step pays one tuple comparison."""
    pattern = getattr(module.config, "dilgen_spec", None)
    sig = (id(pattern), query.dtype, query.device, causal, scaling, query.shape[1], key.shape[1],
           query.shape[3])
    hit = module.__dict__.get("_dilgen_kernel")
    if hit is not None and hit[0] == sig:
        return hit[1]
    pattern = _pattern(module.config)
    if query.dtype not in _DTYPES:
        raise SpecError(f"attn_implementation='dilgen' takes float16, bfloat16 or float32 "
                        f"activations, got {query.dtype}")
    model_type = re.sub(r"[^a-z0-9_]", "_", str(getattr(module.config, "model_type", "") or "model").lower())
    fields = {"name": f"hf_{model_type}", **pattern, "num_heads": query.shape[1],
              "num_kv_heads": key.shape[1], "head_dim": query.shape[3],
              "dtype": _DTYPES[query.dtype], "causal": bool(causal)}
    if scaling is not None:
        fields["softmax_scale"] = float(scaling)
    spec = spec_from_dict(fields, source="config.dilgen_spec")
    kernel = _KERNELS.get(spec.key())
    if kernel is None:
        kernel = _KERNELS[spec.key()] = Kernel(spec)
    prepared = (kernel, kernel.compiled_for(query.device).attention)
    module.__dict__["_dilgen_kernel"] = (sig, prepared)
    return prepared


def _refuse_unsupported(dropout, sliding_window, softcap, kwargs) -> None:
    if dropout:
        raise ValueError(f"attn_implementation='dilgen' has no attention dropout (got "
                         f"{dropout}): set config.attention_dropout = 0.0")
    if sliding_window is not None:
        raise ValueError("attn_implementation='dilgen' replaces the attention pattern; a "
                         "sliding window does not combine with it: set config.sliding_window = None")
    if softcap is not None:
        raise ValueError("attn_implementation='dilgen' has no logit soft-capping: use 'eager' "
                         "or 'sdpa' for this model")
    if kwargs.get("s_aux") is not None:
        raise ValueError("attn_implementation='dilgen' has no attention sinks (s_aux)")


def valid_runs(mask: torch.Tensor) -> tuple[list[int], list[int]]:
    """(first, end) valid key of each row of a 2-D mask (True/1 = a token, False/0 =
    padding): one contiguous run per row (left or right padding). A row with holes is
    refused; a row without tokens gets (0, 0). Reads the mask on the host (one sync)."""
    m = mask.bool()
    count = m.sum(dim=1)
    first = torch.where(count > 0, m.int().argmax(dim=1), torch.zeros_like(count))
    pos = torch.arange(m.shape[1], device=m.device)
    run = (pos[None, :] >= first[:, None]) & (pos[None, :] < (first + count)[:, None])
    if not torch.equal(run, m):
        bad = int((run != m).any(dim=1).nonzero()[0, 0])
        raise ValueError(f"attention_mask row {bad} has padding between tokens: "
                         f"attn_implementation='dilgen' takes left or right padding only "
                         f"(one run of tokens per row)")
    first, count = first.tolist(), count.tolist()
    return first, [a + n for a, n in zip(first, count)]


def _packed_offsets(kwargs, batch: int, rows: int):
    """(cu_seqlens int32, longest) of packed rows (batch 1), or None: transformers' packing
    collators pass cu_seq_lens_q / max_length_q, or position_ids that restart at 0."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        cu_k = kwargs.get("cu_seq_lens_k")
        if cu_k is not None and cu_k is not cu and not torch.equal(cu_k, cu):
            raise ValueError("attn_implementation='dilgen': cu_seq_lens_k differs from "
                             "cu_seq_lens_q; packed self-attention needs one set of offsets")
        if batch != 1:
            raise ValueError(f"attn_implementation='dilgen': cu_seq_lens_q packs sequences into "
                             f"one row; got a batch of {batch}")
        longest = kwargs.get("max_length_q")
        return cu.to(torch.int32), None if longest is None else int(longest)
    pos = kwargs.get("position_ids")
    if pos is None or batch != 1 or rows < 2:
        return None
    pos = pos.reshape(-1)
    starts = (pos == 0).nonzero().view(-1)
    if starts.numel() < 2 and (starts.numel() == 0 or int(starts[0]) == 0):
        return None                                   # one sequence from position 0 (or an offset)
    if int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    cu = torch.cat([starts, starts.new_full((1,), rows)]).to(torch.int32)
    return cu, None


def _prefill(kernel: Kernel, q, k, v, mask, kwargs):
    B, T = q.shape[0], q.shape[1]
    if mask is not None and bool(mask.all()):
        mask = None
    # padding wins over position_ids that restart (generate() gives padded rows position 0)
    packed = _packed_offsets(kwargs, B, T) if mask is None or "cu_seq_lens_q" in kwargs else None
    if packed is not None:
        if mask is not None and not bool(mask.all()):
            raise ValueError("attn_implementation='dilgen': packed rows come without padding "
                             "(drop the attention_mask or the packing)")
        cu, longest = packed
        return kernel(q[0], k[0], v[0], cu_seqlens=cu, max_seqlen=longest).unsqueeze(0)
    if mask is None:
        return kernel(q, k, v)
    first, end = valid_runs(mask)
    padding = torch.ones((B, T), dtype=torch.bool, device=q.device)
    for b, (a, e) in enumerate(zip(first, end)):
        padding[b, a:e] = False
    return kernel.padded(q, k, v, padding)


_LENGTHS: dict[tuple, torch.Tensor] = {}


def _uniform_lengths(batch: int, n: int, device) -> torch.Tensor:
    """A (batch,) int32 tensor of n on `device`, as a view into a table made once (a decode
    step then launches nothing to make its cache_seqlens)."""
    table = _LENGTHS.get((batch, device))
    if table is None or table.shape[0] <= n:
        size = max(2 * n, 4096)
        table = _LENGTHS[(batch, device)] = torch.arange(size, dtype=torch.int32, device=device) \
            .repeat_interleave(batch).view(size, batch)
    return table[n]


def _decode(attention, q, k, v, mask):
    """T new tokens per item over S cached keys: rows [first, end) of item b are its tokens
    (end = the keys written so far), the new ones its last T."""
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    if mask is None:
        return attention.decode(q, k, v, _uniform_lengths(B, S, q.device), validate=False)
    first, end = valid_runs(mask)
    if all(a == 0 for a in first):
        seqlens = torch.tensor(end, dtype=torch.int32).to(q.device)
        return attention.decode(q, k, v, seqlens)
    # left padding: item b's keys start at first[b]; its own view of the cache
    outs = []
    for b, (a, e) in enumerate(zip(first, end)):
        n = torch.tensor([e - a], dtype=torch.int32).to(q.device)
        outs.append(attention.decode(q[b:b + 1], k[b:b + 1, a:], v[b:b + 1, a:], n))
    return torch.cat(outs)


def dilgen_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling=None, sliding_window=None, softcap=None, is_causal=None,
                             **kwargs):
    """transformers' attention interface: query (B, H, T, D), key and value (B, H_kv, S, D)
    (the cache included), attention_mask the 2-D mask of `dilgen_mask` or None. Returns
    (out (B, T, H, D), None)."""
    _refuse_unsupported(dropout, sliding_window, softcap, kwargs)
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"attn_implementation='dilgen' takes a 2-D padding mask (B, keys); got "
                         f"a {attention_mask.dim()}-D mask: build the model with "
                         f"attn_implementation='dilgen' so transformers makes masks for it")
    causal = module.is_causal if is_causal is None else is_causal
    kernel, attention = _prepared(module, query, key, scaling, causal)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))   # (B, T, heads, D) views
    if k.shape[1] == q.shape[1]:
        out = _prefill(kernel, q, k, v, attention_mask, kwargs)
    elif not causal:
        raise ValueError("attn_implementation='dilgen': fewer queries than keys (a KV cache) "
                         "needs a causal model")
    else:
        out = _decode(attention, q, k, v, attention_mask)
    return out, None


def dilgen_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                kv_offset: int = 0, attention_mask=None, **kwargs):
    """transformers' mask interface: the keys of each item that hold a token, as a 2-D
    bool (B, kv_length), or None when every key does (the common case, no tensor made).
    Keys past the written ones (a static cache) and padding are False; dilgen's own
    pattern (segments, dilation, causality) is applied by the kernels."""
    written = q_offset + q_length - kv_offset
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:].bool()
        short = kv_length - attention_mask.shape[1]      # a static cache longer than the mask
        if short > 0:
            attention_mask = torch.nn.functional.pad(attention_mask, (0, short), value=False)
        elif written >= kv_length and bool(attention_mask.all()):
            return None
    elif written >= kv_length:
        return None
    else:
        device = kwargs.get("device") or "cpu"
        attention_mask = torch.ones((batch_size, kv_length), dtype=torch.bool, device=device)
    if written < kv_length:
        keys = torch.arange(kv_length, device=attention_mask.device)
        attention_mask = attention_mask & (keys < written)[None, :]
    return attention_mask


def register() -> None:
    """Register "dilgen" with transformers' attention and mask interfaces (done on import)."""
    AttentionInterface.register(NAME, dilgen_attention_forward)
    AttentionMaskInterface.register(NAME, dilgen_mask)


register()
