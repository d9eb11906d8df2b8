"""The batches of a context-parallel model (dilgen.integrations.context_parallel): a full
batch cut into a rank's rows (`shard_batch`), and what the model's forward checks and fills
on every rank before its layers run (`pre_forward`)."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from .hf_ring import GENERATION

IGNORE_INDEX = -100
#: batch keys that hold one entry per token (B, N, ...): sharded along dim 1
TOKEN_KEYS = ("input_ids", "inputs_embeds", "position_ids", "labels", "shift_labels", "token_type_ids",
              "seq_idx")
#: a packed row's offsets over the whole row: the same on every rank
OFFSET_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
_ONE_ROW = ("packed rows under context parallelism come as one row (batch 1), as DataCollatorWithFlattening "
            "gives them")


def _packing(batch: Mapping, B: int, N: int):
    """(cu_seqlens int32 over the row, longest) of a packed batch, or None: cu_seq_lens_q
    (DataCollatorWithFlattening(return_flash_attn_kwargs=True)) or position_ids that
    restart at 0 inside the row."""
    cu = batch.get("cu_seq_lens_q")
    if cu is not None:
        if B != 1:
            raise ValueError(f"cp.shard: {_ONE_ROW}; cu_seq_lens_q came with a batch of {B}")
        cu = cu.to(torch.int32)
        longest = batch.get("max_length_q")
        return cu, int(longest) if longest is not None else int((cu[1:] - cu[:-1]).max())
    pos = batch.get("position_ids")
    if pos is None:
        return None
    pos = pos.reshape(-1, N)
    if not bool((pos[:, 1:] == 0).any()):
        return None
    if B != 1 or pos.shape[0] != 1:
        raise ValueError(f"cp.shard: position_ids restart inside a row (packed sequences) in a batch of {B}: "
                         f"{_ONE_ROW}")
    starts = (pos[0] == 0).nonzero().view(-1).cpu()
    if int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    cu = torch.cat([starts, starts.new_full((1,), N)]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def _unpadded_labels(cp, mask: torch.Tensor, labels, N: int):
    """The labels of a padded batch once its mask is dropped: a causal model's right padding
    (each row's tokens first, one run from 0) comes after every token, so no token attends
    to it and the tokens' outputs are those of the row without it; its labels become -100.
    Anything else is refused."""
    m = mask.bool()
    if bool(m.all()):
        return labels
    run = torch.arange(N, device=m.device)[None, :] < m.sum(dim=1, keepdim=True)
    if not cp.causal:
        raise ValueError("cp.shard: the attention_mask has padding, which a non-causal model under context "
                         "parallelism does not take (every token would see the padded keys): pack the rows "
                         "(DataCollatorWithFlattening) or give every row N tokens")
    if not torch.equal(run, m):
        raise ValueError("cp.shard: the attention_mask has left padding or padding between tokens; context "
                         "parallelism takes a causal model's right padding only (padding_side='right'), or "
                         "packed rows (DataCollatorWithFlattening)")
    return None if labels is None else labels.masked_fill(~m.to(labels.device), IGNORE_INDEX)


def shard_batch(cp, batch: Mapping) -> dict:
    """ContextParallel.shard: this rank's part of a full batch (the module docstring of
    context_parallel says what each key becomes)."""
    batch = dict(batch)
    ids = batch.get("input_ids")
    ref = ids if ids is not None else batch.get("inputs_embeds")
    if ref is None:
        raise ValueError("cp.shard: the batch has no input_ids (nor inputs_embeds)")
    B, N = ref.shape[0], ref.shape[1]
    packed = _packing(batch, B, N)
    order = "contiguous" if packed is not None else cp.order
    parts = 2 * cp.size if order == "zigzag" else cp.size
    if N % parts:
        raise ValueError(f"cp.shard: {N} tokens per row cannot be cut into {parts} equal chunks "
                         f"({'2 x ' if parts != cp.size else ''}{cp.size} ranks, {order} order): pad the rows "
                         f"to a multiple of {parts} (right padding with labels -100)")
    mask = batch.pop("attention_mask", None)
    labels = batch.get("labels")
    if mask is not None:
        labels = _unpadded_labels(cp, mask, labels, N)
        if packed is not None and not bool(mask.bool().all()):
            raise ValueError("cp.shard: packed rows come without padding (drop the attention_mask or the packing)")
    if batch.get("position_ids") is None:
        batch["position_ids"] = torch.arange(N, device=ref.device)[None].expand(B, N)
    if labels is not None:
        batch["labels"] = labels
        if cp.shifts_labels and batch.get("shift_labels") is None:
            # shifted over the whole row, before it is cut: the token at a chunk's last row
            # predicts the next chunk's first token (another rank's); the last predicts nothing
            batch["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    out = {}
    for key, value in batch.items():
        if key in TOKEN_KEYS and isinstance(value, torch.Tensor):
            out[key] = cp.rows(value, order)
        elif key in OFFSET_KEYS:
            continue                                  # set below from the whole row
        elif isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (B, N):
            raise ValueError(f"cp.shard: the batch's {key!r} {tuple(value.shape)} has one entry per token, and "
                             f"context parallelism does not know how to cut it (it cuts {', '.join(TOKEN_KEYS)})")
        else:
            out[key] = value
    if packed is not None:
        cu, longest = packed
        cu = cu.to(ref.device)
        out.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    return out


def _sums_everywhere(cp, values: list[int], device) -> list[int]:
    """Each value summed over the group's ranks (one all-reduce)."""
    import torch.distributed as dist
    backend = dist.get_backend(cp.group)
    if backend != "gloo" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor(values, dtype=torch.int64, device=device if backend != "gloo" else "cpu")
    dist.all_reduce(t, group=cp.group)
    return t.tolist()


def _labels_count(cp, kwargs) -> torch.Tensor | None:
    """This rank's count of valid shift_labels when the model computes its own loss and
    nobody said over how many tokens (num_items_in_batch): transformers' causal-LM loss then
    divides this rank's sum by the count of every rank (its part L_j of the mean L over all
    tokens: sum_j L_j = L, so backward and cp.reduce_gradients are exact). Labels the model
    would shift itself (no shift_labels), or a loss that takes no count, are refused: both
    are means over this rank's rows alone."""
    if kwargs.get("labels") is None or kwargs.get("num_items_in_batch") is not None:
        return None
    if not cp.shifts_labels:
        raise ValueError("a context-parallel model's own loss is a mean over this rank's labels: compute the "
                         "loss with cp.loss(outputs.logits, labels) (the mean over every rank's) and pass no labels")
    shifted = kwargs.get("shift_labels")
    if shifted is None:
        raise ValueError("a context-parallel causal LM got labels without shift_labels: its loss would shift each "
                         "rank's rows alone (wrong at every chunk border): shard the full batch with cp.shard (it "
                         "makes shift_labels over the whole row)")
    if torch.compiler.is_compiling():
        raise ValueError("a context-parallel causal LM under torch.compile: pass num_items_in_batch (the count of "
                         "valid shift_labels of every rank), or no labels and cp.loss(outputs.logits, shift_labels)")
    return (shifted != IGNORE_INDEX).sum()


_POSITIONS = ("a context-parallel model got position_ids that are not each rank's global positions (a per-rank "
              "arange, or positions that restart without cu_seq_lens_q): shard the full batch with cp.shard, or "
              "pass no position_ids")


def _global_positions(cp, pos: torch.Tensor, T: int) -> torch.Tensor:
    """Whether each of position_ids (..., T) is this rank's global position (as cp.positions,
    made afresh: nothing cached while torch.compile traces)."""
    return pos.reshape(-1, T) == cp.rows(torch.arange(T * cp.size, device=pos.device)[None])


def pre_forward(cp, args, kwargs):
    """ContextParallel._pre_forward: (args, kwargs) the model's forward runs with. Every
    refusal that depends on a rank's own rows is decided by one all-reduce, so that every
    rank raises it (never one rank while the others wait in the ring)."""
    if len(args) > 1:
        raise ValueError("a context-parallel model takes its batch as keyword arguments (model(**batch)), "
                         "beyond input_ids")
    ids = args[0] if args else kwargs.get("input_ids")
    ref = ids if ids is not None else kwargs.get("inputs_embeds")
    if ref is None or cp.size == 1:
        return None
    if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
        raise ValueError(GENERATION)
    B, T = ref.shape[0], ref.shape[1]
    packed = kwargs.get("cu_seq_lens_q") is not None
    pos, mask = kwargs.get("position_ids"), kwargs.get("attention_mask")
    if pos is None:
        if packed:
            raise ValueError("a context-parallel packed row (cu_seq_lens_q) needs its position_ids: shard the "
                             "batch with cp.shard")
        kwargs["position_ids"] = cp.positions(B, T, ref.device)
    count = _labels_count(cp, kwargs)
    # position_ids given without cu_seq_lens_q must be this rank's global positions: ones that
    # restart (packed sequences) or a per-rank arange would run as one sequence, or rotate wrong
    check_pos = pos is not None and not packed
    if torch.compiler.is_compiling():
        # traced: nothing read on the host (hf_ring refuses a mask); positions asserted on the device
        if check_pos:
            torch._assert_async(_global_positions(cp, pos, T).all(), _POSITIONS)
        return args, kwargs
    if mask is None and not check_pos and count is None:
        return args, kwargs
    padded = int(mask is not None and not bool(mask.bool().all()))
    restarts = int(check_pos and bool((pos.reshape(-1, T)[:, 1:] == 0).any()))
    wrong = int(check_pos and not restarts and not bool(_global_positions(cp, pos, T).all()))
    padded, restarts, wrong, total = _sums_everywhere(
        cp, [padded, restarts, wrong, 0 if count is None else int(count)], ref.device)
    if padded:
        raise ValueError("a context-parallel model got an attention_mask with padding on some rank: shard the "
                         "full batch with cp.shard (it takes a causal model's right padding as labels -100) or "
                         "pack the rows (DataCollatorWithFlattening)")
    if restarts:
        raise ValueError("a context-parallel model got position_ids that restart inside a row (packed "
                         "sequences) without cu_seq_lens_q, so no rank knows where the other ranks' sequences "
                         "start: shard the full batch with cp.shard (it passes the offsets over the whole row)")
    if wrong:
        raise ValueError(f"{_POSITIONS} (given position_ids differ on some rank)")
    if mask is not None:
        kwargs["attention_mask"] = None       # all ones on every rank: no padding
    if count is not None:
        kwargs["num_items_in_batch"] = max(total, 1)
    return args, kwargs
