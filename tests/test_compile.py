"""The generated callable as torch custom ops (dilgen/runtime/op.py, registry.py): opcheck on both ops,
and a small model around a kernel under torch.compile(fullgraph=True) (so no graph
break), checked against eager and against the float64 reference of SPEC §2."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch._dynamo.testing
from torch import nn

import dilgen
from dilgen.reference import differentiable_reference
from dilgen.runtime import registry

from conftest import device

TOL = 2e-4   # float32, relative norm error (tests/test_backward.py GRAD_TOL)


def _spec(name, **kw):
    # GQA (2 query heads, 1 kv head); branch r = 1 keeps every row, so lse is finite
    fields = dict(num_heads=2, num_kv_heads=1, head_dim=16, dtype="float32",
                  segment_lengths=[8, 16], dilation_rates=[1, 2])
    fields.update(kw)
    return dilgen.Spec(name=name, **fields)


def _attention(spec):
    """The GeneratedAttention of `spec` for this machine's device."""
    return dilgen.compile(spec).compiled_for(device()).attention


def _data(spec, n, seed, batch=1):
    gen = torch.Generator().manual_seed(seed)
    H, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    shapes = dict(x=(batch, n, H, D), k=(batch, n, Hkv, D), v=(batch, n, Hkv, D),
                  g_out=(batch, n, H, D), g_lse=(batch, H, n))
    return {name: torch.randn(s, generator=gen).to(device()) for name, s in shapes.items()}


def rel_error(got, ref) -> float:
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-300)).item()


class TinyModel(nn.Module):
    """q = Linear(x) on head_dim, then dilated attention; returns (out, lse)."""

    def __init__(self, attention, head_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(head_dim, head_dim)
        self.attention = attention

    def forward(self, x, k, v):
        return self.attention(self.proj(x), k, v, return_lse=True)


def _model(attention, spec, seed=0):
    torch.manual_seed(seed)
    return TinyModel(attention, spec.head_dim).to(device())


def _run(fn, model, data):
    """(out, lse, [dx, dk, dv, dW, db]) of <out, g_out> + <lse, g_lse>."""
    model.zero_grad(set_to_none=True)
    x, k, v = (data[n].clone().requires_grad_(True) for n in ("x", "k", "v"))
    out, lse = fn(x, k, v)
    ((out * data["g_out"]).sum() + (lse * data["g_lse"]).sum()).backward()
    return out.detach(), lse.detach(), [x.grad, k.grad, v.grad, model.proj.weight.grad,
                                        model.proj.bias.grad]


def _reference(spec, model, data):
    """The same loss through the float64 differentiable reference."""
    x, k, v = (data[n].double().cpu().requires_grad_(True) for n in ("x", "k", "v"))
    w, b = (p.detach().double().cpu().requires_grad_(True)
            for p in (model.proj.weight, model.proj.bias))
    out, lse = differentiable_reference(nn.functional.linear(x, w, b), k, v, spec)
    ((out * data["g_out"].double().cpu()).sum() + (lse * data["g_lse"].double().cpu()).sum()).backward()
    return out.detach(), lse.detach(), [x.grad, k.grad, v.grad, w.grad, b.grad]


def _check_close(got, want, tol, what):
    out, lse, grads = got
    ref_out, ref_lse, ref_grads = want
    assert rel_error(out, ref_out) < tol, f"{what}: out"
    assert rel_error(lse, ref_lse) < tol, f"{what}: lse"
    for label, g, r in zip(("x", "k", "v", "proj.weight", "proj.bias"), grads, ref_grads):
        assert g is not None and g.shape == r.shape, f"{what}: d{label} missing"
        assert rel_error(g, r) < tol, f"{what}: d{label}: {rel_error(g, r):.2e}"


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_opcheck_forward_and_backward_ops():
    """Schema, fake (meta) implementations, autograd registration, AOT dispatch."""
    spec = _spec("tc_opcheck")
    attn = _attention(spec)
    key = registry.register(attn)
    d = _data(spec, 24, seed=1)                     # N = 24: a short last segment
    q, k, v = (d[n].clone().requires_grad_(True) for n in ("x", "k", "v"))
    torch.library.opcheck(torch.ops.dilgen.attention_fwd.default, (q, k, v, key))
    with torch.no_grad():
        out, lse = attn(q, k, v, return_lse=True)
    q, k, v = q.detach(), k.detach(), v.detach()
    for grad_lse in (d["g_lse"], None):
        torch.library.opcheck(torch.ops.dilgen.attention_bwd.default,
                              (q, k, v, out, lse, d["g_out"], grad_lse, key))


def test_eager_calls_register_and_run_the_ops_work(monkeypatch):
    """An eager call registers its module (a graph compiled later finds it) and runs the op's
    forward and backward as an autograd.Function, without the op's dispatch (op.py)."""
    spec = _spec("tc_eager")
    attn = _attention(spec)
    monkeypatch.setattr(registry, "_REGISTRY", {})
    d = _data(spec, 16, seed=2)
    with torch.no_grad():
        attn(d["x"], d["k"], d["v"])
    assert registry._REGISTRY == {registry.op_key(attn): attn}
    out = attn(d["x"].requires_grad_(True), d["k"], d["v"])
    assert type(out.grad_fn).__name__ == "_DilgenAttentionBackward"


def test_fullgraph_aot_eager_matches_eager_and_reference(monkeypatch, fresh_dynamo):
    """One graph (fullgraph=True raises on a break; the counter sees one frame), compiled
    before any eager call (an empty registry: the op finds the kernel by its key);
    outputs and gradients equal eager, and match the float64 reference; then a second
    sequence length recompiles once, with a dynamic N (symbolic shapes in the fakes)."""
    spec = _spec("tc_aot")
    attn = _attention(spec)
    monkeypatch.setattr(registry, "_REGISTRY", {})
    model = _model(attn, spec)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    data = _data(spec, 32, seed=3)

    got = _run(compiled, model, data)
    assert counter.frame_count == 1
    eager = _run(model, model, data)
    torch.testing.assert_close(got[:2], eager[:2])
    torch.testing.assert_close(got[2], eager[2])
    _check_close(got, _reference(spec, model, data), TOL, "aot_eager vs reference")

    data = _data(spec, 40, seed=4)
    got = _run(compiled, model, data)
    assert counter.frame_count == 2
    _check_close(got, _reference(spec, model, data), TOL, "aot_eager, N = 40")


def _cxx_compiler():
    names = [os.environ.get("CXX")] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    return next((shutil.which(n) for n in names if shutil.which(n)), None)


@pytest.mark.skipif(device().type == "cpu" and _cxx_compiler() is None,
                    reason="inductor on CPU needs a C++ compiler (g++, c++, clang++ or $CXX); none found")
def test_fullgraph_inductor(fresh_dynamo):
    """Inductor around the op (on CPU it compiles C++: slow on a cold inductor cache)."""
    spec = _spec("tc_inductor")
    model = _model(_attention(spec), spec, seed=5)
    data = _data(spec, 32, seed=6)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    got = _run(torch.compile(model, backend=counter, fullgraph=True), model, data)
    assert counter.frame_count == 1
    eager = _run(model, model, data)
    _check_close(got, eager, 1e-4, "inductor vs eager")   # a fused Linear may round differently
    _check_close(got, _reference(spec, model, data), TOL, "inductor vs reference")


def test_kernel_from_dilgen_compile_under_fullgraph(fresh_dynamo):
    spec = _spec("tc_kernel")
    model = _model(dilgen.compile(spec), spec, seed=7)
    data = _data(spec, 16, seed=8)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    got = _run(torch.compile(model, backend=counter, fullgraph=True), model, data)
    assert counter.frame_count == 1
    _check_close(got, _reference(spec, model, data), TOL, "Kernel under aot_eager")


def _one_call(spec):
    """`dilgen.dilated_attention(..., spec)` as the attention of TinyModel."""
    return lambda q, k, v, return_lse=False: dilgen.dilated_attention(q, k, v, spec,
                                                                       return_lse=return_lse)


def test_one_call_form_under_fullgraph(fresh_dynamo):
    """dilgen.dilated_attention traces as one graph, before any eager call of the spec
    (its kernel is made while tracing, outside the graph), with gradients; the same spec
    object does not retrace, a different one does, and stays right."""
    from dilgen import compiler
    spec = _spec("tc_one_call")
    assert spec.key() not in compiler._KERNELS            # cold: nothing made eagerly yet
    model = _model(_one_call(spec), spec, seed=9)
    data = _data(spec, 24, seed=10)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    got = _run(compiled, model, data)
    assert counter.frame_count == 1
    _check_close(got, _reference(spec, model, data), TOL, "dilated_attention under aot_eager")
    _run(compiled, model, data)
    assert counter.frame_count == 1                       # same spec object: no retrace

    other = _spec("tc_one_call", causal=True)
    model.attention = _one_call(other)
    got = _run(compiled, model, data)
    assert counter.frame_count == 2
    _check_close(got, _reference(other, model, data), TOL, "another spec")


def test_constant_key_carries_the_mark_torch_would_set():
    """registry.constant_key is marked as torch.compiler.assume_constant_result marks a
    function (without importing dynamo when dilgen is imported): the decorator sets exactly
    that attribute, and nothing else, in this torch."""
    def probe(make_key, obj):
        return make_key(obj)
    before = set(vars(probe))
    assert torch.compiler.assume_constant_result(probe) is probe
    assert set(vars(probe)) - before == {registry.CONSTANT_MARK}
    assert getattr(registry.constant_key, registry.CONSTANT_MARK) is getattr(probe, registry.CONSTANT_MARK)


def test_importing_dilgen_leaves_dynamo_unimported():
    """Importing dilgen (and its runtime) does not import torch._dynamo (2.4 s a process)."""
    import subprocess
    import sys
    code = "import sys, dilgen, dilgen.runtime; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_one_call_form_is_the_custom_op(fresh_dynamo):
    """In the traced graph the one-call form is dilgen::attention_fwd (eagerly, its work)."""
    spec = _spec("tc_one_call_op")
    d = _data(spec, 16, seed=11)
    q = d["x"].clone().requires_grad_(True)
    out = dilgen.dilated_attention(q, d["k"], d["v"], spec)
    assert type(out.grad_fn).__name__ == "_DilgenAttentionBackward"

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda q, k, v: dilgen.dilated_attention(q, k, v, spec, return_lse=True),
                       backend=record, fullgraph=True)
    got, lse = fn(d["x"], d["k"], d["v"])
    want, want_lse = dilgen.dilated_attention(d["x"], d["k"], d["v"], spec, return_lse=True)
    assert torch.equal(got, want) and torch.equal(lse, want_lse)
    (gm,) = graphs
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.dilgen.attention_fwd.default in targets, gm.graph


def test_nn_layer_under_fullgraph(fresh_dynamo):
    from conftest import device
    from dilgen.nn import MultiheadDilatedAttention
    torch.manual_seed(3)
    layer = MultiheadDilatedAttention(32, 2, segment_lengths=[8, 16], dilation_rates=[1, 2],
                                      dtype=torch.float32, device=device())
    x = torch.randn(1, 16, 32, device=device())
    first = lambda y: y[0] if isinstance(y, tuple) else y  # noqa: E731  (out, weights) like nn.MHA
    eager = first(layer(x))
    compiled = first(torch.compile(layer, backend="aot_eager", fullgraph=True)(x))
    assert torch.allclose(compiled, eager, atol=1e-5)


@pytest.mark.parametrize("cu, what", [([0, 40, 90], "past the rows"), ([0, -30, 64], "negative"),
                                      ([0, 2**31 - 1, 64], "huge"), ([0, 20, 50], "short of the rows"),
                                      ([0, 40, 30, 64], "unsorted"), ([5, 30, 64], "not from 0"),
                                      ([0, 50, 64], "longer than max_seqlen")])
def test_traced_packed_offsets_are_checked_on_the_device(fresh_dynamo, cu, what):
    """Issue 44: under torch.compile the offsets are not read on the host; bad ones fail a
    device-side assert, and the kernels never read past the rows (a segfault before)."""
    spec = dilgen.Spec(name="traced_cu", num_heads=2, head_dim=16, dtype="float32",
                       segment_lengths=[8, 16], dilation_rates=[1, 2])
    kernel = dilgen.compile(spec)
    q, k, v = (torch.randn(64, 2, 16) for _ in range(3))
    fn = torch.compile(lambda a, b, c, o: kernel(a, b, c, cu_seqlens=o, max_seqlen=40),
                       backend="aot_eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="cu_seqlens must be non-decreasing offsets"):
        fn(q, k, v, torch.tensor(cu, dtype=torch.int32))
    good = fn(q, k, v, torch.tensor([0, 24, 64], dtype=torch.int32))
    assert torch.equal(good, kernel(q, k, v, cu_seqlens=torch.tensor([0, 24, 64], dtype=torch.int32)))
