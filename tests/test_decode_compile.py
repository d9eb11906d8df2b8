"""Decoding under torch.compile(fullgraph=True): `Kernel.decode` (and a GeneratedAttention's)
traces as torch.ops.dilgen.decode, with the lengths checked on the device, and equals the
eager call bit for bit; transformers' static-cache generation with a compiled forward equals
eager generation. CPU, Triton's interpreter, aot_eager."""
from __future__ import annotations

import pytest
import torch

import dilgen

H, HKV, D, NMAX = 4, 2, 16, 40


def _kernel():
    return dilgen.compile(dilgen.Spec(name="decode_compile", num_heads=H, num_kv_heads=HKV, head_dim=D,
                                      dtype="float32", segment_lengths=[8, 16], dilation_rates=[1, 2],
                                      causal=True))


def _inputs(T, lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    B = len(lengths)
    q = torch.randn(B, T, H, D, generator=gen)
    k, v = (torch.randn(B, NMAX, HKV, D, generator=gen) for _ in range(2))
    return q, k, v, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("through", ["kernel", "module"])
def test_fullgraph_decode_equals_eager(T, through):
    kernel = _kernel()
    target = kernel if through == "kernel" else kernel.compiled_for(torch.device("cpu")).attention
    q, k, v, lengths = _inputs(T, [17, NMAX])
    want = target.decode(q, k, v, lengths, return_lse=True)
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    fn = torch.compile(lambda *a: target.decode(*a, return_lse=True), fullgraph=True, backend=backend)
    got = fn(q, k, v, lengths)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.dilgen.decode.default in targets


def test_traced_lengths_are_checked_when_the_graph_runs():
    kernel = _kernel()
    q, k, v, _ = _inputs(2, [17, NMAX])
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: kernel.decode(*a), fullgraph=True, backend="aot_eager")
    fn(q, k, v, torch.tensor([17, NMAX], dtype=torch.int32))
    for bad in ([1, NMAX], [17, NMAX + 1]):         # below T = 2; past the cache's rows
        with pytest.raises(RuntimeError, match=r"must lie in \[T, N_max\] = \[2, 40\]"):
            fn(q, k, v, torch.tensor(bad, dtype=torch.int32))


def test_a_spec_that_cannot_decode_is_refused_when_the_graph_runs():
    kernel = dilgen.compile(dilgen.Spec(name="decode_compile_full", num_heads=H, num_kv_heads=HKV, head_dim=D,
                                        dtype="float32", segment_lengths=[8, 16], dilation_rates=[1, 2]))
    q, k, v, lengths = _inputs(1, [17, NMAX])
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: kernel.decode(*a), fullgraph=True, backend="aot_eager")
    with pytest.raises(dilgen.InputError, match="causal"):
        fn(q, k, v, lengths)


def test_static_cache_generation_with_a_compiled_forward_equals_eager():
    pytest.importorskip("transformers")
    import dilgen.integrations.transformers  # noqa: F401  (registers "dilgen")
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                         intermediate_size=128, vocab_size=100)
    config.dilgen_spec = {"segment_lengths": [8, 16], "dilation_rates": [1, 2]}
    model = AutoModelForCausalLM.from_config(config, attn_implementation="dilgen").eval()
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(3))
    steps = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    want = model.generate(ids, **steps)
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    got = model.generate(ids, cache_implementation="static", disable_compile=True, **steps)
    assert torch.equal(got, want)
