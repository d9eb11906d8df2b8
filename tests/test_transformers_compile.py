"""attn_implementation="dilgen" under torch.compile(fullgraph=True) (issue 40): a training
step (forward and backward) traces as one graph, with no mask, an all-ones mask or a padded
batch (left and right), with or without attention dropout, and equals the eager model; what a traced call cannot read on the
host (position_ids that restart inside a row, a mask with holes) fails when the graph runs,
with the message that says what to pass instead. CPU, Triton's interpreter, aot_eager."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
import dilgen.integrations.transformers  # noqa: E402,F401  (registers "dilgen")
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

B, T, VOCAB = 2, 32, 100


def _model(dropout: float = 0.0):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, intermediate_size=128, vocab_size=VOCAB,
                         attention_dropout=dropout)
    config.dilgen_spec = {"segment_lengths": [8, 16], "dilation_rates": [1, 2]}
    return AutoModelForCausalLM.from_config(config, attn_implementation="dilgen")


def _step(model, ids, **kwargs):
    """Logits, and the gradient of a fixed function of them for every parameter (attention
    dropout's seed drawn after torch.manual_seed(5))."""
    model.zero_grad()
    torch.manual_seed(5)
    logits = model(ids, **kwargs).logits
    (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mask, dropout", [("none", 0.0), ("ones", 0.0), ("padded", 0.0), ("none", 0.2),
                                           ("ones", 0.2), ("padded", 0.2)])
def test_fullgraph_training_step_equals_eager(mask, dropout):
    """With attention dropout too: at one torch.manual_seed the traced step draws the eager
    step's mask (an all-ones mask traced as packed rows draws the rows b T + t as eagerly)."""
    model = _model(dropout)
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))
    kwargs = {}
    if mask == "ones":
        kwargs["attention_mask"] = torch.ones(B, T, dtype=torch.long)
    if mask == "padded":                 # row 0 right-padded by 5, row 1 left-padded by 9
        pad = torch.ones(B, T, dtype=torch.long)
        pad[0, -5:] = 0
        pad[1, :9] = 0
        kwargs["attention_mask"] = pad
    want_logits, want_grads = _step(model, ids, **kwargs)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got_logits, got_grads = _step(compiled, ids, **kwargs)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["packed_position_ids", "mask_with_holes"])
def test_what_a_traced_call_cannot_read_fails_when_the_graph_runs(case):
    model = _model()
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(2))
    if case == "packed_position_ids":    # two documents per row, no mask
        kwargs = {"position_ids": torch.cat([torch.arange(12), torch.arange(T - 12)]).repeat(B, 1)}
        says = "cu_seq_lens_q"
    else:
        mask = torch.ones(B, T, dtype=torch.long)
        mask[1, 10] = 0
        kwargs, says = {"attention_mask": mask}, "padding between tokens"
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match=says):
        compiled(ids, **kwargs)


def test_pattern_changed_in_place_retraces():
    model = _model()
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    before = compiled(ids).logits
    model.config.dilgen_spec["segment_lengths"] = [4, 32]
    after = compiled(ids).logits
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(after, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_packed_rows_with_flash_attention_kwargs_under_fullgraph():
    """Packed rows under compile come as DataCollatorWithFlattening(return_flash_attn_kwargs=
    True) gives them: cu_seq_lens_q/k and max_length_q/k, batch 1; equal to eager."""
    model = _model()
    lengths = [5, 20, 7]
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(4))
    cu = torch.tensor([0, 5, 25, 32], dtype=torch.int32)
    kwargs = {"position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
              "cu_seq_lens_q": cu, "cu_seq_lens_k": cu.clone(), "max_length_q": 20, "max_length_k": 20}
    want_logits, want_grads = _step(model, ids, **kwargs)
    torch._dynamo.reset()
    got_logits, got_grads = _step(torch.compile(model, fullgraph=True, backend="aot_eager"), ids, **kwargs)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


BUILD_TIME = ("register", "_composite")      # run at import or when a model is built, never traced


def test_no_transformers_import_inside_what_a_traced_forward_runs():
    """torch 2.11's dynamo (the GPU machines') refuses `import transformers...` met while
    tracing ("Bad import result": transformers is a _LazyModule); torch 2.13's traces it, so
    the CPU runs cannot show it. The modules a model's forward calls into import transformers
    at module level only (BUILD_TIME's functions, never traced, are the exceptions)."""
    import ast
    import inspect
    from dilgen.integrations import cp_batch, hf_checks, hf_masks, hf_ring, hf_rows, transformers as dhf
    for module in (cp_batch, hf_checks, hf_masks, hf_ring, hf_rows, dhf):
        for fn in ast.walk(ast.parse(inspect.getsource(module))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name in BUILD_TIME:
                continue
            for node in ast.walk(fn):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                assert not any(n.split(".")[0] == "transformers" for n in names), \
                    f"{module.__name__}.{fn.name} imports transformers inside a function"
