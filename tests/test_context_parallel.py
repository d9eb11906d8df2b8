"""Context parallelism for transformers models (dilgen.integrations.context_parallel): a tiny
Llama (hidden 32, 2 layers, 4 heads, 2 kv heads, head_dim 16, vocab 61, float32) trained one
step with its sequence split over P = 2 and 4 gloo ranks equals one process on the whole
sequence: the loss and EVERY parameter's gradient on every rank (relative error <= 1e-5,
float32: dilgen's kernels take no float64), causal (zigzag rows) and not (the same Llama
made bidirectional, and BERT, an encoder), packed rows (DataCollatorWithFlattening), right
padding, under torch.compile, and FSDP2 on a 2 x 2 (dp x cp) mesh; and the refusals, raised
on every rank alike. Ranks: tests/cp_worker.py."""
from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import cp_worker  # noqa: E402
import torch  # noqa: E402

pytestmark = pytest.mark.slow     # several processes each

TOL = 1e-5


def _check(case: dict, results: list[dict], rows: int | None = None) -> None:
    """Every rank's loss and gradients against one process on the whole batch."""
    want = cp_worker.reference(case if rows is None else dict(case, rows=rows))
    for rank, got in enumerate(results):
        assert abs(got["loss"] - want["loss"]) <= TOL * abs(want["loss"]), (case["name"], rank, got["loss"], want["loss"])
        errors = cp_worker.grad_errors(got["grads"], want["grads"])
        assert set(errors) == {n for n, _ in cp_worker.build(case.get("model", "causal")).named_parameters()}
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOL, (case["name"], rank, worst, errors[worst])


LM_P2 = [{"name": "causal", "model": "causal"}, {"name": "bidirectional", "model": "bidirectional"},
         {"name": "bert", "model": "bert"}, {"name": "own_loss", "own_loss": True},
         {"name": "attention_dropout", "model": "causal", "dropout": 0.2}]


@pytest.mark.ranks
def test_p2_loss_and_every_gradient_equal_one_process(tmp_path):
    """cp.loss and cp.reduce_gradients, and the model's own loss (its part L_j: the forward
    passes the count of every rank's labels as num_items_in_batch); with the Llama's
    attention dropout 0.2 in training, the ring draws the one-process mask."""
    results = cp_worker.spawn(2, LM_P2, tmp_path, timeout_s=600)
    for case in LM_P2:
        _check(case, results[case["name"]])
    assert results["causal"][0]["order"] == "zigzag" and results["bidirectional"][0]["order"] == "contiguous"


LM_P4 = [{"name": "causal", "model": "causal"}, {"name": "bidirectional", "model": "bidirectional"}]


@pytest.mark.ranks
def test_p4_loss_and_every_gradient_equal_one_process(tmp_path):
    results = cp_worker.spawn(4, LM_P4, tmp_path, timeout_s=600)
    for case in LM_P4:
        _check(case, results[case["name"]])


ROWS = [{"name": "packed", "batch": "packed"}, {"name": "packed_offsets", "batch": "packed", "flash": True},
        {"name": "right_padded", "batch": "right_padded"}]


@pytest.mark.ranks
def test_p2_packed_rows_and_right_padding(tmp_path):
    """DataCollatorWithFlattening's packed row (position_ids that restart, and with
    return_flash_attn_kwargs its cu_seq_lens_q) runs on the packed ring, split in
    contiguous chunks, sequences across the border; a causal model's right-padded row
    drops its mask (no token attends to later keys) and its padded labels. Both equal one
    process (the packed and the padded one-device kernels)."""
    results = cp_worker.spawn(2, ROWS, tmp_path, timeout_s=600)
    for case in ROWS:
        _check(case, results[case["name"]])


COMPILED = [{"name": "compiled", "compile": True, "bad_positions": True},
            {"name": "compiled_subgroup", "compile": True, "subgroup": True},
            {"name": "compiled_dropout", "compile": True, "dropout": 0.2}]


@pytest.mark.ranks
@pytest.mark.parametrize("case", COMPILED, ids=[c["name"] for c in COMPILED])
def test_p2_under_torch_compile(case, tmp_path):
    """torch.compile(model, fullgraph=True) of a context-parallel model, on the default
    group and on a group of its own: the ring runs as torch.ops.dilgen.ring_attention_fwd/bwd
    inside the graph, the group passed by its name; with attention dropout, as
    ring_attention_dropout_fwd/bwd, drawing the one-process mask. One spawn per case: each
    compiles its model's forward and backward with inductor in both ranks (about 100 s on a
    busy 16-core GPU host, so three in one spawn outran its bound)."""
    results = cp_worker.spawn(2, [case], tmp_path, timeout_s=600)
    _check(case, results[case["name"]])
    if case.get("bad_positions"):
        # position_ids that restart (no cu_seq_lens_q) or are a per-rank arange: a
        # device-side assert in the traced pre-hook (no host sync), on every rank
        for rank in (0, 1):
            for key, got in results[case["name"]][rank]["refused"].items():
                assert got is not None and "not each rank's global positions" in got, (key, rank, got)


@pytest.mark.ranks
def test_fsdp2_on_a_2x2_mesh(tmp_path):
    """FSDP2 (fully_shard over the 4 ranks of a dp x cp = 2 x 2 mesh, gloo on the CPU) with
    the ring over each dp replica's cp pair: the mean over the two replicas of their
    whole-sequence losses, and its gradients, on every rank (fully_shard averages the
    gradients over the 4 ranks: each backwards loss * cp.size)."""
    case = {"name": "fsdp", "kind": "fsdp"}
    results = cp_worker.spawn(4, [case], tmp_path, timeout_s=600)["fsdp"]
    assert [r["cp_rank"] for r in results] == [0, 1, 0, 1]
    _check(case, results, rows=4)


@pytest.mark.ranks
def test_refusals_on_every_rank(tmp_path):
    """What context parallelism does not take is refused in one line, the same on every
    rank (a per-rank mask is agreed on by an all-reduce, never one rank alone); what the
    one-device integration refuses stays refused."""
    got = cp_worker.spawn(2, [{"name": "refusals", "kind": "refusals"}], tmp_path, timeout_s=600)["refusals"]
    assert got[0].keys() == got[1].keys()
    for key in got[0]:
        assert got[0][key] == got[1][key], key
    expect = {"left_padding": "left padding", "odd_length": "cannot be cut into 4 equal chunks",
              "mask_on_one_rank": "padding on some rank", "generation": "generation",
              "output_attentions": "does not return attention weights", "sdpa_model": "runs attn_implementation='sdpa'",
              "placed_twice": "placed already", "unknown_token_key": "'pixel_mask'",
              "labels_unshifted": "labels without shift_labels", "masked_lm_labels": "cp.loss(outputs.logits",
              "local_positions": "not each rank's global positions", "restarting_positions": "restart inside a row"}
    for key, words in expect.items():
        for rank in (0, 1):
            assert got[rank][key] is not None and words in got[rank][key], (key, rank, got[rank][key])
            assert "\n" not in got[rank][key], (key, got[rank][key])
    assert got[0]["after_remove"] is None          # cp.remove(): a one-device model again
    assert got[0]["saved_is_one_device"] is None and got[0]["copy_on_the_ring"] is None
    # reduce_gradients: zeros joined where another rank has a gradient, None where no rank has
    assert got[0]["grad_one_rank"] == [[3.0, 3.0], [3.0, 3.0]] and got[0]["grad_no_rank"] is None


def _tiny_qwen3_next():
    """A tiny Qwen3-Next (a Gated DeltaNet layer, layer_types 'linear_attention', then a full
    attention layer) with attn_implementation='dilgen', or None without Qwen3NextConfig."""
    config_cls = getattr(transformers, "Qwen3NextConfig", None)
    if config_cls is None:
        return None
    config = config_cls(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=2,
                        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                        num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                        shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention"])
    config.dilgen_spec = dict(cp_worker.PATTERN)
    return transformers.Qwen3NextForCausalLM._from_config(config, attn_implementation="dilgen")


def test_sequence_mixers_other_than_attention_refused():
    """A token-mixing layer the ring does not split (a Gated DeltaNet, a Mamba mixer, a
    token Conv1d) would mix this rank's rows alone: context_parallel(model) refuses it in one
    line, before it looks for a process group (none here)."""
    from dilgen.integrations.context_parallel import context_parallel
    qwen = _tiny_qwen3_next()
    if qwen is None:
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3NextConfig")
    with pytest.raises(ValueError, match="'linear_attention'") as info:
        context_parallel(qwen)
    assert "\n" not in str(info.value)
    qwen.config.layer_types = ["full_attention", "full_attention"]       # the module is still there
    with pytest.raises(ValueError, match="Qwen3NextGatedDeltaNet"):
        context_parallel(qwen)

    class FakeMambaMixer(torch.nn.Module):
        pass

    for extra, words in ((FakeMambaMixer(), "FakeMambaMixer"), (torch.nn.Conv1d(4, 4, 3), "Conv1d of kernel 3")):
        llama = cp_worker.build("causal")
        llama.model.layers[0].mixer = extra
        with pytest.raises(ValueError, match=words) as info:
            context_parallel(llama)
        assert "\n" not in str(info.value)
    llama = cp_worker.build("causal")
    llama.config.layer_types = ["full_attention", "mamba"]
    with pytest.raises(ValueError, match="'mamba'"):
        context_parallel(llama)
