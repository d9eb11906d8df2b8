"""Issue 58 §2: torchscale's `args.seq_parallel` on dilgen's ring (docs/torchscale.md,
"Sequence parallel").

Two gloo ranks, started as the ring tests start theirs (ring_worker's exits, a fresh port),
each build the same model, patch it, set `args.seq_parallel = True` and run their chunk of
the sequence (`chunk_rows`) forward and backward (a fixed random loss over their rows), then
sum the parameter gradients over the group, as the training loop does. This process
compares every rank's rows of the outputs and input gradients, and the summed parameter
gradients, with one process on the whole sequence: the torchscale stand-in
(tests/torchscale_model.py) in float64 with exact branch weights; the ranks run float32
through the kernels (Triton's interpreter). Cases: the 2-layer encoder on uneven chunks
(45 rows: 23 + 22, the ring's appended zero row inside torchscale's padding), causal on
even chunks, a lone layer whose appended row is not a torchscale pad (the packed ring
call, batch 2), and GigaPath's slide encoder (five branches in two ring calls, the cls
token on rank 0). Then the refusals, each one line on every rank, none a hang. About 20 s.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torchscale_model as tm  # noqa: E402

from dilgen.compat import torchscale as compat  # noqa: E402
from proc_tree import free_port as _free_port, join_ranks, port_taken  # noqa: E402

P = 2
TOL = 1e-4                 # float32 against float64 (SPEC §2.4; gradients: twice)


# --------------------------------------------------------------------------- the cases
# Each builds (float64 torchscale stand-in, its full inputs, the loss weights) from seeds,
# the same in every process.

def _encoder(causal=False, N=45, B=2, layers=2):
    # 3 heads of 16, r 1, 2, 4: block offsets need a slot map for r = 2 (4 slots, one a
    # dummy), so two ring calls a layer: {1, 4} and {2}; w 16 and 64 span both ranks
    args = tm.make_args([8, 16, 64], [1, 2, 4], embed_dim=48, heads=3, layers=layers)
    model = tm.make_encoder(args, seed=3)
    g = torch.Generator().manual_seed(N + B)
    x = torch.randn(B, N, 48, generator=g, dtype=torch.float64)
    return model, x, torch.randn(x.shape, generator=g, dtype=torch.float64), causal


def _packed_layer():
    # w 64 > N with r 1: torchscale's one segment is the 45 rows, unpadded, so the ring's
    # 46th (zero) row would be a key torchscale has not: the packed ring call
    args = tm.make_args([8, 64], [2, 1], embed_dim=64, heads=4)
    torch.manual_seed(4)
    layer = tm.DilatedAttention(args, 64, 4, self_attention=True, subln=True).double()
    g = torch.Generator().manual_seed(45)
    x = torch.randn(2, 45, 64, generator=g, dtype=torch.float64)
    return layer, x, torch.randn(x.shape, generator=g, dtype=torch.float64), False


def _slide():
    # GigaPath's structure (LongNetViT -> make_longnet_from_name, string lists, the
    # all-False padding mask), 4 heads, r 1-16 (ring calls {1, 4, 8, 16} and {2})
    model = tm.make_slide_encoder(seed=5, embed_dim=64, depth=1, segment_length="[8, 16, 32, 64, 128]")
    tiles, coords = tm.make_slide(model, 1, 44, seed=6)
    g = torch.Generator().manual_seed(7)
    return model, (tiles, coords), torch.randn(1, 45, 64, generator=g, dtype=torch.float64), False


CASES = {"encoder_uneven": lambda: _encoder(B=1), "encoder_causal": lambda: _encoder(True, N=44, B=1, layers=1),
         "layer_packed": _packed_layer, "slide": _slide}


def slide_tokens(model, tiles, coords):
    """GigaPath's LongNetViT.forward up to its encoder (as docs/torchscale.md writes it):
    tile embeddings plus their positions, the cls token first."""
    x = model.patch_embed(tiles) + model.pos_embed[:, model.coords_to_pos(coords, model.tile_size)].squeeze(0)
    return torch.cat([model.cls_token + model.pos_embed[:, :1], x], dim=1)


def forward(name, model, inputs, causal):
    """The rows a case compares (and its loss's input) for the whole sequence or a chunk."""
    if name == "slide":
        return model.norm(model.encoder(token_embeddings=inputs)["encoder_out"])
    if name == "layer_packed":
        return model(inputs, inputs, inputs, is_causal=causal)[0]
    return model(token_embeddings=inputs, is_causal=causal)["encoder_out"]


# --------------------------------------------------------------------------- one rank


def _ring_case(name: str) -> dict:
    """This rank's rows of the outputs and input gradients, the summed parameter gradients."""
    import torch.distributed as dist
    model, inputs, weights, causal = CASES[name]()
    if name == "layer_packed":
        model = compat.DilatedAttention.from_torchscale(model.float())
        model.args.seq_parallel = True
    else:
        compat.patch(model.float(), verbose=False)
        (model.encoder if name == "slide" else model).args.seq_parallel = True
    if name == "slide":
        tiles, coords = inputs
        full = slide_tokens(model, tiles.float(), coords)      # every rank embeds the slide
        x = compat.chunk_rows(full)
    else:
        x = compat.chunk_rows(inputs.float()).clone().requires_grad_(True)
    out = forward(name, model, x, causal)
    (out * compat.chunk_rows(weights.float())).sum().backward()
    for p in model.parameters():           # the training loop's part: sum over the group
        dist.all_reduce(p.grad)
    result = {"out": out.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}
    if name != "slide":
        result["dx"] = x.grad
    return result


DROPOUT_CASES = ("encoder_uneven", "layer_packed")     # slot maps with a dummy; packed calls, batch 2


def _dropout_case(name: str) -> dict:
    """Attention dropout 0.3 while training: this rank's seq_parallel outputs and input
    gradients, and the one-process module's (dilgen's kernels on the whole sequence), both
    from torch.manual_seed(11): the ring calls draw the one-process call's mask."""
    res = {}
    for seq_parallel in (True, False):
        model, inputs, weights, causal = CASES[name]()
        if name == "layer_packed":
            model = compat.DilatedAttention.from_torchscale(model.float())
        else:
            compat.patch(model.float(), verbose=False)
        for layer in model.modules():
            if isinstance(layer, compat.DilatedAttention):
                layer.dropout = 0.3
        model.args.seq_parallel = seq_parallel
        model.train()
        chunk = compat.chunk_rows if seq_parallel else (lambda t: t)
        x = chunk(inputs.float()).clone().requires_grad_(True)
        torch.manual_seed(11)
        out = forward(name, model, x, causal)
        (out * chunk(weights.float())).sum().backward()
        res["ring" if seq_parallel else "one"] = {"out": out.detach(), "dx": x.grad}
    return res


def _refusal(name: str, rank: int) -> str:
    """The one line every rank raises (type: message), or what happened instead."""
    args = tm.make_args([8, 16], [1, 2], embed_dim=32, heads=2, seq_parallel=True)
    layer = compat.DilatedAttention(args, 32, 2, self_attention=True)
    n, mask = 20, None
    if name == "mask_on_one_rank":
        mask = torch.zeros(1, n, dtype=torch.bool)
        mask[0, -3:] = rank == 1                   # rank 1 pads, rank 0 passes an all-False mask
    elif name == "rows_per_rank":
        n = 10 if rank == 0 else 12                # the first rank short: not chunk_rows' layout
    elif name == "layout_slip":
        args.segment_length, args.dilated_ratio = [8, 12], [2, 8]
        layer = compat.DilatedAttention(args, 32, 2, self_attention=True)   # N = 40 > 12, 12 % 8
    layer.train(False)
    x = torch.randn(1, n, 32)
    try:
        layer(x, x, x, key_padding_mask=mask)
    except Exception as exc:  # noqa: BLE001 - the parent asserts on it
        return f"{type(exc).__name__}: {exc}"
    return "no error"


REFUSALS = {"mask_on_one_rank": ("NotImplementedError", "key_padding_mask with padding (rank(s) [1])"),
            "rows_per_rank": ("ValueError", "rows per rank [10, 12]"),
            "layout_slip": ("ValueError", "N = 40 with segment_lengths[1] = 12")}


def rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank: every case, then the refusals; rank{r}.pt, or rank{r}.error.json with the
    traceback; leaves by os._exit after a barrier (ring_worker._leave says why)."""
    from ring_worker import _leave, write_json
    phase = "init_process_group"
    try:
        import torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        report = {}
        for name in CASES:
            phase = name
            report[name] = _ring_case(name)
        for name in DROPOUT_CASES:
            phase = f"dropout_{name}"
            report[phase] = _dropout_case(name)
        report["refusals"] = {name: _refusal(name, rank) for name in REFUSALS}
        phase = "report"
        torch.save(report, os.path.join(out_dir, f"rank{rank}.pt.tmp"))
        os.replace(os.path.join(out_dir, f"rank{rank}.pt.tmp"), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent, then a nonzero exit
        write_json(out_dir, f"rank{rank}.error.json", {"rank": rank, "phase": phase,
                                                       "traceback": traceback.format_exc()})
        _leave(1)
    _leave(0)


# --------------------------------------------------------------------------- this process




@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Both ranks' reports (one run of the two ranks for every test below)."""
    import multiprocessing
    import torch.multiprocessing as mp
    out = tmp_path_factory.mktemp("seq_parallel")
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["torch", "torch.distributed", "triton", "dilgen", "ring_worker"])
    for attempt in (1, 2):          # once more on a fresh port if another process took it first
        for f in list(out.glob("rank*")):
            f.unlink()
        ctx = mp.start_processes(rank_main, args=(P, _free_port(), str(out)), nprocs=P, join=False,
                                 start_method="forkserver")
        try:
            join_ranks(ctx, 480, "the seq_parallel ranks")
            break
        except Exception as exc:  # noqa: BLE001 - a rank failed: its traceback
            errors = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.error.json"))]
            if attempt == 1 and port_taken(errors):
                continue
            pytest.fail(f"{exc}" + "".join(f"\n-- rank {e['rank']} in {e['phase']}:\n{e['traceback']}"
                                           for e in errors))
    return [torch.load(out / f"rank{r}.pt") for r in range(P)]


def _one_process(name, monkeypatch):
    """The case on the whole sequence, float64, exact branch weights: (out, dx, grads)."""
    real = tm.dilated_attention
    monkeypatch.setattr(tm, "dilated_attention",
                        lambda *a, **kw: real(*a, **{**kw, "detach_weights": False}))
    model, inputs, weights, causal = CASES[name]()
    if name == "slide":
        tiles, coords = inputs
        x = slide_tokens(model, tiles, coords)
        out = forward(name, model, x, causal)
        assert torch.allclose(out[:, 0], model(tiles, coords)[0], atol=1e-12, rtol=0)
    else:
        x = inputs.clone().requires_grad_(True)
        out = forward(name, model, x, causal)
    (out * weights).sum().backward()
    dx = None if name == "slide" else x.grad
    return out.detach(), dx, {n: p.grad for n, p in model.named_parameters()}


def _rows(t, rank):
    c = -(-t.shape[1] // P)
    return t[:, rank * c:(rank + 1) * c]


@pytest.mark.ranks
@pytest.mark.parametrize("name", list(CASES))
def test_seq_parallel_equals_one_process(reports, name, monkeypatch):
    out, dx, grads = _one_process(name, monkeypatch)
    for rank, report in enumerate(reports):
        got = report[name]
        assert tm.rel_error(got["out"], _rows(out, rank)) < TOL, (name, rank)
        if dx is not None:
            assert tm.rel_error(got["dx"], _rows(dx, rank)) < 2 * TOL, (name, rank)
        assert set(got["grads"]) == set(grads)
        # relative to the gradient, or to 1e-3 of the largest one (causal: k_proj.bias's is 0)
        floor = 1e-3 * max(g.norm().item() for g in grads.values())
        for key, want in grads.items():
            err = (got["grads"][key].double() - want).norm().item() / max(want.norm().item(), floor)
            assert err < 2 * TOL, (name, rank, key, err)
    if name == "slide":        # the slide embedding is the cls row: rank 0's first
        assert [r[name]["out"].shape[1] for r in reports] == [23, 22]


@pytest.mark.ranks
@pytest.mark.parametrize("name", DROPOUT_CASES)
def test_seq_parallel_draws_the_one_process_dropout_mask(reports, name):
    """With attention dropout while training, every rank's rows (and input gradients) are the
    one-process call's at the same torch.manual_seed: the layer's ring calls (slot maps with
    a dummy head, branches split over calls, the packed calls of a batch of 2) draw the coins
    of the model's heads, branches and rows; and the mask mattered."""
    for rank, report in enumerate(reports):
        got = report[f"dropout_{name}"]
        ring, one = got["ring"], got["one"]
        assert tm.rel_error(ring["out"].double(), _rows(one["out"], rank).double()) < TOL, (name, rank)
        assert tm.rel_error(ring["dx"].double(), _rows(one["dx"], rank).double()) < 2 * TOL, (name, rank)
        plain = report[name]["out"]
        assert tm.rel_error(ring["out"].double(), plain.double()) > 1e-2, (name, rank)


@pytest.mark.ranks
@pytest.mark.parametrize("name", list(REFUSALS))
def test_seq_parallel_refusals_are_one_line_on_every_rank(reports, name):
    kind, words = REFUSALS[name]
    for report in reports:
        msg = report["refusals"][name]
        assert "\n" not in msg and msg.startswith(f"{kind}: dilgen.compat.torchscale") and words in msg, msg


# --------------------------------------------------------------------------- one process


def test_seq_parallel_without_a_process_group_is_one_device(monkeypatch):
    """torchscale without torch.distributed set up runs seq_parallel on one device (its
    world size is 1); so does dilgen, and chunk_rows gives the whole sequence."""
    from dilgen.reference import reference_attention
    monkeypatch.setattr(compat, "_attend", lambda q, k, v, spec: reference_attention(q, k, v, spec))
    model, _ = tm.small_encoder(seq_parallel=True)
    x = torch.randn(1, 30, tm.ENCODER_ARGS["embed_dim"], dtype=torch.float64)
    want = model(token_embeddings=x)["encoder_out"]
    compat.patch(model, verbose=False)
    assert torch.equal(compat.chunk_rows(x), x)
    assert (model(token_embeddings=x)["encoder_out"] - want).abs().max().item() < 1e-10


def test_head_slots_make_block_offsets_mod_offsets():
    """Slot j of a ring call holds model head h with j mod r = floor(h / ceil(H / r));
    GigaPath's 16 heads and rates 1-16 take four calls."""
    from dilgen.compat import torchscale_seq as seq
    for H in (1, 3, 5, 12, 16):
        for r in (1, 2, 3, 4, 8, 16):
            slots = seq._slots(H, r)
            assert sorted(h for h in slots if h >= 0) == list(range(H))
            assert all(h // -(-H // r) == j % r for j, h in enumerate(slots) if h >= 0)
    calls = seq.plan(16, 48, (1024, 5792, 32768, 185363, 1048576), (1, 2, 4, 8, 16), False, "bfloat16", 2)
    assert [spec.dilation_rates for spec, _, _ in calls] == [(1, 16), (2,), (4,), (8,)]
    assert [members for _, _, members in calls] == [(0, 4), (1,), (2,), (3,)]


def test_which_uneven_cases_append_a_zero_row():
    """The ring cases above: 45 rows on 2 ranks append one zero row, a torchscale pad key
    (the encoder, the slide), or not (w 64 > N with r 1: the packed call). GigaPath's
    segments take the appended rows (the plain ring) from 1024 rows on 2 ranks and from
    5791 on 4, up to 185363 (its layout slip above)."""
    from dilgen.compat import torchscale_seq as seq
    assert seq.appended_rows_fit(45, 46, (8, 16, 64), (1, 2, 4))
    assert seq.appended_rows_fit(45, 46, (8, 16, 32, 64, 128), (1, 2, 4, 8, 16))
    assert not seq.appended_rows_fit(45, 46, (8, 64), (2, 1))
    gigapath = ((1024, 5792, 32768, 185363, 1048576), (1, 2, 4, 8, 16))
    for P, first in ((2, 1024), (4, 5791)):
        assert all(seq.appended_rows_fit(n, -(-n // P) * P, *gigapath) for n in range(first, 185_364, 7))
        assert not seq.appended_rows_fit(first - 1, -(-(first - 1) // P) * P, *gigapath)
