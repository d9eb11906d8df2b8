"""The host path of a call (dilgen/runtime/op.py, replay.py).

Eager calls run the custom ops' work as an autograd.Function: the same numbers, the same
gradients and the same refusals as the op, which still runs under a dispatch mode (fake
tensors) and under torch.compile (tests/test_compile.py). On a GPU a call whose signature
was seen launches the recorded kernels again (replay.py); here the recording and the
replay run against stand-in kernels; on the GPU `bench/bench_forward.py --host` compares
replayed calls (and CUDA-graph replays) with fresh ones, bit for bit, poisoned outputs."""
from __future__ import annotations

import inspect

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import dilgen
from dilgen.runtime import launch, op, replay
from dilgen.runtime.dropout_call import dropout_twin

from conftest import device


def _kernel(**kw):
    fields = dict(name="host_path", num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32",
                  segment_lengths=[8, 16], dilation_rates=[1, 2])
    fields.update(kw)
    return dilgen.compile(dilgen.Spec(**fields))


def _qkv(shape, kv_heads, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(shape, generator=gen)
    kv = shape[:-2] + (kv_heads, shape[-1])
    k, v = torch.randn(kv, generator=gen), torch.randn(kv, generator=gen)
    return [t.to(device()).requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize("packed", [False, True], ids=["fixed", "packed"])
@pytest.mark.parametrize("causal", [False, True])
def test_eager_call_equals_the_op(packed, causal):
    """Outputs, lse and gradients of an eager call are those of the custom op, bit for bit."""
    kernel = _kernel(causal=causal)
    attn = kernel.compiled_for(device()).attention
    shape = (40, 4, 16) if packed else (2, 24, 4, 16)
    q, k, v = _qkv(shape, 2, seed=3 + causal)
    gen = torch.Generator().manual_seed(9)
    g_out = torch.randn(shape, generator=gen).to(device())
    if packed:
        from dilgen.runtime.varlen import packing_from_cu_seqlens
        cu = torch.tensor([0, 7, 7, 40], dtype=torch.int32, device=device())
        packing = packing_from_cu_seqlens(attn.spec["name"], cu, 40, q.device, None)
        eager = lambda: op.varlen_attention_op(attn, q, k, v, packing)
        flat = [x for b in packing.buckets for x in b]
        via_op = lambda: op.attention_varlen_fwd(q, k, v, packing.starts, packing.lengths, packing.max_len,
                                                 packing.covers_all, flat, op.op_key(attn))
    else:
        eager = lambda: op.attention_op(attn, q, k, v)
        via_op = lambda: op.attention_fwd(q, k, v, op.op_key(attn))
    results = []
    for call in (eager, via_op):
        out, lse = call()
        g_lse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(5)).to(device())
        finite = torch.isfinite(lse)
        loss = (out * g_out).sum() + torch.where(finite, lse * g_lse, torch.zeros_like(lse)).sum()
        grads = torch.autograd.grad(loss, (q, k, v))
        results.append((out, lse, *grads))
    assert type(eager()[0].grad_fn).__name__.startswith("_Dilgen")
    for got, want in zip(*results):
        assert torch.equal(got, want)


def test_a_dispatch_mode_gets_the_op():
    """Fake tensors (a dispatch mode) run the op's fake implementation: shapes, no launch."""
    kernel = _kernel()
    attn = kernel.compiled_for(torch.device("cpu")).attention
    before = attn.launches
    with FakeTensorMode():
        q = torch.empty(2, 24, 4, 16)
        k = torch.empty(2, 24, 2, 16)
        out, lse = attn(q, k, k, return_lse=True)
    assert out.shape == (2, 24, 4, 16) and lse.shape == (2, 4, 24)
    assert attn.launches == before


# -- replay.py against stand-in kernels ------------------------------------------------------
class _Compiled:
    """A compiled kernel's launch interface (triton.compiler.CompiledKernel)."""

    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.launched = []

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, g0, g1, g2, stream, function, packed_metadata, meta, enter, leave, *args):
        self.launched.append(((g0, g1, g2), stream, args))


class _Jit:
    """A jitted kernel: `kernel[grid](*args, **options)` compiles once and returns it."""

    def __init__(self, names, defaults):
        self.params = [type("P", (), {"default": defaults.get(n, inspect.Parameter.empty)})
                       for n in names]
        self.compiled = _Compiled()
        self.calls = []

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.calls.append((grid, args, options))
            self.compiled.run(*grid, *(1,) * (3 - len(grid)), "s0", None, None, None, None, None, *args)
            return self.compiled
        return launch


class _Module:
    def __init__(self, tables):
        self._device_tensors = {("tables",): (tables[0], [tables[1]])}
        self._replays = {}


@pytest.fixture
def gpu_calls(monkeypatch):
    monkeypatch.setattr(replay, "_device", lambda: 0)
    monkeypatch.setattr(replay, "_stream", lambda dev: "s1")


def test_replay_puts_a_calls_tensors_in_the_recorded_slots(gpu_calls):
    tables = [torch.arange(4), torch.arange(6)]
    module = _Module(tables)
    jit = _Jit(["Q", "T", "N", "O", "FLAG", "BLOCK"], {"BLOCK": 64})
    q, out = torch.randn(3), torch.empty(3)
    rec = replay.Recorder()
    rec.launch(jit, (5, 2), (q, tables[1], 17, out, True), {"num_warps": 4})
    recipe = rec.recipe((q, out), module)
    assert recipe is not None and jit.calls[0][2] == {"num_warps": 4}
    q2, out2 = torch.randn(3), torch.empty(3)
    recipe.run((q2, out2))
    grid, stream, args = jit.compiled.launched[-1]
    assert grid == (5, 2, 1) and stream == "s1"
    assert args[0] is q2 and args[1] is tables[1] and args[2:3] == (17,) and args[3] is out2
    assert args[4:] == (True, 64)          # the defaults JITFunction.run would bind


def test_a_launch_reading_a_per_call_tensor_is_not_replayed(gpu_calls):
    """A tensor neither a slot nor a kept table (a copy made for this call) would be stale
    in a replay: the recording is dropped and such calls take the full path."""
    tables = [torch.arange(4), torch.arange(6)]
    jit = _Jit(["Q", "C", "O"], {})
    q, out = torch.randn(3), torch.empty(3)
    rec = replay.Recorder()
    rec.launch(jit, (1,), (q, q.clone(), out), {})
    assert rec.recipe((q, out), _Module(tables)) is None


def test_a_temporary_is_allocated_afresh_by_each_replay(gpu_calls):
    """A tensor the call allocates for its own launches to write and read (a Hilbert branch's
    curve-ordered copies) is a hole that each replay fills with a fresh tensor of its shape
    and dtype; the recorded one is not kept."""
    writer, reader = _Jit(["X", "TMP"], {}), _Jit(["TMP", "O"], {})
    q, out, tmp = torch.randn(3), torch.empty(3), torch.empty(2, 5, dtype=torch.float16)
    rec = replay.Recorder()
    with replay.recording_into(rec):
        assert replay.recording() is rec
        rec.launch(writer, (1,), (q, tmp), {})
        rec.temporary(tmp)
    assert replay.recording() is None
    rec.launch(reader, (1,), (tmp, out), {})
    recipe = rec.recipe((q, out), _Module([torch.arange(1), torch.arange(1)]))
    assert recipe.temporaries == (((2, 5), torch.float16),)
    q2, out2 = torch.randn(3), torch.empty(3)
    recipe.run((q2, out2))
    (_, _, wrote), (_, _, read) = writer.compiled.launched[-1], reader.compiled.launched[-1]
    assert wrote[0] is q2 and read[1] is out2
    assert wrote[1] is read[0]                  # the writer's fresh tensor is the reader's
    assert wrote[1] is not tmp and wrote[1].shape == (2, 5) and wrote[1].dtype == torch.float16


def test_signature_separates_what_specialization_reads(gpu_calls):
    x = torch.zeros(64)
    base = replay.signature("fwd", (x[:32],))
    assert replay.signature("fwd", (x[:32],)) == base
    assert replay.signature("fwd", (x[1:33],)) != base                  # alignment
    assert replay.signature("fwd", (x[:32].double(),)) != base          # dtype
    assert replay.signature("fwd", (x[:64:2],)) != base                 # stride
    assert replay.signature("bwd", (x[:32],)) != base                   # pass
    assert replay.signature("fwd", (x[:32],), True) != base             # extra flags
    q, k = torch.zeros(8), torch.zeros(8)
    # a call of one tensor in two places records one slot for both: a call of two may not replay it
    assert replay.signature("fwd", (q, q)) != replay.signature("fwd", (q, k))
    assert replay.signature("fwd", (q, q.view(8))) == replay.signature("fwd", (k, k))


def test_recipes_are_bounded(gpu_calls):
    module = _Module([torch.arange(1), torch.arange(1)])
    for i in range(replay._MAX_RECIPES + 3):
        replay.keep(module, ("k", i), replay.Recipe([], False))
    assert len(module._replays) <= replay._MAX_RECIPES


class _Launcher36:
    """Triton 3.6's CudaLauncher as launch.direct reads it: __call__ over a C `launch`."""

    global_scratch_size, profile_scratch_size, num_ctas = 8, 0, 1
    launch_cooperative_grid, launch_pdl = False, False

    def __init__(self):
        self.through_call, self.raw = [], []

    def launch(self, *args):
        self.raw.append(args)

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.through_call.append(((gridX, gridY, gridZ), stream, args))


@pytest.fixture
def scratch(monkeypatch):
    """Scratch buffers on the CPU, one per stream as launch._scratch keeps them."""
    kept = {}
    monkeypatch.setattr(launch, "_scratch", lambda n, stream, overlapping: kept.setdefault(stream, torch.empty(n, dtype=torch.int8)))
    return kept


def test_a_replay_goes_through_the_c_launch_with_pointers(gpu_calls, scratch, monkeypatch):
    """Through a launcher of Triton 3.6's shape a replay calls its C launch: the call's
    tensors and the kept tables as pointers, the grid's scratch, the defaults; with a launch
    hook set (a profiler) it goes through the launcher, which calls the hook."""
    tables = [torch.arange(4), torch.arange(6)]
    jit = _Jit(["Q", "T", "N", "O", "FLAG", "BLOCK"], {"BLOCK": 64})
    jit.compiled.run = _Launcher36()
    q, out = torch.randn(3), torch.empty(3)
    rec = replay.Recorder()
    rec.launch(jit, (5, 2), (q, tables[1], 17, out, True), {"num_warps": 4})
    recipe = rec.recipe((q, out), _Module(tables))
    assert recipe.direct is not None
    q2, out2 = torch.randn(3), torch.empty(3)
    recipe.run((q2, out2))
    (raw,) = jit.compiled.run.raw
    assert raw[:5] == (5, 2, 1, "s1", "fn") and raw[5:7] == (False, False)
    assert raw[7] == scratch["s1"].data_ptr() and scratch["s1"].numel() == 5 * 2 * 8
    assert raw[8:13] == (None, "meta", None, None, None)
    assert raw[13:] == (q2.data_ptr(), tables[1].data_ptr(), 17, out2.data_ptr(), True, 64)
    from triton import knobs
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda meta: None)   # not a HookChain: set
    recipe.run((q2, out2))
    assert len(jit.compiled.run.raw) == 1
    grid, stream, args = jit.compiled.run.through_call[-1]
    assert grid == (5, 2, 1) and args[4] is q2 and args[7] is out2     # after metadata and hooks


def test_only_a_launcher_of_that_shape_is_called_directly():
    """A launcher of another shape (another Triton), or one that profiles, keeps its own
    call: launch.direct gives None."""
    compiled = _Compiled()
    assert launch.direct(compiled) is None
    profiling = _Launcher36()
    profiling.profile_scratch_size = 64
    compiled.run = profiling
    compiled._dilgen_direct = None
    assert launch.direct(compiled) is None
    compiled.run, compiled._dilgen_direct = _Launcher36(), None
    assert isinstance(launch.direct(compiled), launch.Direct)


@pytest.fixture
def poisoned():
    """Fresh outputs NaN-filled before each launch, so an unwritten row shows."""
    from dilgen.runtime import set_poison
    set_poison(True)
    yield
    set_poison(False)


def _replay_equals_plain(kernel, plain, call, shape, step, seed):
    """call(module, q, k, v) -> (out, lse) on fresh inputs of `shape` through `kernel`
    (replays on) and `plain` (replays off): out, lse and the gradients equal bit for bit."""
    q, k, v = _qkv(shape, 2, seed=seed)
    g_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(step)).to(device())
    results = []
    for module in (kernel, plain):
        replay.ENABLED = module is kernel
        try:
            out, lse = call(module, q, k, v)
            results.append((out, lse, *torch.autograd.grad(out, (q, k, v), g_out)))
        finally:
            replay.ENABLED = True
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.equal(a, b), (step, name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="replays run on CUDA only (GPU check)")
@pytest.mark.parametrize("return_lse", [False, True])
def test_a_replayed_decode_step_equals_a_fresh_one(return_lse, poisoned):
    """Decode steps of one signature replay the first one's launches (replay.py): new cache
    contents and lengths give the bits of a module that never replays, poisoned outputs."""
    spec = dict(causal=True, dtype="bfloat16", segment_lengths=[16, 64], dilation_rates=[1, 4])
    kernel, plain = _kernel(name="host_dec", **spec), _kernel(name="host_dec_plain", **spec)
    gen = torch.Generator(device()).manual_seed(11)
    make = lambda *shape: torch.randn(*shape, generator=gen, device=device(), dtype=torch.bfloat16)  # noqa: E731
    for step, lens in enumerate(([70, 33], [71, 100], [5, 128])):
        q, kc, vc = make(2, 1, 4, 16), make(2, 128, 2, 16), make(2, 128, 2, 16)
        n = torch.tensor(lens, dtype=torch.int32, device=device())
        with torch.no_grad():
            got = kernel.decode(q, kc, vc, n, return_lse=return_lse)
            replay.ENABLED = False
            try:
                want = plain.decode(q, kc, vc, n, return_lse=return_lse)
            finally:
                replay.ENABLED = True
        for a, b in zip(got if return_lse else [got], want if return_lse else [want]):
            assert torch.equal(a, b), step
    attn = kernel.compiled_for(device()).attention
    assert any(k[0] == "decode" and hasattr(r, "launches") for k, r in attn._replays.items())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="replays run on CUDA only (GPU check)")
@pytest.mark.parametrize("causal", [False, True])
def test_a_replayed_packed_call_equals_a_fresh_one(causal, poisoned):
    """Packed calls of one layout (launch groups) replay the first one's forward and backward
    launches with their own sequences: new values and offsets give the bits of a module that
    never replays, gradients included, poisoned outputs."""
    kernel, plain = _kernel(name="host_vl", causal=causal), _kernel(name="host_vl_plain", causal=causal)
    for step, lens in enumerate(([9, 30, 1], [30, 1, 9], [1, 9, 30])):   # one layout, new offsets
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device())
        _replay_equals_plain(kernel, plain, lambda m, *qkv: m(*qkv, cu_seqlens=cu, return_lse=True),
                             (40, 4, 16), step, seed=20 + step)
    attn = kernel.compiled_for(device()).attention
    assert {k[0] for k, r in attn._replays.items() if hasattr(r, "launches")} >= {"vfwd", "vbwd"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="replays run on CUDA only (GPU check)")
@pytest.mark.parametrize("causal", [False, True])
def test_a_replayed_hilbert_call_equals_a_fresh_one(causal, poisoned):
    """Hilbert segment branches read curve-ordered copies made per call: a replay makes them
    afresh (replay.Recorder.temporary), and forward and backward give the bits of a module
    that never replays, poisoned outputs."""
    fields = dict(causal=causal, segment_lengths=[16, 64], dilation_rates=[1, 4], hilbert={"scope": "segment"})
    kernel, plain = _kernel(name="host_hb", **fields), _kernel(name="host_hb_plain", **fields)
    for step in range(3):
        _replay_equals_plain(kernel, plain, lambda m, *qkv: m(*qkv, return_lse=True),
                             (2, 128, 4, 16), step, seed=40 + step)
    attn = kernel.compiled_for(device()).attention
    kinds = {k[0] for k, r in attn._replays.items() if hasattr(r, "launches")}
    assert kinds >= {"fwd", "bwd"}, kinds


DROPOUT_CASES = {"tl": {}, "tl_causal": dict(causal=True), "hilbert": dict(hilbert={"scope": "segment"}, segment_lengths=[16, 64], dilation_rates=[1, 4]),
                 "gluon": dict(head_dim=64, dtype="bfloat16", segment_lengths=[512, 1024], dilation_rates=[1, 2]),
                 "gluon_causal": dict(head_dim=64, dtype="bfloat16", segment_lengths=[512, 1024],
                                      dilation_rates=[1, 2], causal=True)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="replays run on CUDA only (GPU check)")
@pytest.mark.parametrize("how", [*DROPOUT_CASES, "packed"])
def test_a_replayed_dropout_call_equals_a_fresh_one(how, poisoned):
    """Dropout calls of one signature and p replay the first one's launches, the seed a slot:
    each step's seed (torch.manual_seed) gives the bits of a module that never replays, out,
    lse and gradients; successive seeds give other masks."""
    fields = DROPOUT_CASES.get(how, dict(segment_lengths=[16, 64], dilation_rates=[1, 4]))
    kernel, plain = _kernel(name=f"host_drop_{how}", **fields), _kernel(name=f"host_drop_{how}_plain", **fields)
    n = 2048 if how.startswith("gluon") else 128
    cu = torch.tensor([0, 9, 9, 40], dtype=torch.int32, device=device())
    shape, dtype = ((40, 4, 16) if how == "packed" else (2, n, 4, fields.get("head_dim", 16))), fields.get("dtype")
    outs = []
    for step in range(3):
        def call(module, q, k, v, step=step):
            torch.manual_seed(100 + step)
            qkv = [t.to(torch.bfloat16) if dtype else t for t in (q, k, v)]
            extra = dict(cu_seqlens=cu) if how == "packed" else {}
            return module(*qkv, dropout_p=0.3, return_lse=True, **extra)
        _replay_equals_plain(kernel, plain, call, shape, step, seed=70 + step)
        outs.append(call(kernel, *_qkv(shape, 2, seed=70))[0])
    assert not torch.equal(outs[0], outs[1])          # a new seed, a new mask
    drop = dropout_twin(kernel.compiled_for(device()).attention, device())
    kinds = {k[0] for k, r in drop._replays.items() if hasattr(r, "launches")}
    assert kinds >= ({"vfwd", "vbwd"} if how == "packed" else {"fwd", "bwd"}), kinds


@pytest.mark.skipif(not torch.cuda.is_available(), reason="replays run on CUDA only (GPU check)")
def test_a_call_of_one_tensor_thrice_is_not_replayed_for_three(poisoned):
    """kernel(x, x, x) records one slot for q, k and v; a later kernel(q, k, v) of the same
    shapes must not replay it (it would read x's slot three times)."""
    kernel, plain = _kernel(name="host_alias", num_kv_heads=4), _kernel(name="host_alias_plain", num_kv_heads=4)
    x = _qkv((2, 32, 4, 16), 4, seed=60)[0].detach()
    with torch.no_grad():
        kernel(x, x, x)
        q, k, v = (t.detach() for t in _qkv((2, 32, 4, 16), 4, seed=61))
        replay.ENABLED = False
        try:
            want = plain(q, k, v)
        finally:
            replay.ENABLED = True
        assert torch.equal(kernel(q, k, v), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs (GPU check)")
@pytest.mark.parametrize("how", ["packed", "padded", "hilbert"])
def test_packed_padded_and_hilbert_calls_capture_in_a_cuda_graph(how):
    """Forward + backward of a packed call (offsets on the GPU), a padded call and a Hilbert
    call, captured in a CUDA graph after a warm-up (which reads the offsets or the mask once),
    replay to the bits of the eager call."""
    fields = dict(hilbert={"scope": "segment"}, segment_lengths=[16, 64], dilation_rates=[1, 4]) \
        if how == "hilbert" else {}
    kernel = _kernel(name=f"host_graph_{how}", causal=True, **fields)
    shape = (40, 4, 16) if how == "packed" else (2, 64, 4, 16)
    cu = torch.tensor([0, 9, 9, 40], dtype=torch.int32, device=device())
    mask = torch.arange(64, device=device())[None, :] >= torch.tensor([64, 23], device=device())[:, None]
    call = {"packed": lambda q, k, v: kernel(q, k, v, cu_seqlens=cu),
            "padded": lambda q, k, v: kernel.padded(q, k, v, mask),
            "hilbert": lambda q, k, v: kernel(q, k, v)}[how]
    g_out = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(device())

    def step(leaves):
        out = call(*leaves)
        return (out, *torch.autograd.grad(out, leaves, g_out))
    eager = step(_qkv(shape, 2, seed=50))
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):     # leaves and a warm-up off the default stream
        leaves = [t.detach().requires_grad_() for t in _qkv(shape, 2, seed=50)]
        step(leaves)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured = step(leaves)
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(("out", "dq", "dk", "dv"), eager, captured):
        assert torch.equal(a, b), name
