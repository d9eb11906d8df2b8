"""The masks transformers hands to attn_implementation="dilgen" (dilgen.integrations.transformers).

dilgen applies its own pattern (segments, dilation, causality) in the kernels, so the only
mask it reads is padding: which keys of each item hold a token. `dilgen_mask` (transformers'
mask interface) returns that as a 2-D bool (B, keys), or None when every key does; whatever
else a model's mask asks for is returned as a `MaskRefusal`, which the first layer that
takes it refuses in one line (a model builds masks for layer types that no layer may take,
so the refusal waits for a layer):

- a sliding window or chunk (local_size, or a window overlay in the mask function) smaller
  than NO_WINDOW: `LocalMask`;
- an overlay that makes keys visible that causality hides (or_mask_function, a
  block_sequence_ids / token_type_ids block: an image's tokens attending to each other),
  or an unknown mask function.

A 4-D mask that reaches a layer (built by the model in its own code, or passed to it) is
read as padding when it is one, (B, 1, 1, keys) with 0 / -inf (or True / False) entries
(`key_padding`); any other 4-D mask is refused.
"""
from __future__ import annotations

import torch
# at import, not in read_mask_function: that runs while dynamo traces a model, and torch
# 2.11's dynamo refuses an import whose result is transformers' _LazyModule ("Bad import
# result"). dilgen.integrations.transformers imports this module after transformers.
import transformers.masking_utils as mu

#: a window or chunk of at least this many tokens covers every sequence dilgen runs (its
#: offsets and positions are int32): no window. full_attention(config) sets it.
NO_WINDOW = 2 ** 31 - 1

_USE = "use 'eager' or 'sdpa' for this model"
_FIX = "call dilgen.integrations.transformers.full_attention(config) before building the model"


class _NotATensor:
    """What dilgen_mask returns instead of a tensor: a model that uses it in its own attention
    code (code that does not go through AttentionInterface, so dilgen does not run there)
    gets one ValueError line when it adds, multiplies or indexes it."""

    def _misused(self, *args):
        raise ValueError("attn_implementation='dilgen': this model uses the attention mask in attention code "
                         "of its own, which does not go through transformers' AttentionInterface, so dilgen "
                         f"would not run there: {_USE}")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _misused
    __and__ = __rand__ = __or__ = __ror__ = __getitem__ = _misused


class MaskRefusal(_NotATensor):
    """What dilgen_mask returns for a mask dilgen cannot honour: the layer that takes it
    raises ValueError(message)."""

    def __init__(self, message: str):
        self.message = message


class Bidirectional(_NotATensor):
    """What dilgen_mask returns for a bidirectional mask (queries see later keys): `mask` is
    its padding (a 2-D bool or None). A layer that takes it must be non-causal (an encoder's),
    else it is refused: dilgen's causality comes from the layer, the mask says otherwise."""

    def __init__(self, mask):
        self.mask = mask


class LocalMask(MaskRefusal):
    """A sliding-window or chunked mask over `size` tokens (full_attention(config) is the fix)."""

    def __init__(self, size: int, model: str):
        self.size, self.model = size, model
        super().__init__(f"attn_implementation='dilgen' replaces the attention pattern; this layer of "
                         f"{model} takes a sliding window or chunks of {size} tokens: {_FIX}")


def is_window(size) -> bool:
    """Whether a sliding_window / attention_chunk_size value restricts attention: an int
    below NO_WINDOW (None, False and NO_WINDOW or more do not)."""
    return isinstance(size, int) and not isinstance(size, bool) and 0 <= size < NO_WINDOW


def _cells(fn) -> dict:
    """The closure variables of a mask function, by name."""
    code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    names = getattr(code, "co_freevars", ())
    out = {}
    for name, cell in zip(names, closure):
        try:
            out[name] = cell.cell_contents
        except ValueError:          # an empty cell
            pass
    return out


def _maker(fn) -> str:
    """The function that made a mask function (masking_utils' factories return closures
    named '<factory>.<locals>.inner_mask'), or the function's own name."""
    return getattr(fn, "__qualname__", type(fn).__name__).split(".<locals>.")[0]


def _constant_true(fn) -> bool:
    """Whether a mask function ignores its indices and keeps every key (lambda *a:
    torch.tensor(True)): called without indices it answers one True."""
    try:
        kept = fn(None, None, None, None)
    except Exception:           # it reads its indices: not constant
        return False
    return kept is True or (isinstance(kept, torch.Tensor) and kept.dim() == 0 and bool(kept))


_WINDOW_OVERLAYS = {"sliding_window_overlay": "sliding_window", "chunked_overlay": "chunk_size",
                    "sliding_window_bidirectional_overlay": "sliding_window"}
#: or-overlays that keep every key when their window is NO_WINDOW or more (bidirectional)
_WIDE_OVERLAYS = {"_bidirectional_window_overlay": "sliding_window",
                  "sliding_window_bidirectional_overlay": "sliding_window"}


def _block_overlay_adds_keys(ids) -> bool:
    """A block_sequence_ids overlay makes keys visible unless every id is -1 (text only);
    traced, its ids are not read: taken as adding keys."""
    if torch.compiler.is_compiling() or not isinstance(ids, torch.Tensor):
        return True
    return bool((ids >= 0).any())


def _or_part(part, config):
    """What one part of an or_masks adds to causal attention: None (nothing: the part is a
    causal mask itself, a window within it, or an empty overlay), "all" (every key:
    bidirectional attention), a description of the keys it adds, or a MaskRefusal."""
    maker = _maker(part)
    if maker in _WIDE_OVERLAYS:
        if is_window(_cells(part).get(_WIDE_OVERLAYS[maker])):
            return "bidirectional attention within a window"
        return "all"
    if maker == "blockwise_overlay":
        if not _block_overlay_adds_keys(_cells(part).get("block_sequence_ids")):
            return None
        return ("bidirectional attention within blocks of tokens (token_type_ids or block_sequence_ids: "
                "an image's tokens attending to each other)")
    if maker in _KNOWN_MAKERS:      # a mask of its own (the base: causal, maybe windowed or packed)
        asks = read_mask_function(part, config)
        return asks if isinstance(asks, MaskRefusal) else ("all" if asks else None)
    if _constant_true(part):
        return "all"
    return f"a mask overlay ({maker}) that makes more keys visible than causal attention"


_KNOWN_MAKERS = ("causal_mask_function", "bidirectional_mask_function", "and_masks", "or_masks",
                 "remap_positions_for_packed_sequence", "add_offsets_to_mask_function",
                 "packed_sequence_mask_function", "padding_mask_function", *_WINDOW_OVERLAYS)


def read_mask_function(fn, config):
    """What the mask function transformers composed for this mask asks: False (causal),
    True (bidirectional) or a MaskRefusal. dilgen implements causal and bidirectional masks
    with packed sequences (read from position_ids), padding (the 2-D mask) and windows of
    NO_WINDOW or more."""
    model = str(getattr(config, "model_type", "") or "the model")
    todo, bidirectional = [fn], False
    while todo:
        f = todo.pop()
        if f is None or f is mu.causal_mask_function:
            continue
        if f is mu.bidirectional_mask_function:
            bidirectional = True
            continue
        maker, cells = _maker(f), _cells(f)
        if maker == "and_masks":
            todo.extend(cells.get("mask_functions", ()))
        elif maker in ("remap_positions_for_packed_sequence", "add_offsets_to_mask_function"):
            todo.append(cells.get("mask_function"))
        elif maker in ("packed_sequence_mask_function", "padding_mask_function"):
            continue
        elif maker in _WINDOW_OVERLAYS:
            size = cells.get(_WINDOW_OVERLAYS[maker])
            if is_window(size):
                return LocalMask(size, model)
        elif maker == "or_masks":
            for part in cells.get("mask_functions", ()):
                added = _or_part(part, config)
                if isinstance(added, MaskRefusal):
                    return added
                if added == "all":
                    bidirectional = True
                elif added is not None:
                    return MaskRefusal(f"attn_implementation='dilgen' applies its own dilated pattern; this "
                                       f"layer of {model} takes {added}, which dilgen does not implement: {_USE}")
        else:
            return MaskRefusal(f"attn_implementation='dilgen' applies its own dilated pattern; this layer of "
                               f"{model} takes a mask made by {maker}, which dilgen does not implement: {_USE}")
    return bidirectional


def dilgen_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                kv_offset: int = 0, attention_mask=None, **kwargs):
    """transformers' mask interface: the keys of each item that hold a token, as a 2-D
    bool (B, kv_length), or None when every key does (the common case, no tensor made).
    Keys past the written ones (a static cache) and padding are False; dilgen's own
    pattern (segments, dilation, causality) is applied by the kernels. A sliding-window or
    chunked mask, or an overlay dilgen does not implement, is a MaskRefusal (module
    docstring); a bidirectional mask comes wrapped in Bidirectional."""
    config = kwargs.get("config")
    if is_window(kwargs.get("local_size")):
        return LocalMask(kwargs["local_size"], str(getattr(config, "model_type", "") or "the model"))
    asks = read_mask_function(kwargs.get("mask_function"), config)
    if isinstance(asks, MaskRefusal):
        return asks
    padding = _padding(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask, kwargs.get("device"))
    return Bidirectional(padding) if asks else padding


def _padding(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask, device):
    """The 2-D padding mask of dilgen_mask, or None."""
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
        device = device or "cpu"
        attention_mask = torch.ones((batch_size, kv_length), dtype=torch.bool, device=device)
    if dynamic or written < kv_length:
        keys = torch.arange(kv_length, device=attention_mask.device)
        attention_mask = attention_mask & (keys < written)[None, :]
    return attention_mask


def key_padding(mask: torch.Tensor, module) -> torch.Tensor:
    """The 2-D key mask (True = a token) of a 4-D mask that is padding only: (B or 1, 1, 1,
    keys), bool, or float with 0 for a kept key and -inf / the dtype's lowest value for a
    padded one (the additive mask models like LayoutLM build from the 2-D one). Any other
    4-D mask (one that varies per query or head, or adds other scores: a bias) is refused."""
    name = type(module).__name__
    refuse = (f"attn_implementation='dilgen' reads padding only, as a 2-D mask (B, keys) or a (B, 1, 1, keys) "
              f"one; this {name} got a {tuple(mask.shape)} attention mask (built by the model itself, or passed "
              f"to it) that {{what}}, which dilgen's pattern cannot honour: {_USE}, or pass the padding as a "
              f"2-D attention_mask if the 4-D one was yours")
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1:
        raise ValueError(refuse.format(what="varies per query or per head"))
    keys = mask[:, 0, 0, :]
    if keys.dtype == torch.bool:
        return keys
    if not keys.dtype.is_floating_point:
        return keys != 0
    kept = keys == 0
    padded = keys <= torch.finfo(keys.dtype).min / 2
    plain = (kept | padded).all()
    if torch.compiler.is_compiling():
        torch._assert_async(plain, refuse.format(what="adds scores other than 0 and -inf (a bias)"))
    elif not bool(plain):
        raise ValueError(refuse.format(what="adds scores other than 0 and -inf (a bias)"))
    return kept
