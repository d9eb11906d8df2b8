"""How a transformers attention call's rows reach dilgen's kernels
(dilgen.integrations.transformers): a padding mask's runs, packed rows (cu_seq_lens or
position_ids that restart), the KV cache of generation; eagerly (read on the host once) and
under torch.compile (read on the device only, checked by device-side asserts)."""
from __future__ import annotations

import torch

from ..compiler import Kernel
from ..runtime.varlen import remembered


def _runs(mask: torch.Tensor):
    """On the device: (mask as bool, first token, token count, the mask one run per row
    would be) of a 2-D mask (True/1 = a token)."""
    m = mask.bool()
    count = m.sum(dim=1)
    first = torch.where(count > 0, m.int().argmax(dim=1), torch.zeros_like(count))
    pos = torch.arange(m.shape[1], device=m.device)
    run = (pos[None, :] >= first[:, None]) & (pos[None, :] < (first + count)[:, None])
    return m, first, count, run


def valid_runs(mask: torch.Tensor) -> tuple[list[int], list[int]]:
    """(first, end) valid key of each row of a 2-D mask (True/1 = a token, False/0 =
    padding): one contiguous run per row (left or right padding). A row with holes is
    refused; a row without tokens gets (0, 0). Reads the mask on the host (one sync)."""
    m, first, count, run = _runs(mask)
    if not torch.equal(run, m):
        bad = int((run != m).any(dim=1).nonzero()[0, 0])
        raise ValueError(f"attention_mask row {bad} has padding between tokens: "
                         f"attn_implementation='dilgen' takes left or right padding only "
                         f"(one run of tokens per row)")
    first, count = first.tolist(), count.tolist()
    return first, [a + n for a, n in zip(first, count)]


_PACKED_UNDER_COMPILE = (
    "attn_implementation='dilgen' under torch.compile: position_ids restart inside a row "
    "(packed sequences), which a traced call cannot read on the host; pass cu_seq_lens_q and "
    "max_length_q (DataCollatorWithFlattening(return_flash_attn_kwargs=True)) or call eagerly")


def _packed_offsets(kwargs, batch: int, rows: int):
    """(cu_seqlens int32 over the batch's rows laid end to end, longest) of packed rows, or
    None: transformers' packing collators pass cu_seq_lens_q / max_length_q (batch 1), or
    position_ids that restart at 0 inside a row (any batch: every row start is a sequence
    start too)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        cu_k = kwargs.get("cu_seq_lens_k")
        differs = ("attn_implementation='dilgen': cu_seq_lens_k differs from cu_seq_lens_q; "
                   "packed self-attention needs one set of offsets")
        if cu_k is not None and cu_k is not cu:
            if cu_k.shape != cu.shape:
                raise ValueError(differs)
            if torch.compiler.is_compiling():       # traced: compared on the device when it runs
                torch._assert_async((cu_k == cu).all(), differs)
            elif not torch.equal(cu_k, cu):
                raise ValueError(differs)
        if batch != 1:
            raise ValueError(f"attn_implementation='dilgen': cu_seq_lens_q packs sequences into "
                             f"one row; got a batch of {batch}")
        longest = kwargs.get("max_length_q")
        return cu.to(torch.int32), None if longest is None else int(longest)
    pos = kwargs.get("position_ids")
    if pos is None or rows < 2 or pos.shape[-1] != rows:
        return None
    if torch.compiler.is_compiling():
        # traced: position_ids are not read on the host, so rows are taken as one sequence
        # each, and the graph checks that on the device when it runs (packed rows under
        # torch.compile come with cu_seq_lens_q / max_length_q, DataCollatorWithFlattening's
        # return_flash_attn_kwargs=True)
        torch._assert_async(~(pos.reshape(-1, rows)[:, 1:] == 0).any(), _PACKED_UNDER_COMPILE)
        return None
    # every layer gets the same position_ids: read on the host once (varlen.remembered)
    return remembered(pos, ("hf packed", batch, rows), lambda: _restarts(pos, batch, rows))


def _restarts(pos, batch: int, rows: int):
    restart = (pos.reshape(-1, rows) == 0).expand(batch, rows).clone()
    if not bool(restart[:, 1:].any()):
        return None                                   # one sequence per row (from 0 or an offset)
    restart[:, 0] = True
    starts = restart.reshape(-1).nonzero().view(-1)
    cu = torch.cat([starts, starts.new_full((1,), batch * rows)]).to(torch.int32)
    return cu, None


def _traced_padded(kernel: Kernel, q, k, v, mask, **drop):
    """A padded batch under torch.compile, read on the device only: row b's pieces (its
    left padding, its tokens, its right padding) become three packed sequences (cu_seqlens
    of fixed length 3B + 1, max_seqlen T), so its tokens are computed alone as in the eager
    padded call; the padding pieces' outputs are zeroed. A row with holes fails a
    device-side check when the graph runs."""
    B, T = q.shape[0], q.shape[1]
    m, first, count, run = _runs(mask)
    torch._assert_async((run == m).all(), "attn_implementation='dilgen': an attention_mask row has "
                                          "padding between tokens (left or right padding only)")
    base = torch.arange(B, device=m.device) * T
    cu = torch.cat([torch.stack([base, base + first, base + first + count], dim=1).reshape(-1),
                    base.new_full((1,), B * T)]).to(torch.int32)
    rows = (t.reshape(B * T, *t.shape[2:]) for t in (q, k, v))
    out = kernel(*rows, cu_seqlens=cu, max_seqlen=T, **drop).view(B, T, *q.shape[2:])
    return out * m[:, :, None, None].to(out.dtype)


def prefill(kernel: Kernel, q, k, v, mask, kwargs, dropout: float = 0.0):
    """The rows of a prefill (T queries over T keys): one batch, packed rows (position_ids
    or cu_seq_lens), or padded rows (a mask); dropout: attention dropout's p, eager or traced."""
    B, T = q.shape[0], q.shape[1]
    drop = {"dropout_p": dropout} if dropout else {}
    if mask is not None and torch.compiler.is_compiling() and "cu_seq_lens_q" not in kwargs:
        _packed_offsets(kwargs, B, T)                 # the device-side check that rows are not packed
        return _traced_padded(kernel, q, k, v, mask, **drop)
    # every layer gets the same mask: read on the host once (varlen.remembered)
    if mask is not None and not remembered(mask, ("hf padded", B, T), lambda: not bool(mask.all())):
        mask = None
    # padding wins over position_ids that restart (generate() gives padded rows position 0)
    packed = _packed_offsets(kwargs, B, T) if mask is None or "cu_seq_lens_q" in kwargs else None
    if packed is not None:
        if mask is not None and not bool(mask.all()):
            raise ValueError("attn_implementation='dilgen': packed rows come without padding "
                             "(drop the attention_mask or the packing)")
        cu, longest = packed
        rows = (t.reshape(B * T, *t.shape[2:]) for t in (q, k, v))       # the rows end to end
        return kernel(*rows, cu_seqlens=cu, max_seqlen=longest, **drop).view(B, T, *q.shape[2:])
    if mask is None:
        return kernel(q, k, v, **drop)
    return kernel.padded(q, k, v, remembered(mask, ("hf padding", B, T), lambda: _padding(mask)), **drop)


def _padding(mask: torch.Tensor) -> torch.Tensor:
    """The key padding mask (True = padding) of an attention mask whose rows are one run of
    tokens each (valid_runs refuses holes)."""
    valid_runs(mask)
    return ~mask.bool()


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


def decode(attention, q, k, v, mask):
    """T new tokens per item over S cached keys: rows [first, end) of item b are its tokens
    (end = the keys written so far), the new ones its last T."""
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    if mask is None:
        return attention.decode(q, k, v, _uniform_lengths(B, S, q.device), validate=False)
    first, end = valid_runs(mask)
    if all(a == 0 for a in first):
        seqlens = torch.tensor(end, dtype=torch.int32).to(q.device)
        return attention.decode(q, k, v, seqlens)
    # left padding: item b's keys start at first[b]; its own view of the cache. A prompt
    # written into a static cache brings its padding rows among the T queries: only the last
    # e - a are tokens (the others get 0, as padded rows do in a padded prefill)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    for b, (a, e) in enumerate(zip(first, end)):
        m = min(T, e - a)
        if m > 0:
            n = torch.tensor([e - a], dtype=torch.int32).to(q.device)
            out[b:b + 1, T - m:] = attention.decode(q[b:b + 1, T - m:], k[b:b + 1, a:], v[b:b + 1, a:], n)
    return out


def traced_decode(kernel, q, k, v, mask):
    """decode under torch.compile, read on the device only: each item's keys are the first
    cache_seqlens[b] rows (the written ones of a static cache; a mask with left padding fails
    a device-side check when the graph runs: generate() eagerly, or pad on the right)."""
    B, S = q.shape[0], k.shape[1]
    if mask is None:
        seqlens = torch.full((B,), S, dtype=torch.int32, device=q.device)
    else:
        m, first, count, run = _runs(mask)
        torch._assert_async(((run == m).all(dim=1) & (first == 0)).all(),
                            "attn_implementation='dilgen': decoding under torch.compile takes the "
                            "written keys of each row as one run from key 0 (no left padding); "
                            "left-padded batches decode eagerly (generate() without torch.compile)")
        seqlens = count.to(torch.int32)
    return kernel.decode(q, k, v, seqlens)
