"""One rank of a context-parallel test (tests/test_context_parallel*.py): a tiny transformers
model with attn_implementation="dilgen" placed on a gloo group (dilgen.integrations.
context_parallel), one training step on its rows of a batch every rank makes alike; the
rank saves its loss and every parameter's gradient (after the reduction) to
OUT/NAME.rank{r}.pt, and the parent compares them with one process on the whole batch
(`reference`, the same builders). Refusals save the message each rank raised.

Run by hand: torchrun --nproc-per-node 2 tests/cp_worker.py OUT_DIR CASE_JSON
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta

import torch

from ring_worker import _leave, write_json
from proc_tree import free_port as _free_port, join_ranks, port_taken  # noqa: E402

PATTERN = {"segment_lengths": [16, 64], "dilation_rates": [1, 2]}
LLAMA = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, attention_dropout=0.0)
BERT = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=128, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)
N = 64


def build(model: str, dropout: float = 0.0):
    """A float32 model with fixed weights: "causal" (Llama), "bidirectional" (the same Llama,
    every layer non-causal) or "bert" (BertForMaskedLM, an encoder); dropout: the Llama's
    attention dropout (in train mode)."""
    import dilgen.integrations.transformers  # noqa: F401  registers "dilgen"
    import transformers
    if model == "bert":
        config = transformers.BertConfig(**BERT)
        cls = transformers.BertForMaskedLM
    else:
        config = transformers.LlamaConfig(**dict(LLAMA, attention_dropout=dropout))
        cls = transformers.LlamaForCausalLM
    config.dilgen_spec = dict(PATTERN)
    torch.manual_seed(0)
    net = cls._from_config(config, attn_implementation="dilgen")
    if model == "bidirectional":
        net.config.is_causal = False
        for layer in net.model.layers:
            layer.self_attn.is_causal = False
    return net.float().train(bool(dropout)) if dropout else net.float()


def _seed_dropout(case: dict) -> None:
    """Attention dropout's draws start from one seed in every process (the ring takes rank
    0's seed at each layer, one device draws its own: the same seeds)."""
    if case.get("dropout"):
        torch.manual_seed(7)


def full_batch(case: dict) -> dict:
    """The whole batch of a case, the same on every rank and in the parent."""
    g = torch.Generator().manual_seed(case.get("seed", 1))
    rows = case.get("rows", 2)
    ids = torch.randint(1, 61, (rows, N), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if case.get("batch") == "right_padded":      # row 1 holds 40 tokens, then padding
        mask = torch.ones_like(ids)
        mask[1, 40:] = 0
        batch["attention_mask"] = mask
        batch["labels"][1, 40:] = -100
    if case.get("batch") == "packed":            # DataCollatorWithFlattening of 3 sequences
        from transformers import DataCollatorWithFlattening
        lengths = (20, 30, 14)
        feats = [{"input_ids": ids[0, :n].tolist()} for n in lengths]
        batch = DataCollatorWithFlattening(return_flash_attn_kwargs=case.get("flash", False))(feats)
    if case.get("model") == "bert":               # masked LM: a label at every fourth token
        labels = torch.full_like(ids, -100)
        labels[:, ::4] = ids[:, ::4]
        batch["labels"] = labels
    return batch


def _grads(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and type(g).__name__ == "DTensor":
            g = g.full_tensor()
        out[name] = None if g is None else g.detach().clone()
    return out


def reference(case: dict) -> dict:
    """Loss and gradients of one process on the whole batch (the model's own loss: the
    mean over every valid label; for a padded batch the one-device padded kernels)."""
    model = build(case.get("model", "causal"), case.get("dropout", 0.0))
    batch = full_batch(case)
    _seed_dropout(case)
    loss = model(**batch).loss
    loss.backward()
    return {"loss": loss.item(), "grads": _grads(model)}


def run_lm(case: dict, rank: int, world: int) -> dict:
    from dilgen.integrations.context_parallel import context_parallel
    model = build(case.get("model", "causal"), case.get("dropout", 0.0))
    # a sub-group holding the same ranks is not the default group: its calls pass the group
    # (its name, traced)
    group = torch.distributed.new_group(list(range(world))) if case.get("subgroup") else None
    cp = context_parallel(model, group)
    step = torch.compile(model, fullgraph=True) if case.get("compile") else model
    batch = cp.shard(full_batch(case))
    if case.get("own_loss"):       # the model's loss: this rank's part L_j, sum_j L_j = L
        part = step(**batch).loss
        part.backward()
        whole = part.detach().clone()
        torch.distributed.all_reduce(whole)
        cp.reduce_gradients()
        return {"loss": whole.item(), "grads": _grads(model), "order": cp.order}
    labels = batch.get("shift_labels", batch["labels"])
    _seed_dropout(case)
    out = step(**{k: v for k, v in batch.items() if k not in ("labels", "shift_labels")})
    loss = cp.loss(out.logits, labels)
    loss.backward()
    cp.reduce_gradients()
    result = {"loss": loss.item(), "grads": _grads(model), "order": cp.order}
    if case.get("bad_positions"):          # refused by a device-side assert in the graph
        ids, pos = batch["input_ids"], batch["position_ids"]
        restart = pos.clone()
        restart[:, 5] = 0                  # a packed row without cu_seq_lens_q, on every rank
        local = torch.arange(ids.shape[1])[None].expand_as(ids)      # a per-rank arange
        result["refused"] = {"restart": _message(lambda: step(input_ids=ids, position_ids=restart)),
                             "local": _message(lambda: step(input_ids=ids, position_ids=local))}
    return result


def run_fsdp(case: dict, rank: int, world: int) -> dict:
    """FSDP2 over all 4 ranks (the flattened dp x cp mesh) and the ring over cp: replica
    r = the dp index trains on rows [2r, 2r + 2) of the batch; FSDP averages the gradients
    over the 4 ranks, so each rank backwards loss * cp.size."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from dilgen.integrations.context_parallel import context_parallel
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    model = build("causal")
    cp = context_parallel(model, mesh=mesh)
    flat = mesh["dp", "cp"]._flatten("dp_cp")
    for layer in model.model.layers:
        fully_shard(layer, mesh=flat)
    fully_shard(model, mesh=flat)
    dp = mesh.get_local_rank("dp")
    full = full_batch(dict(case, rows=4))
    batch = cp.shard({k: v[2 * dp:2 * dp + 2] for k, v in full.items()})
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    loss = cp.loss(out.logits, batch["shift_labels"])
    (loss * cp.size).backward()
    losses = [torch.zeros(()) for _ in range(world)]
    torch.distributed.all_gather(losses, loss.detach())
    return {"loss": sum(x.item() for x in losses) / world, "grads": _grads(model), "cp_rank": cp.rank}


def _message(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the parent asserts on the message
        return f"{type(exc).__name__}: {exc}"
    return None


def run_refusals(case: dict, rank: int, world: int) -> dict:
    """Each refusal's message on this rank (None: nothing was refused)."""
    import transformers
    from dilgen.integrations.context_parallel import context_parallel
    model = build("causal")
    cp = context_parallel(model)
    ids = full_batch({})["input_ids"]
    rows = cp.shard({"input_ids": ids})
    left = torch.ones_like(ids)
    left[0, :5] = 0
    mine = torch.ones_like(rows["input_ids"])
    if rank == world - 1:
        mine[1, -3:] = 0                              # padding on one rank only
    import copy
    import io
    buffer = io.BytesIO()
    torch.save(model, buffer)                         # a saved placed model loads as a one-device one
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    twin = copy.deepcopy(model)                       # an EMA copy runs on the same group
    kept = {"saved_is_one_device": _message(lambda: loaded(input_ids=ids)),
            "copy_on_the_ring": _message(lambda: twin(input_ids=rows["input_ids"]))}
    sdpa = transformers.LlamaForCausalLM._from_config(transformers.LlamaConfig(**LLAMA), attn_implementation="sdpa")
    out = {
        **kept,
        "left_padding": _message(lambda: cp.shard({"input_ids": ids, "attention_mask": left})),
        "odd_length": _message(lambda: cp.shard({"input_ids": ids[:, :62]})),
        "mask_on_one_rank": _message(lambda: model(**rows, attention_mask=mine)),
        "generation": _message(lambda: model.generate(rows["input_ids"][:1], max_new_tokens=2, do_sample=False)),
        "output_attentions": _message(lambda: model(**rows, output_attentions=True)),
        "sdpa_model": _message(lambda: context_parallel(sdpa)),
        "placed_twice": _message(lambda: context_parallel(model)),
        "unknown_token_key": _message(lambda: cp.shard({"input_ids": ids, "pixel_mask": ids})),
        "labels_unshifted": _message(lambda: model(input_ids=rows["input_ids"], labels=rows["input_ids"])),
    }
    bert = build("bert")
    cp_bert = context_parallel(bert)
    rows_bert = cp_bert.shard({"input_ids": ids, "labels": ids})
    out["masked_lm_labels"] = _message(lambda: bert(**rows_bert))
    local = torch.arange(rows["input_ids"].shape[1])[None].expand_as(rows["input_ids"])
    restart = rows["position_ids"].clone()
    restart[:, 5] = 0
    out["local_positions"] = _message(lambda: model(input_ids=rows["input_ids"], position_ids=local))
    out["restarting_positions"] = _message(lambda: model(input_ids=rows["input_ids"], position_ids=restart))
    # a parameter with a gradient on one rank only joins with zeros elsewhere; one with a
    # gradient on no rank keeps None (an optimizer skips it, as in one process)
    tiny = torch.nn.Linear(2, 2)
    if rank == world - 1:
        tiny.weight.grad = torch.full_like(tiny.weight, 3.0)
    cp.reduce_gradients(tiny)
    out["grad_one_rank"] = tiny.weight.grad.tolist()
    out["grad_no_rank"] = None if tiny.bias.grad is None else tiny.bias.grad.tolist()
    cp.remove()
    out["after_remove"] = _message(lambda: model(input_ids=rows["input_ids"]))   # one device again
    return out


def run_trainer(case: dict, rank: int, world: int) -> dict:
    """ContextParallelTrainer (DDP over the gloo group, as accelerate sets it up): one SGD
    step of learning rate 1e3 on the case's batch (both examples), so that the step is
    -1e3 x the gradient, far above the weights' rounding; returns the logged loss and
    (before - after) / 1e3."""
    import tempfile
    from transformers import TrainingArguments
    from dilgen.integrations.context_parallel import context_parallel
    from dilgen.integrations.cp_trainer import ContextParallelTrainer
    lr = 1e3
    model = build("causal")
    cp = context_parallel(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    full = full_batch(case)
    data = [{"input_ids": full["input_ids"][i], "labels": full["labels"][i]} for i in range(2)]
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2, max_steps=1,
                             optim="sgd", learning_rate=lr, lr_scheduler_type="constant", weight_decay=0.0,
                             max_grad_norm=0.0, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                             disable_tqdm=True, seed=0)
    trainer = ContextParallelTrainer(model=model, args=args, train_dataset=data, context_parallel=cp)
    out = trainer.train()
    grads = {n: (before[n] - p.detach()) / lr for n, p in model.named_parameters()}
    return {"loss": out.training_loss, "grads": grads}


def run_trainer_eval(case: dict, rank: int, world: int) -> dict:
    """ContextParallelTrainer.evaluate on the case's batch (both examples, one eval batch):
    the eval_loss; then what it refuses: compute_metrics (each rank holds its rows of the
    logits) and predict()."""
    import tempfile
    from transformers import TrainingArguments
    from dilgen.integrations.context_parallel import context_parallel
    from dilgen.integrations.cp_trainer import ContextParallelTrainer
    model = build("causal")
    cp = context_parallel(model)
    full = full_batch(case)
    data = [{"input_ids": full["input_ids"][i], "labels": full["labels"][i]} for i in range(2)]
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_eval_batch_size=2, report_to=[],
                             use_cpu=True, disable_tqdm=True, seed=0)
    trainer = ContextParallelTrainer(model=model, args=args, eval_dataset=data, context_parallel=cp)
    out = {"eval_loss": trainer.evaluate()["eval_loss"]}
    trainer.compute_metrics = lambda p: {"n": 0.0}
    out["compute_metrics"] = _message(trainer.evaluate)
    trainer.compute_metrics = None
    out["predict"] = _message(lambda: trainer.predict(data))
    return out


RUN = {"lm": run_lm, "fsdp": run_fsdp, "refusals": run_refusals, "trainer": run_trainer,
       "trainer_eval": run_trainer_eval}


def worker(rank: int, world: int, port: int, cases: list[dict], out_dir: str) -> None:
    """One rank: every case's result to OUT/NAME.rank{r}.pt (a case's exception: its
    traceback in the report rank{r}.json), a final barrier, os._exit (ring_worker._leave)."""
    phase = "init_process_group"
    try:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if port:                             # as torchrun sets them (accelerate reads them too)
            os.environ.update(MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        import torch.distributed as dist
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        phase = "cases"
        report = {"rank": rank, "fails": []}
        for case in cases:
            try:
                torch.save(RUN[case.get("kind", "lm")](case, rank, world),
                           os.path.join(out_dir, f"{case['name']}.rank{rank}.pt"))
            except Exception:  # noqa: BLE001 - the parent asserts on the report
                report["fails"].append(f"{case['name']} (rank {rank}): {traceback.format_exc()}")
        write_json(out_dir, f"rank{rank}.json", report)
        phase = "final barrier"
        dist.barrier()
    except BaseException:  # noqa: BLE001 - reported, then the rank exits 1
        write_json(out_dir, f"rank{rank}.error.json", {"rank": rank, "phase": phase,
                                                       "traceback": traceback.format_exc()})
        _leave(1)
    _leave(0)


# -- the parent's side: spawn the ranks, read what they saved ---------------------------------


def _forkserver() -> str:
    """Ranks start from a fork server that imported torch, transformers' Llama and BERT,
    dilgen's integration and this worker once (a spawned rank would import them itself,
    about 6 s of CPU each)."""
    import multiprocessing
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["torch", "torch.distributed", "torch._dynamo", "triton", "dilgen", "transformers",
         "transformers.models.llama.modeling_llama", "transformers.models.bert.modeling_bert",
         "dilgen.integrations.context_parallel", "cp_worker"])
    return "forkserver"


def spawn(world: int, cases: list[dict], out_dir, timeout_s: float) -> dict:
    """Run the cases on `world` ranks; returns {case name: [each rank's saved result]}.
    Any rank's exception or a nonzero exit raises AssertionError with the tracebacks; a
    hang fails the test (proc_tree.join_ranks)."""
    from pathlib import Path
    import torch.multiprocessing as mp
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException
    out_dir = Path(out_dir)
    for attempt in (1, 2):          # once more on a fresh port if another process took it first
        for f in list(out_dir.glob("rank*.json")):
            f.unlink()
        ctx = mp.start_processes(worker, args=(world, _free_port(), cases, str(out_dir)), nprocs=world,
                                 join=False, start_method=_forkserver())
        try:
            join_ranks(ctx, timeout_s, f"context parallel P={world}")
            break
        except (ProcessExitedException, ProcessRaisedException) as exc:
            errors = [json.loads(f.read_text()) for f in out_dir.glob("rank*.error.json")]
            if attempt == 1 and port_taken(errors):
                continue
            fails = [x for f in out_dir.glob("rank?.json") for x in json.loads(f.read_text())["fails"]]
            raise AssertionError(f"P={world}: {exc}" + "".join(f"\n-- rank {e['rank']} in {e['phase']}:\n{e['traceback']}"
                                                               for e in errors) + "".join(fails)) from None
    fails = [x for r in range(world) for x in json.loads((out_dir / f"rank{r}.json").read_text())["fails"]]
    assert not fails, "\n".join(fails)
    return {c["name"]: [torch.load(out_dir / f"{c['name']}.rank{r}.pt", weights_only=False) for r in range(world)]
            for c in cases}


def grad_errors(got: dict, want: dict, floor: float = 1e-9) -> dict:
    """||got - want|| / ||want|| of every parameter's gradient. A gradient that is 0 in
    exact arithmetic (a key bias: it adds one constant to all of a query's scores, which
    softmax ignores) comes as rounding noise of 1e-12 in both: below `floor` it counts as
    0 error."""
    out = {}
    for name, w in want.items():
        g = got[name]
        assert g is not None and w is not None, name
        diff = (g.double() - w.double()).norm().item()
        out[name] = 0.0 if diff < floor else diff / max(w.double().norm().item(), 1e-300)
    return out


if __name__ == "__main__":
    worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), 0, json.loads(sys.argv[2]), sys.argv[1])
