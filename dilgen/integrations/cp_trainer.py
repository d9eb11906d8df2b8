"""transformers.Trainer for a context-parallel dilgen model (context_parallel.py).

accelerate's context parallelism (ParallelismConfig(cp_size=...)) runs
torch.distributed.tensor.experimental.context_parallel, which distributes SDPA and Flex
calls only, and transformers' Trainer refuses it for any other attention ("supported only
with SDPA attention"); dilgen's layers run their own ring instead. So the hook is this
Trainer subclass:

    cp = context_parallel(model)                                  # or mesh=...
    trainer = ContextParallelTrainer(model=model, args=args, train_dataset=ds, context_parallel=cp)
    trainer.train()

What it changes, and why the result is one process's:

- **Batches.** Every rank of a context-parallel group must cut the same examples: the
  training (and evaluation) DataLoader samples over the data-parallel replicas only
  (DistributedSampler over world / P replicas, a replica = one group), and its collate_fn
  is the model's collator followed by cp.shard (positions, shift_labels, rows).
- **Loss and gradients** are Trainer's own: it counts the valid shift_labels of the batch
  on every rank and sums the counts over all ranks (average_tokens_across_devices), the
  model's loss is this rank's token losses' sum over that count (num_items_in_batch), and
  Trainer multiplies it by the number of ranks, which DDP's average over the ranks undoes:
  the gradient is that of the mean over every token of every rank, as one process's
  (context_parallel's module docstring: sum_j grad(L_j) = grad(L)). The logged loss is
  that mean.

Refused in one line: average_tokens_across_devices=False, a model whose forward takes no
num_items_in_batch, label smoothing or a compute_loss_func (each computes a rank-local
mean), and accelerate's cp_size > 1; at evaluation, compute_metrics,
preprocess_logits_for_metrics and predict() (each rank holds its rows of the logits, not
whole sequences). evaluate() gives the loss of one process on the same batches.
"""
from __future__ import annotations

import torch

try:
    from transformers import Trainer
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("dilgen.integrations.cp_trainer needs transformers >= 5 and accelerate") from exc


class _EpochLoader(torch.utils.data.DataLoader):
    """A DataLoader whose set_epoch reaches its DistributedSampler (Trainer calls it)."""

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)


def _replica(cp) -> tuple[int, int]:
    """(number of data-parallel replicas, this rank's): the groups of every rank's
    context-parallel group, ordered by their lowest global rank (one all_gather)."""
    import torch.distributed as dist
    world = dist.get_world_size()
    if cp.size == world:
        return 1, 0
    lowest = min(dist.get_process_group_ranks(cp.group))
    every = [None] * world
    dist.all_gather_object(every, lowest)
    groups = sorted(set(every))
    return len(groups), groups.index(lowest)


class ContextParallelTrainer(Trainer):
    """transformers.Trainer over a model placed by context_parallel(); pass its handle as
    context_parallel=. See the module docstring."""

    def __init__(self, *args, context_parallel, **kwargs):
        super().__init__(*args, **kwargs)
        self.cp = context_parallel
        pc = getattr(self.accelerator, "parallelism_config", None)
        why = None
        if pc is not None and (getattr(pc, "cp_size", 1) or 1) > 1:
            why = ("accelerate's ParallelismConfig(cp_size > 1) runs torch's SDPA context parallelism; leave "
                   "cp_size at 1: dilgen's ring splits the sequence itself")
        elif not self.args.average_tokens_across_devices:
            why = ("average_tokens_across_devices=False makes each rank's loss the mean over its own tokens; "
                   "the mean over every token of every rank needs it True")
        elif not self.model_accepts_loss_kwargs:
            why = (f"{type(self.accelerator.unwrap_model(self.model)).__name__}'s forward takes no "
                   f"num_items_in_batch, so its loss is the mean over this rank's tokens")
        elif self.args.label_smoothing_factor or self.compute_loss_func is not None:
            why = "label smoothing and compute_loss_func compute a loss over this rank's tokens alone"
        if why is not None:
            raise ValueError(f"ContextParallelTrainer: {why}")
        self._replicas = _replica(self.cp)

    def _cp_loader(self, dataset, batch_size: int, shuffle: bool, description: str):
        from torch.utils.data import DistributedSampler
        collator = self.data_collator
        try:
            import datasets
            if isinstance(dataset, datasets.Dataset):
                dataset = self._remove_unused_columns(dataset, description=description)
            else:
                collator = self._get_collator_with_removed_columns(collator, description=description)
        except ImportError:
            collator = self._get_collator_with_removed_columns(collator, description=description)
        replicas, replica = self._replicas
        sampler = DistributedSampler(dataset, num_replicas=replicas, rank=replica, shuffle=shuffle,
                                     seed=self.args.seed, drop_last=self.args.dataloader_drop_last)
        return _EpochLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=self.cp.collator(collator),
                            drop_last=self.args.dataloader_drop_last, num_workers=self.args.dataloader_num_workers,
                            pin_memory=self.args.dataloader_pin_memory)

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        return self._cp_loader(self.train_dataset, self._train_batch_size, True, "training")

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The loss only: each rank holds its rows of the logits (the ring's chunk order), so
        metrics over them would read a rank's rows as whole sequences; refused by name."""
        if not prediction_loss_only and (self.compute_metrics is not None
                                         or self.preprocess_logits_for_metrics is not None):
            raise NotImplementedError(
                "ContextParallelTrainer: compute_metrics and preprocess_logits_for_metrics see each rank's "
                "rows of the logits, not whole sequences, under context parallelism; evaluate the loss "
                "(compute_metrics=None), or compute metrics on one device after cp.remove()")
        return super().prediction_step(model, inputs, True, ignore_keys)

    def predict(self, *args, **kwargs):
        raise NotImplementedError(
            "ContextParallelTrainer.predict: the predictions would be each rank's rows of the logits, not "
            "whole sequences; predict on one device after cp.remove() (evaluate() gives the loss)")

    def get_eval_dataloader(self, eval_dataset=None):
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, str):
            dataset = self.eval_dataset[dataset]
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        return self._cp_loader(dataset, self.args.eval_batch_size, False, "evaluation")
