"""Attention dropout in the kernels (issue 60): `kernel(q, k, v, dropout_p=p)` runs the spec's
dropout plan, whose forward and backward equal the float64 reference under the same mask
(dilgen.reference.differentiable_reference(dropout_p=, seed=), the coins of dilgen.dropout),
on fresh random inputs with poisoned outputs; what it does not take yet is refused by name."""
from __future__ import annotations

import zlib

import pytest
import torch

import dilgen
from dilgen.reference import differentiable_reference
from dilgen.runtime.checks import InputError
from dilgen.runtime.dropout_call import dropout_attention

from conftest import TOL, device, rel_error

CASES = {
    "two_branches": dict(segment_lengths=[16, 32], dilation_rates=[1, 2]),
    "causal_gqa_r3": dict(segment_lengths=[16, 48], dilation_rates=[1, 3], causal=True, num_kv_heads=2),
    "r_not_dividing_w_short_last": dict(segment_lengths=[24, 40], dilation_rates=[1, 3]),
    "hilbert_segment": dict(segment_lengths=[16, 64], dilation_rates=[2, 4], hilbert={"scope": "segment"}),
    "hilbert_sequence": dict(segment_lengths=[16, 32], dilation_rates=[1, 2],
                             hilbert={"scope": "sequence", "grid": [8, 8]}),
    "hilbert_sequence_causal_table": dict(segment_lengths=[16, 32], dilation_rates=[1, 2], causal=True,
                                          hilbert={"scope": "sequence", "grid": [8, 8]}),
    "causal_mqa_one_branch": dict(segment_lengths=[64], dilation_rates=[4], causal=True, num_kv_heads=1),
    "torchscale_head_blocks_gqa": dict(segment_lengths=[16, 32], dilation_rates=[1, 2], head_offsets="block",
                                       num_kv_heads=2),
    "zero_pad_short_last": dict(segment_lengths=[24, 40], dilation_rates=[1, 2], short_segments="zero_pad"),
}


def _spec(name: str, dtype: str = "float32", **fields) -> dilgen.Spec:
    fields = dict(fields)
    return dilgen.Spec(name=f"dropout_{name}", num_heads=4, num_kv_heads=fields.pop("num_kv_heads", 4),
                       head_dim=16, dtype=dtype, **fields)


def _inputs(spec, batch: int, n: int, name: str):
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    dt = getattr(torch, spec.dtype)
    return [torch.randn(batch, n, h, spec.head_dim, generator=gen).to(dt).to(device()).requires_grad_()
            for h in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads)]


def _out_and_grads_equal_the_reference(spec, q, k, v, out, p: float, seed: int):
    """The call's out and, through one random cotangent, its q, k, v gradients against the
    float64 reference under the same mask; returns the reference's (out, lse, inputs)."""
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out)
    (out * grad).sum().backward()
    ref_in = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = differentiable_reference(*ref_in, spec, dropout_p=p, seed=seed)
    (ref_out * grad.double().cpu()).sum().backward()
    tol = TOL[spec.dtype]
    assert not torch.isnan(out).any(), "unwritten rows"
    assert rel_error(out, ref_out) < tol
    for mine, ref in zip((q, k, v), ref_in):
        assert rel_error(mine.grad, ref.grad) < 2 * tol
    return ref_out, ref_lse, ref_in


def _check(spec, batch: int, n: int, p: float, seed: int, name: str) -> None:
    q, k, v = _inputs(spec, batch, n, name)
    attn = dilgen.compile(spec).compiled_for(q.device).attention
    out, lse = dropout_attention(attn, q, k, v, p, return_lse=True, seed=seed)
    ref_out, ref_lse, ref_in = _out_and_grads_equal_the_reference(spec, q, k, v, out, p, seed)
    tol = TOL[spec.dtype]
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse.cpu()), ~finite)
    assert rel_error(lse.cpu()[finite], ref_lse[finite]) < tol
    # the mask mattered: without dropout the output is another one
    plain = differentiable_reference(*(t.detach() for t in ref_in), spec)[0]
    assert rel_error(out, plain) > 10 * tol


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_gradients_equal_the_reference_under_the_same_mask(name):
    _check(_spec(name, **CASES[name]), 2, 64, 0.25, 20261128 + len(name), name)


@pytest.mark.parametrize("block_n, descriptors, rows_first", [(32, False, False), (64, False, False),
                                                           (64, True, False), (64, False, True), (64, True, True)])
@pytest.mark.parametrize("name", ["two_branches", "causal_gqa_r3"])
def test_key_blocks_of_32_and_64_lanes_draw_the_reference_mask(name, block_n, descriptors, rows_first):
    """The GPU's key blocks (32 lanes and more: each call's 8 coins in the registers of an MMA
    accumulator's columns, common.dropout_keep) against the reference, here in the interpreter,
    whose own blocks are 16 lanes wide (the half-span path); dK/dV's keys along rows too, or
    its queries (dkdv_rows_first); and with keys and queries read through tensor descriptors,
    as one H200 runs the plan."""
    from dilgen.runtime.dropout_call import _DropoutFunction, dropout_args
    from dilgen.runtime.registry import twin
    spec = _spec(f"wide_{name}_{block_n}{'_tma' if descriptors else ''}{'_rows' if rows_first else ''}", **CASES[name])
    q, k, v = _inputs(spec, 2, 128, name)
    attn = dilgen.compile(spec).compiled_for(q.device).attention
    tuning = {"dropout": True, "block_m": 32, "block_n": block_n, "bwd_kv": (block_n, 32, 4, 1),
              "bwd_dq": (32, block_n, 4, 1), "dkdv_rows_first": rows_first,
              **({"fused_tma": True, "bwd_tma": True} if descriptors else {})}
    drop = twin(attn, q.device, tuning=tuning)
    config = drop.plan["config"]
    assert config["block_n"] == block_n and config["bwd_kv"][0] == block_n
    assert config.get("fused_tma", False) == descriptors and config.get("bwd_tma", False) == descriptors
    assert config.get("dkdv_rows_first", False) == rows_first
    seed, p = 4242 + block_n, 0.3
    out, _ = _DropoutFunction.apply(q, k, v, drop, dropout_args(drop, q, p, seed), None)
    _out_and_grads_equal_the_reference(spec, q, k, v, out, p, seed)


@pytest.mark.parametrize("name", ["causal_gqa_r3", "causal_mqa_one_branch"])
def test_a_causal_plans_lane_kernels_draw_the_reference_mask(name):
    """{"dropout": true, "lanes": "all"}: every branch in its own lane launch (as a causal plan's
    Gluon lane kernels run it on sm90, {"gluon_lanes": true}), the `tl` lane forward, dq and
    dK/dV drawing the reference's coins."""
    from dilgen.runtime.dropout_call import _DropoutFunction, dropout_args
    from dilgen.runtime.registry import twin
    spec = _spec(f"lanes_{name}", **CASES[name])
    q, k, v = _inputs(spec, 2, 64, name)
    attn = dilgen.compile(spec).compiled_for(q.device).attention
    drop = twin(attn, q.device, tuning={"dropout": True, "lanes": "all"})
    assert all(br["lanes"] for br in drop.plan["branches"])
    out, _ = _DropoutFunction.apply(q, k, v, drop, dropout_args(drop, q, 0.3, 99), None)
    _out_and_grads_equal_the_reference(spec, q, k, v, out, 0.3, 99)


def test_bfloat16_and_a_high_drop_rate():
    _check(_spec("bf16", "bfloat16", **CASES["causal_gqa_r3"]), 1, 64, 0.6, 77, "bf16")


def test_the_seed_comes_from_torchs_generator():
    spec = _spec("seeded", **CASES["two_branches"])
    kernel = dilgen.compile(spec)
    q, k, v = (t.detach() for t in _inputs(spec, 1, 32, "seeded"))
    torch.manual_seed(5)
    a = kernel(q, k, v, dropout_p=0.5)
    b = kernel(q, k, v, dropout_p=0.5)
    torch.manual_seed(5)
    c = kernel(q, k, v, dropout_p=0.5)
    assert torch.equal(a, c), "torch.manual_seed reproduces a call"
    assert not torch.equal(a, b), "successive calls draw different masks"


def test_dropout_p_zero_runs_the_kernel_without_dropout():
    spec = _spec("zero", **CASES["two_branches"])
    kernel = dilgen.compile(spec)
    q, k, v = (t.detach() for t in _inputs(spec, 1, 32, "zero"))
    attn = kernel.compiled_for(q.device).attention
    assert torch.equal(kernel(q, k, v, dropout_p=0.0), kernel(q, k, v))
    assert not attn.__dict__.get("_twins"), "p = 0 made no dropout module"


@pytest.mark.parametrize("p", [-0.1, 1.0, 2, "0.1", True])
def test_a_drop_probability_outside_0_1_is_refused(p):
    spec = _spec("bad_p", **CASES["two_branches"])
    q, k, v = (t.detach() for t in _inputs(spec, 1, 32, "bad_p"))
    with pytest.raises(InputError, match="dropout_p"):
        dilgen.compile(spec)(q, k, v, dropout_p=p)


def test_what_dropout_does_not_run_yet_is_refused_by_name():
    spec = _spec("refusals", **CASES["two_branches"])
    kernel = dilgen.compile(spec)
    q, k, v = (t.detach() for t in _inputs(spec, 1, 32, "refusals"))
    with pytest.raises(InputError, match="chunk_order"):
        kernel(q, k, v, dropout_p=0.1, chunk_order="zigzag")


def test_a_traced_ring_call_drawing_part_of_a_larger_mask_is_refused():
    """torchscale's seq_parallel draws a layer's mask over several ring calls (a Counter),
    which run eagerly: such a call traced (here under a fake-tensor mode) is refused by
    name before any collective, not run with a mask of its own."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from dilgen.runtime.ring.dropout import Counter
    from dilgen.runtime.ring.op import ring_attention
    spec = _spec("part_traced", ring_size=2, **CASES["two_branches"])
    attn = dilgen.compile(spec).compiled_for(torch.device("cpu")).attention
    counter = Counter(1, 64, 0, torch.zeros(4, 2, dtype=torch.int64))
    with FakeTensorMode():
        q = torch.empty(1, 32, 4, 16)
        with pytest.raises(InputError, match="seq_parallel"):
            ring_attention(attn, q, q, q, dropout_p=0.1, counter=counter)


def _sequences_against_reference(spec, q, k, v, out, lse, spans, total, p, seed):
    """Each (row0, length) span of the packed rows against the float64 reference of that
    sequence alone under the packed call's coins (dropout_rows = (row0, total)); then its
    gradients, through one random cotangent of the packed output."""
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out)
    (out * grad).sum().backward()
    tol = TOL[spec.dtype]
    for row0, n in spans:
        piece = [t.detach()[row0:row0 + n].double().cpu().unsqueeze(0).requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = differentiable_reference(*piece, spec, dropout_p=p, seed=seed, dropout_rows=(row0, total))
        (ref_out * grad[row0:row0 + n].double().cpu().unsqueeze(0)).sum().backward()
        assert rel_error(out[row0:row0 + n], ref_out[0]) < tol, (row0, n)
        finite = torch.isfinite(ref_lse[0])
        assert rel_error(lse.cpu()[:, row0:row0 + n][finite], ref_lse[0][finite]) < tol
        for mine, ref in zip((q, k, v), piece):
            assert rel_error(mine.grad[row0:row0 + n], ref.grad[0]) < 2 * tol, (row0, n)


@pytest.mark.parametrize("name", ["two_branches", "causal_gqa_r3", "hilbert_segment"])
def test_packed_rows_draw_as_one_sequence_of_their_rows(name):
    spec = _spec(f"packed_{name}", **CASES[name])
    q, k, v = (t.detach()[0].requires_grad_() for t in _inputs(spec, 1, 96, name))
    cu = torch.tensor([0, 40, 40, 96], dtype=torch.int32, device=q.device)     # an empty sequence too
    spans = [(0, 40), (40, 56)]
    # the seed the call draws is not returned: draw it again from the same generator state
    torch.manual_seed(11)
    out, lse = dilgen.compile(spec)(q, k, v, cu_seqlens=cu, return_lse=True, dropout_p=0.3)
    torch.manual_seed(11)
    seed = int(torch.randint(0, 1 << 62, (1,)).item())
    _sequences_against_reference(spec, q, k, v, out, lse, spans, 96, 0.3, seed)


def test_a_padded_batch_draws_as_its_packed_rows():
    """Item b's tokens (rows b N + start ..) draw as those rows of the B N packed rows."""
    spec = _spec("padded", **CASES["causal_gqa_r3"])
    q, k, v = _inputs(spec, 2, 48, "padded")
    mask = torch.zeros(2, 48, dtype=torch.bool, device=q.device)
    mask[1, :7] = True                                       # item 1: left padding
    torch.manual_seed(12)
    out, lse = dilgen.compile(spec).padded(q, k, v, mask, return_lse=True, dropout_p=0.2)
    torch.manual_seed(12)
    seed = int(torch.randint(0, 1 << 62, (1,)).item())
    assert torch.equal(out[1, :7], torch.zeros_like(out[1, :7])), "padded rows are 0"
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out)
    (out * grad).sum().backward()
    tol = TOL[spec.dtype]
    for b, (start, n) in enumerate([(0, 48), (7, 41)]):
        piece = [t.detach()[b:b + 1, start:].double().cpu().requires_grad_() for t in (q, k, v)]
        ref_out, _ = differentiable_reference(*piece, spec, dropout_p=0.2, seed=seed, dropout_rows=(b * 48 + start, 96))
        (ref_out * grad[b:b + 1, start:].double().cpu()).sum().backward()
        assert rel_error(out[b:b + 1, start:], ref_out) < tol
        for mine, ref in zip((q, k, v), piece):
            assert rel_error(mine.grad[b:b + 1, start:], ref.grad) < 2 * tol


#: the ring dropout cases (tests/dropout_ring_worker.py) in groups, a torchrun each, and the
#: transports each case may run by (None: any)
RING_GROUPS = {
    "local_heads": {"local_contiguous": {"local"}, "local_zigzag_causal_gqa": {"local"},
                    "heads_spanning": {"heads"}, "heads_zigzag_causal_gqa_r3": {"heads"},
                    "heads_hilbert_sequence": {"heads"}},
    "windows": {"forced_ring": {"ring"}, "forced_allgather_causal_gqa_r3": {"allgather"},
                "forced_ring_zigzag_r3": {"ring"}, "forced_ring_zigzag_second_span": {"ring"},
                "windows_mqa": {"ring", "allgather", "hybrid"}},      # one kv head: no heads transport
    "wide_hilbert": {"forced_ring_zigzag_second_span_wide": {"ring"}, "forced_ring_zigzag_r3_wide": {"ring"},
                     "forced_ring_hilbert_segment": {"ring"}, "forced_ring_hilbert_sequence": {"ring"}},
    "recut_hybrid": {"forced_recut_zigzag_causal_gqa_r3": {"recut"}, "forced_recut_r3": {"recut"},
                     "forced_hybrid_zigzag_causal_gqa_r3": {"hybrid"}, "forced_hybrid_second_branch_local": {"hybrid"}},
    "compiled_packed": {"compiled_zigzag_causal_gqa_r3": None, "packed_spanning": {"ring", "allgather"}},
}


def test_the_ring_groups_name_every_worker_case():
    import dropout_ring_worker
    named = {name for group in RING_GROUPS.values() for name in group}
    assert named == {c[0] for c in dropout_ring_worker.CASES} | {"packed_spanning"}


@pytest.mark.ranks
@pytest.mark.parametrize("group", sorted(RING_GROUPS))
def test_the_ring_draws_one_devices_mask_on_every_transport(tmp_path, group):
    """P = 2 under torchrun (NCCL on 2 GPUs, else gloo): the local, recut and hybrid transports (each piece at its
    global offset), the head-parallel one (each rank's heads as the model's) and the window transports (ring and
    all-gather, their key windows starting off a span of 32 lanes) give every rank
    the rows, and the gradients, of the single-device call with the same seed (rank 0's)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from proc_tree import free_port
    root = Path(__file__).resolve().parents[1]
    want = RING_GROUPS[group]
    env = dict(os.environ, PYTHONPATH=f"{root}:{root / 'tests'}", DILGEN_RING_TRANSPORT="auto")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(root / "tests" / "dropout_ring_worker.py"), str(tmp_path), ",".join(want)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(res) == set(want), (rank, sorted(res))
        for name, transports in want.items():
            r = res[name]
            assert transports is None or r["transport"] in transports, (name, r)
            assert max(r[x] for x in ("out", "dq", "dk", "dv")) < (1e-5 if r["device"] == "cpu" else 1e-4), (name, r)
            assert r["plain_gap"] > 1e-2, (name, r)             # the mask mattered


def test_over_200_seeds_the_mean_output_is_the_output_without_dropout():
    """The kernels' dropout is unbiased: over 200 seeds the mean output is within 3 standard
    errors of the output without dropout, at the false-alarm rate of one 3-sigma test (0.27 %)
    for the whole family of checks: along 4 fixed random directions within 3.5 standard errors
    each (4 x 0.047 %), and every entry within 4.5 (256 entries, which a row's coins move
    together); and the kept fraction of the coins is within 3 sigma of 1 - p."""
    from dilgen import dropout as coins
    spec = dilgen.Spec(name="dropout_stats", num_heads=1, head_dim=16, dtype="float32",
                       segment_lengths=[8, 16], dilation_rates=[1, 2])
    q, k, v = (t.detach() for t in _inputs(spec, 1, 16, "stats"))
    attn = dilgen.compile(spec).compiled_for(q.device).attention
    plain = dilgen.compile(spec)(q, k, v).double().cpu()
    p, n = 0.3, 200
    outs = torch.stack([dropout_attention(attn, q, k, v, p, seed=1000 + s).double().cpu() for s in range(n)])
    se = outs.std(0) / n ** 0.5
    worst = ((outs.mean(0) - plain).abs() / (se + 1e-12)).max().item()
    assert worst <= 4.5, worst
    for u in torch.randn(4, *plain.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64):
        proj = (outs * u).sum(dim=tuple(range(1, outs.dim())))
        z = (proj.mean() - (plain * u).sum()) / (proj.std() / n ** 0.5)
        assert abs(z.item()) <= 3.5, z.item()
    branch, q, lane = torch.arange(2)[:, None, None], torch.arange(16)[:, None], torch.arange(16)
    c = torch.stack([coins.keep(1000 + s, p, coins.stream(1, 2, 0, branch), q, lane) for s in range(n)])
    kept = c.double().mean().item()
    assert abs(kept - (1 - p)) < 3 * (p * (1 - p) / c.numel()) ** 0.5, kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_training_step_in_a_cuda_graph_draws_a_new_mask_each_replay():
    """A forward and backward captured in one CUDA graph: the seed is drawn in the graph by the
    device's generator and read by the kernels when they run (dropout_call.seed_tensor), so
    two replays drop different entries, and each replay's output and gradients are the
    float64 reference's under the seed that replay drew."""
    spec = _spec("graphed", **CASES["causal_gqa_r3"])
    kernel = dilgen.compile(spec)
    q, k, v = _inputs(spec, 1, 64, "graphed")
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(q)

    def step():
        out = kernel(q, k, v, dropout_p=0.3)
        (out * grad).sum().backward()
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                       # warm-up: compile, build the twin
        step()
    torch.cuda.current_stream().wait_stream(side)
    for t in (q, k, v):
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    seed_drawn = out.grad_fn.args[0]                    # the graph's seed: each replay writes it
    seeds = []
    for _ in range(2):
        for t in (out, q.grad, k.grad, v.grad):
            t.detach().fill_(float("nan"))              # an unwritten entry fails
        graph.replay()
        torch.cuda.synchronize()
        seeds.append(int(seed_drawn.item()))
        ref_in = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
        ref_out = differentiable_reference(*ref_in, spec, dropout_p=0.3, seed=seeds[-1])[0]
        (ref_out * grad.double().cpu()).sum().backward()
        assert rel_error(out, ref_out) < TOL[spec.dtype]
        for mine, ref in zip((q.grad, k.grad, v.grad), ref_in):
            assert rel_error(mine, ref.grad) < 2 * TOL[spec.dtype]
    assert seeds[0] != seeds[1], "each replay draws its own mask"


def _eager_and_compiled(call, base, grad, seed: int) -> dict:
    """{"eager", "compiled"}: (out, dq, dk, dv, a second call's out) of `call` on clones of
    `base` at torch.manual_seed(seed), eagerly and traced whole (aot_eager, fullgraph)."""
    import torch._dynamo
    torch._dynamo.reset()
    runs = {}
    for name, fn in (("eager", call), ("compiled", torch.compile(call, backend="aot_eager", fullgraph=True))):
        torch.manual_seed(seed)
        q, k, v = (t.clone().requires_grad_() for t in base)
        out = fn(q, k, v)
        (out * grad).sum().backward()
        runs[name] = (out.detach(), q.grad, k.grad, v.grad, fn(q, k, v).detach())
    torch._dynamo.reset()
    return runs


def test_under_torch_compile_the_mask_is_the_eager_calls_and_the_reference():
    """kernel(q, k, v, dropout_p=p) traced whole (fullgraph) runs the dropout custom ops: at the
    same torch.manual_seed the compiled call draws the eager call's seed, so its output and
    gradients equal the eager ones bit for bit and the float64 reference's under that seed;
    a second call draws another mask."""
    from dilgen.runtime.dropout_call import draw_seed
    spec = _spec("compiled", **CASES["causal_gqa_r3"])
    kernel = dilgen.compile(spec)
    base = [t.detach() for t in _inputs(spec, 1, 48, "compiled")]
    grad = torch.randn(base[0].shape, generator=torch.Generator().manual_seed(4)).to(base[0])

    def call(q, k, v):
        return kernel(q, k, v, dropout_p=0.3)

    runs = _eager_and_compiled(call, base, grad, 11)
    for mine, eager in zip(runs["compiled"], runs["eager"]):
        assert torch.equal(mine, eager)
    out, dq, dk, dv, second = runs["compiled"]
    assert not torch.equal(out, second)                      # successive calls differ
    torch.manual_seed(11)
    ref_in = [t.double().cpu().requires_grad_() for t in base]
    ref_out, _ = differentiable_reference(*ref_in, spec, dropout_p=0.3, seed=draw_seed())
    (ref_out * grad.double().cpu()).sum().backward()
    tol = TOL[spec.dtype]
    assert rel_error(out, ref_out) < tol
    for mine, ref in zip((dq, dk, dv), ref_in):
        assert rel_error(mine, ref.grad) < 2 * tol


def test_opcheck_the_dropout_ops():
    """Schema, fake implementations, autograd registration and AOT dispatch of the dropout ops
    (a given seed: the op is then a function)."""
    from dilgen.runtime import registry
    spec = _spec("opcheck", **CASES["two_branches"])
    kernel = dilgen.compile(spec)
    q, k, v = (t.detach().requires_grad_() for t in _inputs(spec, 1, 40, "opcheck"))
    key = registry.register(kernel.compiled_for(q.device).attention)
    torch.library.opcheck(torch.ops.dilgen.attention_dropout_fwd.default, (q, k, v, 0.2, 123, key))
    out, lse, seed = torch.ops.dilgen.attention_dropout_fwd(q, k, v, 0.2, 123, key)
    assert seed.tolist() == [123]
    q, k, v, out, lse = (t.detach() for t in (q, k, v, out, lse))
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out)
    for g_lse in (torch.randn(lse.shape, generator=torch.Generator().manual_seed(6)).to(lse), None):
        torch.library.opcheck(torch.ops.dilgen.attention_dropout_bwd.default,
                              (q, k, v, out, lse, g, g_lse, seed, 0.2, key))


def test_packed_rows_under_torch_compile_draw_the_eager_calls_mask():
    """kernel(rows, cu_seqlens=, max_seqlen=, dropout_p=) traced whole: the packed dropout op
    (offsets on the device) at one torch.manual_seed equals the eager packed call bit for bit,
    output and gradients."""
    spec = _spec("compiled_packed", **CASES["causal_gqa_r3"])
    kernel = dilgen.compile(spec)
    base = [t.detach()[0] for t in _inputs(spec, 1, 80, "compiled_packed")]
    cu = torch.tensor([0, 30, 80], dtype=torch.int32, device=base[0].device)
    grad = torch.randn(base[0].shape, generator=torch.Generator().manual_seed(4)).to(base[0])

    def call(q, k, v):
        return kernel(q, k, v, cu_seqlens=cu, max_seqlen=50, dropout_p=0.3)

    runs = _eager_and_compiled(call, base, grad, 12)
    for mine, eager in zip(runs["compiled"], runs["eager"]):
        assert torch.equal(mine, eager)
    plain = kernel(*base, cu_seqlens=cu, max_seqlen=50)
    assert rel_error(runs["compiled"][0], plain) > 1e-2             # the mask mattered
