"""Context parallelism for transformers models built with attn_implementation="dilgen": the
sequence split over the P ranks of a process group (or a DeviceMesh's "cp" dimension), every
dilgen attention layer computing its layer over the whole sequence with dilgen's ring.

    cp = context_parallel(model, group)          # or mesh=mesh (its "cp" dimension)
    batch = cp.shard(full_batch)                 # this rank's rows of input_ids, position_ids, labels
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    loss = cp.loss(out.logits, batch["shift_labels"])   # the mean over every token of every rank
    loss.backward()                              # (or model(**batch).loss.backward(): this rank's part)
    cp.reduce_gradients()                        # every rank now holds one process's gradients

What each piece does, and why it is exact:

- **Rows.** Rank j holds chunks j and 2P-1-j of 2P (zigzag) for a causal model, which gives
  every rank the same causal work, chunk j of P (contiguous) otherwise, and chunk j for a
  packed row (the packed ring splits contiguously). The ring (SPEC §2.3) gives each rank
  its rows of every layer's output over the whole sequence (partial outputs merged with the
  log-sum-exp formula, LongNet Eq. 10) and, backward, its rows of dq, dk, dv.
- **Positions.** position_ids are the tokens' global positions (made from arange when the
  batch has none), sharded like the tokens, so RoPE (or absolute embeddings) is right.
- **Labels.** A causal LM's labels are shifted before sharding: shift_labels[t] =
  labels[t + 1], the last -100, so the token at a chunk's last row predicts the next
  chunk's first token, which another rank holds. transformers' causal-LM loss reads
  shift_labels as they are; cp.loss takes them.
- **Loss.** L = (sum of the token losses of every rank) / (count of valid labels of every
  rank). cp.loss returns L on every rank (one all-reduce of [sum, count]); its gradient is
  that of this rank's part, L_j = (its token losses' sum) / count, and L = sum_j L_j. A
  causal LM's own loss (model(**batch).loss) is L_j: the forward passes the count of every
  rank as num_items_in_batch (transformers' causal-LM loss divides its sum by it).
- **Gradients.** Each rank's backward gives d(L_j)/dtheta through its own rows and, through the
  ring's dK, dV sent home, through the other ranks' rows, so sum_j grad_j = dL/dtheta: an
  all-reduce SUM over the group (cp.reduce_gradients). Under DDP or FSDP2 over the ranks
  of the group (and of a data-parallel dimension, dp x cp), which average the gradients
  over all their ranks instead, backward `loss * cp.size` and call nothing else.

Padding: a causal model's right-padded rows are taken as they are (padded keys come after
every token, so no token sees them) with the padded labels set to -100; left padding, holes,
and padding in a non-causal model are refused. Packed rows (DataCollatorWithFlattening:
position_ids restarting at 0, or cu_seq_lens_q) run as one row (batch 1) on the packed ring.
Whatever the one-device integration refuses is refused (the same attention function runs).
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from ..runtime.ring import shard as shard_rows
from . import cp_batch, hf_ring
from . import transformers as dhf  # noqa: F401  (registers "dilgen" with transformers)
from .cp_batch import IGNORE_INDEX, OFFSET_KEYS, TOKEN_KEYS  # noqa: F401  (public)
from .hf_checks import NAME, _is_attention


def _group_of(group, mesh, mesh_dim: str):
    """(group, size, rank, whether it is the default group) of group= or mesh=."""
    import torch.distributed as dist
    if mesh is not None:
        if group is not None:
            raise ValueError("context_parallel: pass group= or mesh=, not both")
        names = mesh.mesh_dim_names or ()
        if mesh_dim in names:
            mesh = mesh[mesh_dim]
        elif mesh.ndim != 1:
            raise ValueError(f"context_parallel: the DeviceMesh has dimensions {names}, none named "
                             f"{mesh_dim!r}: pass mesh_dim= (the context-parallel dimension)")
        group = mesh.get_group()
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("context_parallel needs torch.distributed: launch with torchrun and call "
                           "torch.distributed.init_process_group() first")
    default = group is None or group is dist.group.WORLD
    return group, dist.get_world_size(group), dist.get_rank(group), default


#: layer_types entries the ring computes: full attention, and the sliding / chunked layers of
#: full_attention(config) (which keeps layer_types; a real window is refused at the call)
ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
#: class names of token-mixing layers that are not softmax attention (state-space, linear and
#: convolutional mixers): each would mix only this rank's rows
_MIXER_NAME = re.compile(r"DeltaNet|Mamba|Mixer$|Ssm|SSM|ShortConv|Rwkv|RWKV|LinearAttention|Retention|Hyena")


def _refuse_sequence_mixers(model) -> None:
    """Refuse a model with a token-mixing layer other than attention: the ring splits only the
    attention layers, and such a layer would run on this rank's rows alone."""
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        other = sorted({t for t in getattr(cfg, "layer_types", None) or () if t not in ATTENTION_TYPES})
        if other:
            raise ValueError(f"context_parallel: {type(model).__name__} has layers of type {', '.join(map(repr, other))} "
                             f"(config.layer_types): dilgen's ring splits only attention ({', '.join(ATTENTION_TYPES)}), "
                             f"and any other token-mixing layer would run on this rank's rows alone")
    for name, module in model.named_modules():
        kind = type(module).__name__
        conv = isinstance(module, torch.nn.Conv1d) and module.kernel_size[0] > 1
        if conv or _MIXER_NAME.search(kind):
            what = f"a Conv1d of kernel {module.kernel_size[0]}" if conv else "a token-mixing layer that is not attention"
            raise ValueError(f"context_parallel: {type(model).__name__}'s {name} is {kind} ({what}): dilgen's ring "
                             f"splits only attention layers, and this one would mix this rank's rows alone")


def _attention_modules(model) -> list:
    """The model's attention layers (the modules transformers hands to the attention
    function), each checked to run attn_implementation='dilgen'."""
    found = []
    for module in model.modules():
        if not _is_attention(module):
            continue
        impl = getattr(module.config, "_attn_implementation", None)
        if impl != NAME:
            raise ValueError(f"context_parallel: {type(module).__name__} runs attn_implementation={impl!r}; "
                             f"dilgen's ring splits only attn_implementation='dilgen' layers (build the model "
                             f"with attn_implementation='dilgen'), and any other layer would attend within this "
                             f"rank's rows only")
        found.append(module)
    if not found:
        raise ValueError(f"context_parallel: {type(model).__name__} has no attention layer with a config "
                         f"(attn_implementation='dilgen' layers of a transformers model)")
    return found


def _passthrough(module, args, kwargs):
    return None


def _one_device_hook():
    return _passthrough


class _PreForward:
    """The model's forward pre-hook (ContextParallel._pre_forward). A pickled model
    (torch.save) keeps a hook that changes nothing: it loads as a one-device model, as its
    layers do (hf_ring.RingPlacement), and no process group is pickled."""

    def __init__(self, cp):
        self.cp = cp

    def __call__(self, module, args, kwargs):
        return cp_batch.pre_forward(self.cp, args, kwargs)

    def __deepcopy__(self, memo):
        return self                      # an EMA copy runs on the same group

    def __reduce__(self):
        return (_one_device_hook, ())


class ContextParallel:
    """A model placed on a context-parallel group: its sharder (shard, collator, batches),
    loss (loss) and gradient reduction (reduce_gradients). Made by context_parallel()."""

    def __init__(self, model, group, size: int, rank: int, default_group: bool, causal: bool,
                 shifts_labels: bool):
        self.model, self.group, self.size, self.rank = model, group, size, rank
        self.causal = causal
        #: the model's loss predicts token t + 1 at token t (a causal LM head): shard makes
        #: shift_labels before cutting the rows
        self.shifts_labels = shifts_labels
        #: the chunk order of fixed-length rows: zigzag balances causal work
        self.order = "zigzag" if causal else "contiguous"
        self.default_group = default_group
        self._modules: list = []
        self._hook = None
        self._positions: dict = {}

    def __repr__(self) -> str:
        return f"ContextParallel(size={self.size}, rank={self.rank}, order={self.order!r})"

    # -- placing and removing ---------------------------------------------------------------
    def _place(self, modules) -> None:
        if self.size > 1:
            ring = hf_ring.RingPlacement(self.group, self.size, self.rank, self.order, self.default_group)
            for module in modules:
                setattr(module, hf_ring.ATTR, ring)
            self._modules = modules
        self._hook = self.model.register_forward_pre_hook(_PreForward(self), with_kwargs=True)

    def remove(self):
        """Turn the model back into its one-device form (its layers attend over the rows
        they are given); returns the model."""
        for module in self._modules:
            module.__dict__.pop(hf_ring.ATTR, None)
        self._modules = []
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        return self.model

    # -- rows -------------------------------------------------------------------------------
    def rows(self, t: torch.Tensor, order: str | None = None, dim: int = 1) -> torch.Tensor:
        """This rank's rows of a full (B, N, ...) tensor in the ring's chunk order."""
        return shard_rows(t, self.size, self.rank, order or self.order, dim=dim)

    def positions(self, batch: int, rows: int, device) -> torch.Tensor:
        """This rank's global positions (batch, rows) of sequences of rows x size tokens."""
        key = (rows, str(device))
        pos = self._positions.get(key)
        if pos is None:
            pos = self._positions[key] = self.rows(torch.arange(rows * self.size, device=device)[None])
        return pos.expand(batch, rows)

    def shard(self, batch: Mapping) -> dict:
        """This rank's part of a full batch (every rank of the group passes the same one):
        input_ids / inputs_embeds, position_ids (global; arange when absent), token_type_ids
        and labels sharded in the chunk order; for a causal model shift_labels (labels
        shifted by one before sharding, the last -100). A causal model's right padding is
        dropped from the batch with its labels set to -100; packed rows (position_ids that
        restart, or cu_seq_lens_q) get cu_seq_lens_q/k and max_length_q/k over the whole row,
        and are split contiguously. See the module docstring."""
        return cp_batch.shard_batch(self, batch)

    def collator(self, collate_fn):
        """collate_fn followed by shard: a DataLoader's collate_fn for this rank (every rank
        of the group must load the same examples in the same order)."""
        def collate(features):
            return self.shard(collate_fn(features))
        return collate

    def batches(self, loader):
        """shard over an iterable of full batches (a DataLoader's)."""
        for batch in loader:
            yield self.shard(batch)

    # -- loss and gradients -----------------------------------------------------------------
    def _all_reduce(self, t: torch.Tensor, op=None) -> torch.Tensor:
        import torch.distributed as dist
        if self.size > 1:
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self.group)
        return t

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
        """The mean token loss (cross-entropy of logits (B, T, V) against this rank's
        labels (B, T): shift_labels for a causal LM) over every valid token of every rank of
        the group: L = sum of all token losses / count of all valid labels, the same value
        on every rank (one all-reduce of [sum, count]). Its gradient is that of this rank's
        part L_j = (its sum) / count, so that sum_j grad(L_j) = grad(L): reduce_gradients
        (or DDP / FSDP2 with `loss * cp.size`) gives every rank one process's gradients."""
        labels = labels.to(logits.device)
        part_sum = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                     labels.reshape(-1), ignore_index=ignore_index,
                                                     reduction="sum")
        count = (labels != ignore_index).sum()
        totals = torch.stack([part_sum.detach().double(), count.double()])
        totals = self._all_reduce(totals)
        # a batch without a valid label gives 0, not 0 / 0
        part = part_sum / totals[1].clamp(min=1).to(part_sum.dtype)
        whole = (totals[0] / totals[1].clamp(min=1)).to(part.dtype)
        return part + (whole - part).detach()

    def reduce_gradients(self, model=None, data_parallel_group=None) -> None:
        """All-reduce SUM over the group of every parameter's gradient (after backward of
        cp.loss): every rank then holds the gradient one process computes on the whole
        sequence. With data_parallel_group, then the mean over it (plain data parallelism
        over the replicas of a dp x cp layout). One flat all-reduce per dtype, after one of a
        has-gradient flag per parameter: a parameter without a gradient joins with zeros where
        another rank has one, and keeps .grad = None where no rank has one (as one process:
        an optimizer then skips it)."""
        import torch.distributed as dist
        model = self.model if model is None else model
        params = [p for p in model.parameters() if p.requires_grad]
        if any(type(p).__name__ == "DTensor" for p in params):
            raise ValueError("cp.reduce_gradients: the parameters are sharded (FSDP2): FSDP reduces the "
                             "gradients itself over its ranks, averaging; backward `loss * cp.size` instead")
        if not params:
            return
        dp = data_parallel_group if data_parallel_group is not None and dist.get_world_size(data_parallel_group) > 1 \
            else None
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=params[0].device)
        self._all_reduce(has)
        if dp is not None:
            dist.all_reduce(has, group=dp)
        params = [p for p, h in zip(params, has.tolist()) if h > 0]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for dtype in sorted({p.grad.dtype for p in params}, key=str):
            grads = [p.grad for p in params if p.grad.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in grads])
            self._all_reduce(flat)
            if dp is not None:
                dist.all_reduce(flat, group=dp)
                flat /= dist.get_world_size(dp)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()


def _shifts_labels(model) -> bool:
    """Whether the model's own loss is transformers' causal-LM loss (labels shifted by one),
    the rule transformers.Trainer uses (an encoder-decoder's labels are not shifted)."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:       # pragma: no cover - transformers without loss_utils
        return type(model).__name__.endswith("ForCausalLM")
    config = getattr(model, "config", None)
    return (LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss
            and not getattr(config, "is_encoder_decoder", False))


def context_parallel(model, group=None, *, mesh=None, mesh_dim: str = "cp",
                     shift_labels: bool | None = None) -> ContextParallel:
    """Place a transformers model built with attn_implementation="dilgen" on a
    context-parallel group: `group` (None: every rank) or the `mesh_dim` dimension of a
    DeviceMesh. Every dilgen attention layer then runs dilgen's ring over the group's P
    ranks (the model's spec with ring_size = P; zigzag rows for a causal model, contiguous
    otherwise), and the model's forward fills global position_ids. Returns the
    ContextParallel handle (shard, collator, loss, reduce_gradients, remove). With P = 1
    nothing changes but the handle (a one-process run of the same script). shift_labels:
    whether cp.shard makes shift_labels (default: the model's loss is transformers'
    causal-LM loss, as Trainer decides; a masked LM's labels are cut as they are)."""
    _refuse_sequence_mixers(model)
    group, size, rank, default = _group_of(group, mesh, mesh_dim)
    modules = _attention_modules(model)
    causal = {bool(getattr(m, "is_causal", True)) for m in modules if hasattr(m, "is_causal")} or {True}
    if len(causal) > 1:
        raise ValueError(f"context_parallel: {type(model).__name__} has causal and non-causal attention "
                         f"layers; the ring's chunk order (zigzag for causal, contiguous otherwise) is one "
                         f"per model")
    for module in model.modules():
        if hf_ring.placement(module) is not None:
            raise ValueError(f"context_parallel: {type(model).__name__} is placed already; cp.remove() first")
    shifts = _shifts_labels(model) if shift_labels is None else bool(shift_labels)
    handle = ContextParallel(model, group, size, rank, default, causal.pop(), shifts)
    handle._place(modules)
    return handle
