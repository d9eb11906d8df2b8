"""The ring (SPEC §2 "Ring", §3): schedule IR units, and P = 2, 4, 8 gloo runs on CPU where
every rank asserts its rows of out, lse and the q, k, v gradients against the float64
single-device reference (tests/ring_worker.py)."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

import dilgen
from dilgen import schedule
from dilgen.calibration import DEFAULT
from dilgen.planner import plan
from dilgen.runtime.ring import RingError, shard, unshard
from dilgen.targets import get_target

import ring_worker
from proc_tree import free_port as _free_port, join_ranks, port_taken, run_together  # noqa: E402

pytestmark = pytest.mark.slow     # long runs (several processes, whole flows): -m "not slow" skips them


def _ring_json(P, w, r, causal=False, heads=(4, 4), hilbert=None):
    spec = dilgen.Spec(name="sched", num_heads=heads[0], num_kv_heads=heads[1], head_dim=16,
                       segment_lengths=w, dilation_rates=r, causal=causal, ring_size=P,
                       hilbert=hilbert)
    return plan(spec, get_target("interpreter")).ring.to_json()


# -- schedule IR ---------------------------------------------------------------------------
def test_local_branches_need_no_steps():
    sched = schedule.ring_schedule(_ring_json(4, [16, 64], [1, 2]), 4 * 64)
    assert [s["offset"] for s in sched["steps"]] == [0]
    assert sched["local_only"] == [0, 1]
    assert all(not r["send"] and not r["recv"] for r in sched["steps"][0]["ranks"])


def test_spanning_branch_sends_only_its_rows():
    # w = 256 spans all four chunks of 64; r = 4 with one kv head per query head: kv head h
    # keeps rows = h mod 4, so a sender ships a quarter of its rows
    sched = schedule.ring_schedule(_ring_json(4, [16, 256], [1, 4]), 256)
    assert [s["offset"] for s in sched["steps"]] == [0, 1, 2, 3]
    step1 = sched["steps"][1]
    assert step1["ranks"][1]["launches"] == [[0, 0, 0b10]]     # only the w = 256 branch
    assert step1["ranks"][1]["stride"] == [4]
    assert sched["bytes_fraction"] == pytest.approx(0.25)
    assert sched["local_only"] == [0]


def test_gqa_sends_every_row():
    sched = schedule.ring_schedule(_ring_json(2, [256], [4], heads=(4, 2)), 256)
    assert sched["steps"][1]["ranks"][1]["stride"] == [1]       # a kv head serves 2 offsets


def test_causal_skips_later_keys_and_neighbour_only():
    sched = schedule.ring_schedule(_ring_json(4, [128], [2], causal=True), 256)
    # chunks of 64, segments of 128: rank 1 needs rank 0, rank 3 needs rank 2, nothing else
    assert [s["offset"] for s in sched["steps"]] == [0, 1]
    recv = [r["recv"] for r in sched["steps"][1]["ranks"]]
    assert recv == [False, True, False, True]
    send = [r["send"] for r in sched["steps"][1]["ranks"]]
    assert send == [True, False, True, False]


def test_zigzag_pieces_balance_causal_work():
    pieces = schedule.ring_pieces(16, 4, "zigzag")
    assert pieces[0] == [(0, 2), (14, 2)] and pieces[3] == [(6, 2), (8, 2)]
    sched = schedule.ring_schedule(_ring_json(4, [16], [1], causal=True), 16, "zigzag")
    # with one segment over everything, each rank meets every other rank's rows
    per_rank = [sum(len(s["ranks"][j]["launches"]) for s in sched["steps"]) for j in range(4)]
    assert len(set(per_rank)) == 1


def test_hilbert_segment_scope_is_not_compacted():
    sched = schedule.ring_schedule(_ring_json(2, [64], [4], hilbert={"scope": "segment"}), 64)
    assert sched["steps"][1]["ranks"][1]["stride"] == [1]


def test_transport_cost_model_prefers_overlap_when_compute_dominates():
    ring = _ring_json(4, [256], [4])
    sched = schedule.ring_schedule(ring, 256)
    # 32 MB per step under 1 ms of kernels: the ring hides it, an all-gather waits for it
    slow_compute = [1e-3] * len(sched["steps"])
    assert schedule.choose_transport(ring, sched, bytes_per_row=2_000_000, step_compute_s=slow_compute,
                                     rates=DEFAULT) == "ring"
    # tiny messages and no compute to hide them behind: one collective beats 3 latencies
    tiny = [0.0] * len(sched["steps"])
    assert schedule.choose_transport(ring, sched, bytes_per_row=256, step_compute_s=tiny,
                                     rates=DEFAULT) == "allgather"
    # not enough memory to hold every rank's rows: ring
    assert schedule.choose_transport(ring, sched, bytes_per_row=256, step_compute_s=tiny, rates=DEFAULT,
                                     free_bytes=10) == "ring"


def test_packed_schedule_launches_only_sequences_that_meet():
    ring = _ring_json(2, [8, 16], [1, 2])
    # no sequence crosses the border at 16: the local step only
    sched = schedule.ring_schedule_packed(ring, [0, 16, 32])
    assert [s["offset"] for s in sched["steps"]] == [0]
    assert sched["steps"][0]["ranks"][1]["seqs"] == [[1]]
    assert sched["local_only"] == [0, 1]
    # [10, 30) crosses it: its segments (from row 10) of w = 8 end at 18, of w = 16 at 26
    sched = schedule.ring_schedule_packed(ring, [0, 10, 30, 32])
    step1 = sched["steps"][1]
    assert step1["ranks"][1]["launches"] == [[0, 0, 0b11]] and step1["ranks"][1]["seqs"] == [[1]]
    assert step1["ranks"][0]["launches"] == [[0, 0, 0b11]]
    assert step1["ranks"][0]["stride"] == [1]                 # packed rows travel uncompacted
    # causal: rank 0 never needs the later rank's keys
    sched = schedule.ring_schedule_packed(_ring_json(2, [8, 16], [1, 2], causal=True), [0, 10, 30, 32])
    assert sched["steps"][1]["ranks"][0]["launches"] == []
    assert [r["recv"] for r in sched["steps"][1]["ranks"]] == [False, True]
    # a border inside the sequence but not inside any of its segments: w = 8 from row 8
    # ends exactly at 16; only the w = 16 branch ([8, 24)) crosses
    sched = schedule.ring_schedule_packed(ring, [0, 8, 32])
    assert sched["steps"][1]["ranks"][1]["launches"] == [[0, 0, 0b10]]
    # zero-length sequences launch nothing
    sched = schedule.ring_schedule_packed(ring, [0, 0, 16, 16, 32, 32])
    assert sched["steps"][0]["ranks"][0]["seqs"] == [[1]] and sched["steps"][0]["ranks"][1]["seqs"] == [[3]]


def test_explain_shows_the_packed_ring_schedule(tmp_path, capsys):
    from dilgen.cli import main
    path = tmp_path / "rs.json"
    path.write_text(json.dumps({"name": "rs", "num_heads": 4, "head_dim": 16, "ring_size": 2,
                                "segment_lengths": [8, 32], "dilation_rates": [1, 2]}))
    assert main(["explain", str(path), "--cu-seqlens", "0,10,30,32"]) == 0
    text = capsys.readouterr().out
    assert "schedule of the packed row of 32 rows: 16 rows per rank" in text
    assert "0->1 ([0] [1]; 1/1 of rows; sequence(s) [1])" in text


def test_shard_unshard_roundtrip():
    x = torch.arange(2 * 24 * 3).reshape(2, 24, 3)
    for order in ("contiguous", "zigzag"):
        parts = [shard(x, 3, j, order) for j in range(3)]
        assert all(p.shape == (2, 8, 3) for p in parts)
        assert torch.equal(unshard(parts, order), x)
    with pytest.raises(Exception, match="not divisible"):
        shard(x[:, :10], 4, 0)


def test_ring_call_without_process_group_is_a_clear_error():
    spec = dilgen.Spec(name="ring_nogroup", num_heads=2, head_dim=16, dtype="float32",
                       segment_lengths=[8], dilation_rates=[1], ring_size=2)
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(RingError, match="init_process_group"):
        dilgen.compile(spec)(q, q, q)


def test_hilbert_sequence_scope_causal_ring_is_refused():
    with pytest.raises(dilgen.SpecError, match="causal"):
        dilgen.Spec(name="x", num_heads=2, head_dim=16, segment_lengths=[16], causal=True,
                    dilation_rates=[1], ring_size=2, hilbert={"scope": "sequence", "grid": [4, 8]})


def test_hilbert_sequence_shard_is_a_run_of_the_curve():
    """shard(spec=...) gives each rank a run of the curve in curve order (a compact region of
    the image); unshard(spec=...) puts the chunks back in raster order."""
    from dilgen.hilbert import gilbert_order
    spec = dilgen.Spec(name="x", num_heads=2, head_dim=16, segment_lengths=[16], dilation_rates=[1],
                       ring_size=4, hilbert={"scope": "sequence", "grid": [8, 8]})
    x = torch.arange(64).reshape(1, 64, 1, 1)
    parts = [shard(x, 4, j, spec=spec) for j in range(4)]
    curve = list(gilbert_order(8, 8))
    for j, part in enumerate(parts):
        assert part.flatten().tolist() == curve[16 * j:16 * (j + 1)]
        rows = {p // 8 for p in part.flatten().tolist()}
        cols = {p % 8 for p in part.flatten().tolist()}
        assert len(rows) * len(cols) == 16            # a 4 x 4 quadrant of the image
    assert torch.equal(unshard(parts, spec=spec), x)
    p = plan_of(spec)
    assert p.query.order is None and p.ring.curve == (8, 8)
    with pytest.raises(Exception, match="needs N = 64"):
        shard(x[:, :32], 4, 0, spec=spec)


def plan_of(spec):
    from dilgen.planner import plan
    from dilgen.targets import INTERPRETER
    return plan(spec, INTERPRETER)


# -- real rings: torch.multiprocessing + gloo ---------------------------------------------


def _rank_errors(P: int, tmp_path) -> list[dict]:
    files = [tmp_path / f"rank{r}.error.json" for r in range(P)]
    return [json.loads(f.read_text()) for f in files if f.exists()]


def _forkserver() -> str:
    """Ranks start from a fork server that imported torch, triton, dilgen and the worker
    once (a spawned rank imports them itself: 3.6 s of CPU each, 30 ranks in the suite), and
    torch._dynamo, which the traced cases' custom op imports (1.7 s); the server
    is a clean process started for this pytest process, never a fork of it."""
    import multiprocessing
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        ["torch", "torch.distributed", "torch._dynamo", "triton", "dilgen", "dilgen.runtime.ring", "ring_worker"])
    return "forkserver"


def _run_ring(P: int, cases: list[dict], tmp_path, timeout_s: float) -> list[dict]:
    """Run the cases on P spawned ranks and return each rank's report. Every rank leaves
    by os._exit after a final barrier (ring_worker._leave): exit 0 with its report written,
    or exit 1 with rank{r}.error.json (phase, traceback). Any other end fails the test: a
    nonzero exit, a rank killed by a signal, a hang. One exception: the port taken before
    rank 0 could listen on it (EADDRINUSE while starting) runs once more on a fresh port."""
    import torch.multiprocessing as mp
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException
    for attempt in (1, 2):
        for f in list(tmp_path.glob("rank*.json")):     # no file of an earlier attempt may stand
            f.unlink()
        ctx = mp.start_processes(ring_worker.worker, args=(P, _free_port(), cases, str(tmp_path)),
                                 nprocs=P, join=False, start_method=_forkserver())
        try:
            join_ranks(ctx, timeout_s, f"ring P={P}")
        except (ProcessExitedException, ProcessRaisedException) as exc:
            # join stopped the other ranks; a rank that failed on its own left its traceback
            errors = _rank_errors(P, tmp_path)
            if attempt == 1 and port_taken(errors):
                warnings.warn(f"ring P={P}: the port was taken before rank 0 listened on it; "
                              f"running again on a fresh port")
                continue
            details = "".join(f"\n-- rank {e['rank']} failed in {e['phase']}:\n{e['traceback']}"
                              for e in errors)
            reports = [tmp_path / f"rank{r}.json" for r in range(P)]
            fails = "".join(f"\n{f}" for p in reports if p.exists()
                            for f in json.loads(p.read_text())["fails"])
            if fails:
                details += f"\n-- failures in the reports:{fails}"
            pytest.fail(f"ring P={P}: {exc}{details}")
        missing = [r for r in range(P) if not (tmp_path / f"rank{r}.json").exists()]
        assert not missing, f"ring P={P}: ranks {missing} exited 0 without a report"
        return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(P)]
    raise AssertionError("unreachable")


# Segments smaller than, equal to and larger than N/P; causal and not; GQA; Hilbert
# segment scope; unaligned segments; zigzag; bf16; every rank asserts (ring_worker).
CASES_P2 = [
    {"name": "mix_causal", "spec": {"segment_lengths": [8, 32, 128], "dilation_rates": [1, 2, 4],
                                    "causal": True}, "shape": [1, 64]},
    {"name": "equal_chunk", "spec": {"segment_lengths": [32, 64], "dilation_rates": [1, 2]},
     "shape": [2, 64]},
    {"name": "unaligned", "spec": {"segment_lengths": [24, 40], "dilation_rates": [1, 2]},
     "shape": [1, 64]},
    {"name": "gqa_causal", "spec": {"segment_lengths": [16, 64], "dilation_rates": [1, 4],
                                    "num_heads": 4, "num_kv_heads": 2, "causal": True},
     "shape": [1, 64]},
    {"name": "r3", "spec": {"segment_lengths": [48], "dilation_rates": [3], "num_heads": 3},
     "shape": [1, 96]},
    # causal windows whose query lanes start off a tile's edge (chunks of 32 rows, r = 3: 32
    # mod 3 != 0): the dK/dV kernel's diagonal blocks must stop at the full blocks' first
    # lane (they reached into them: remote keys' dK, dV counted twice, 10-50 % off)
    {"name": "causal_zigzag_r3_off_edge", "spec": {"segment_lengths": [16, 96], "dilation_rates": [1, 3],
                                                   "num_heads": 4, "num_kv_heads": 2, "causal": True},
     "shape": [1, 128], "order": "zigzag", "transport": "ring"},
    {"name": "causal_contiguous_r3_spanning", "spec": {"segment_lengths": [128], "dilation_rates": [3],
                                                       "num_heads": 2, "causal": True},
     "shape": [1, 128], "transport": "ring"},
    {"name": "hilbert_segment", "spec": {"segment_lengths": [16, 64], "dilation_rates": [1, 4],
                                         "hilbert": {"scope": "segment"}}, "shape": [1, 64]},
    {"name": "zigzag_causal", "spec": {"segment_lengths": [16, 64], "dilation_rates": [1, 2],
                                       "causal": True}, "shape": [1, 64], "order": "zigzag"},
    {"name": "bf16_causal", "spec": {"segment_lengths": [32, 64], "dilation_rates": [1, 2],
                                     "dtype": "bfloat16", "causal": True}, "shape": [1, 64]},
    {"name": "compiled_causal", "spec": {"segment_lengths": [16, 64], "dilation_rates": [1, 2],
                                         "causal": True}, "shape": [1, 64], "compile": True},
    {"name": "hilbert_sequence", "spec": {"segment_lengths": [16, 48], "dilation_rates": [1, 3],
                                          "num_heads": 3,
                                          "hilbert": {"scope": "sequence", "grid": [8, 12]}},
     "shape": [1, 96]},
    # the sm90 descriptor loads in the windows (fused_tma): local keys, and remote keys
    # compacted with stride 4 (kv head h keeps rows = h mod 4; w = 128 spans both ranks);
    # a short last segment; unaligned segments whose tiles loop over segments
    {"name": "tma_compacted", "spec": {"segment_lengths": [16, 128], "dilation_rates": [1, 4],
                                       "num_heads": 4, "dtype": "bfloat16"},
     "shape": [1, 128], "tuning": {"fused_tma": True, "fold_scale": True, "bwd_tma": True}},
    {"name": "tma_unaligned_short_last", "spec": {"segment_lengths": [24, 40, 96], "dilation_rates": [1, 2, 8],
                                                  "num_heads": 8},
     "shape": [1, 112], "tuning": {"fused_tma": True, "bwd_tma": True}},
    {"name": "tma_bwd_causal_gqa", "spec": {"segment_lengths": [16, 128], "dilation_rates": [1, 2],
                                            "num_heads": 4, "num_kv_heads": 2, "causal": True},
     "shape": [1, 128], "tuning": {"bwd_tma": True, "fold_scale": True}},
]
# the head-parallel transport (all-to-all to head shards, single-device kernels with
# head_base) and the local one (every segment inside a rank): batch 2, zigzag causal GQA,
# Hilbert segment; the cost model picks "local" when nothing crosses a rank
CASES_P2 += [
    {"name": "heads_raster_b2", "spec": {"segment_lengths": [16, 64], "dilation_rates": [1, 4], "num_heads": 4},
     "shape": [2, 64], "transport": "heads", "expect_transport": "heads"},
    {"name": "heads_zigzag_causal_gqa", "spec": {"segment_lengths": [16, 64], "dilation_rates": [1, 2],
                                                 "num_heads": 4, "num_kv_heads": 2, "causal": True},
     "shape": [1, 64], "order": "zigzag", "transport": "heads"},
    {"name": "heads_hilbert_segment", "spec": {"segment_lengths": [16, 64], "dilation_rates": [2, 4],
                                               "hilbert": {"scope": "segment"}},
     "shape": [1, 64], "transport": "heads"},
    # 4 chunks of heads pipelined (each its own head_base), and 2 with GQA zigzag and lse
    {"name": "heads_four_chunks", "spec": {"segment_lengths": [16, 64], "dilation_rates": [1, 4], "num_heads": 8},
     "shape": [1, 64], "transport": "heads"},
    {"name": "heads_two_chunks_gqa_zigzag", "spec": {"segment_lengths": [16, 64], "dilation_rates": [2, 4],
                                                     "num_heads": 8, "num_kv_heads": 4, "causal": True},
     "shape": [1, 64], "order": "zigzag", "transport": "heads"},
    {"name": "auto_local_hilbert_segment", "spec": {"segment_lengths": [16, 32], "dilation_rates": [1, 2],
                                                    "hilbert": {"scope": "segment"}},
     "shape": [1, 64], "transport": "auto", "expect_transport": "local"},
    # "recut": the border at 56 moves to 48 (lcm 48; rows 48..55 travel there and back);
    # zigzag causal GQA with r not dividing w: borders 32 and 96 move to 30 and 90, two pieces on rank 0
    {"name": "recut_straddle", "spec": {"segment_lengths": [8, 48], "dilation_rates": [1, 3]},
     "shape": [2, 112], "transport": "recut", "expect_transport": "recut"},
    {"name": "recut_zigzag_causal_gqa", "spec": {"segment_lengths": [6, 30], "dilation_rates": [2, 7], "num_heads": 4,
                                                 "num_kv_heads": 2, "causal": True},
     "shape": [1, 64], "order": "zigzag", "transport": "recut", "expect_transport": "recut"},
    # "hybrid": the branches inside the pieces (w 8, 16; zigzag: w 16) in the single-device
    # kernels, the others (w 64; 128 with r = 3) in the windows, merged by their lse
    {"name": "hybrid_raster_b2", "spec": {"segment_lengths": [8, 16, 64], "dilation_rates": [1, 2, 4], "num_heads": 4},
     "shape": [2, 64], "transport": "hybrid", "expect_transport": "hybrid"},
    {"name": "hybrid_bf16", "spec": {"segment_lengths": [8, 64], "dilation_rates": [1, 4], "dtype": "bfloat16"},
     "shape": [1, 64], "transport": "hybrid", "expect_transport": "hybrid"},
    # the first auto call of a spec measures its own rate (DILGEN_RING_MEASURE=1 on the CPU): every rank
    # the same entry, then the cost model's pick
    {"name": "measured_rate", "spec": {"segment_lengths": [8, 48], "dilation_rates": [1, 3]},
     "shape": [1, 112], "transport": "auto", "measure": True},
    # DILGEN_RING_AGREE=cpu: the fingerprints travel on a gloo group of the ring's ranks, made at
    # its first call (over NCCL that keeps the agreement off the GPU; here: a group of its own)
    {"name": "agree_on_cpu_group", "spec": {"segment_lengths": [16, 64], "dilation_rates": [1, 2],
                                            "causal": True}, "shape": [1, 64], "agree": "cpu"},
    {"name": "hybrid_zigzag_causal_gqa_r3", "spec": {"segment_lengths": [16, 128], "dilation_rates": [1, 3],
                                                     "num_heads": 4, "num_kv_heads": 2, "causal": True},
     "shape": [1, 128], "order": "zigzag", "transport": "hybrid", "expect_transport": "hybrid"},
]
CASES_P4 = [
    {"name": "p4_mix_causal", "spec": {"segment_lengths": [8, 32, 128], "dilation_rates": [1, 2, 4],
                                       "causal": True}, "shape": [1, 128]},
    {"name": "p4_compacted", "spec": {"segment_lengths": [16, 256], "dilation_rates": [1, 4],
                                      "num_heads": 4}, "shape": [1, 128]},
    {"name": "p4_hilbert_sequence_gqa", "spec": {"segment_lengths": [16, 64], "dilation_rates": [2, 4],
                                                 "num_heads": 4, "num_kv_heads": 2,
                                                 "hilbert": {"scope": "sequence", "grid": [8, 16]}},
     "shape": [1, 128]},
    {"name": "p4_tma_compacted_zigzag", "spec": {"segment_lengths": [16, 64, 256], "dilation_rates": [1, 2, 8],
                                                 "num_heads": 4}, "shape": [1, 256], "order": "zigzag",
     "tuning": {"fused_tma": True, "fold_scale": True, "bwd_tma": True}},
    {"name": "p4_zigzag_mqa", "spec": {"segment_lengths": [16, 64], "dilation_rates": [2, 4],
                                       "num_heads": 4, "num_kv_heads": 1, "causal": True},
     "shape": [1, 128], "order": "zigzag"},
    {"name": "p4_heads_hilbert_sequence", "spec": {"segment_lengths": [16, 64], "dilation_rates": [2, 4],
                                                   "num_heads": 4, "hilbert": {"scope": "sequence", "grid": [8, 16]}},
     "shape": [1, 128], "transport": "heads"},
    {"name": "p4_heads_hilbert_segment_spans_all", "spec": {"segment_lengths": [16, 128], "dilation_rates": [2, 8],
                                                       "num_heads": 4, "hilbert": {"scope": "segment"}},
     "shape": [1, 128], "transport": "heads"},
    # six borders of zigzag chunks of 8, four of them moved onto multiples of 16 (rows travel both ways)
    {"name": "p4_recut_zigzag_hilbert_segment", "spec": {"segment_lengths": [4, 16], "dilation_rates": [1, 2],
                                                         "hilbert": {"scope": "segment"}},
     "shape": [1, 64], "order": "zigzag", "transport": "recut", "expect_transport": "recut"},
    {"name": "p4_hybrid_hilbert_segment", "spec": {"segment_lengths": [4, 64], "dilation_rates": [1, 2],
                                                   "hilbert": {"scope": "segment"}},
     "shape": [1, 128], "transport": "hybrid", "expect_transport": "hybrid"},
    {"name": "err_world", "expect_error": "ring_size", "expect_in": "ring_size"},
    {"name": "err_spec", "expect_error": "spec", "expect_in": "disagree on spec"},
    {"name": "err_rows", "expect_error": "rows", "expect_in": "divisible"},
    {"name": "err_dtype", "expect_error": "dtype", "expect_in": "bad inputs"},
    {"name": "err_transport", "expect_error": "transport", "expect_in": "disagree on DILGEN_RING_TRANSPORT"},
    {"name": "err_agree", "expect_error": "agree", "expect_in": "DILGEN_RING_AGREE='gpu' must be one of"},
    # issue 44: one rank's bad argument on the default group (q None, meta tensors, chunk_order
    # None) and a rank that skipped a backward: every rank refuses, none waits
    {"name": "err_none_q", "expect_error": "none_q", "expect_in": "bad inputs"},
    {"name": "err_meta", "expect_error": "meta", "expect_in": "bad inputs"},
    {"name": "err_order_none", "expect_error": "order_none", "expect_in": "bad inputs"},
    {"name": "err_skipped_backward", "expect_error": "skipped_backward", "expect_in": "different ring calls"},
]


# P = 8 (8 processes on the CI's 2 cores: two small cases): every rank's keys reach every
# other rank (w = N, compacted with stride 4); causal zigzag GQA over the all-gather
CASES_P8 = [
    {"name": "p8_compacted", "spec": {"segment_lengths": [16, 256], "dilation_rates": [1, 4]},
     "shape": [1, 256]},
    {"name": "p8_zigzag_causal_gqa_allgather", "spec": {"segment_lengths": [32, 128], "dilation_rates": [1, 2],
                                                        "num_heads": 4, "num_kv_heads": 2, "causal": True},
     "shape": [1, 256], "order": "zigzag", "transport": "allgather"},
]


@pytest.mark.ranks
@pytest.mark.timeout(700)
@pytest.mark.parametrize("P, cases", [(2, CASES_P2), (4, CASES_P4),
                                      pytest.param(8, CASES_P8, marks=pytest.mark.slow)],
                         ids=["P2", "P4", "P8"])
def test_ring_matches_single_device_reference(P, cases, tmp_path):
    reports = _run_ring(P, cases, tmp_path, timeout_s=600)
    fails = [f for r in reports for f in r["fails"]]
    assert not fails, "\n".join(fails)
    want = [c["name"] for c in cases if not c.get("expect_error")]
    for r in reports:
        assert r["passed"] == want


# -- packed rows (cu_seqlens over the whole row) on a ring ------------------------------------
# Sequences spanning rank borders, longer than a chunk, tiny and empty; causal and not; GQA,
# MQA; r not dividing w; Hilbert segment scope; the all-gather transport. Every rank checks
# its rows of out, lse and dq, dk, dv against the single-device packed call (ring_worker).
PACKED_P2 = [
    {"name": "pk_span_causal", "spec": {"segment_lengths": [8, 32], "dilation_rates": [1, 2],
                                        "causal": True}, "lengths": [5, 40, 3, 0, 16]},
    {"name": "pk_tiny_zero", "spec": {"segment_lengths": [4, 8], "dilation_rates": [1, 2]},
     "lengths": [1, 2, 0, 3, 1, 5, 2, 0, 1, 9]},
    {"name": "pk_gqa_r3_causal", "spec": {"segment_lengths": [10, 20], "dilation_rates": [1, 3],
                                          "num_heads": 4, "num_kv_heads": 2, "causal": True},
     "lengths": [17, 29, 14]},
    {"name": "pk_hilbert_segment", "spec": {"segment_lengths": [16, 32], "dilation_rates": [1, 2],
                                            "hilbert": {"scope": "segment"}}, "lengths": [21, 32, 11]},
    {"name": "pk_mqa_allgather", "spec": {"segment_lengths": [8, 16], "dilation_rates": [2, 4],
                                          "num_heads": 4, "num_kv_heads": 1},
     "lengths": [12, 30, 6], "transport": "allgather"},
    {"name": "pk_bf16_causal", "spec": {"segment_lengths": [8, 32], "dilation_rates": [1, 2],
                                        "dtype": "bfloat16", "causal": True}, "lengths": [9, 33, 6]},
    {"name": "pk_tma", "spec": {"segment_lengths": [8, 32], "dilation_rates": [1, 4], "num_heads": 4},
     "lengths": [21, 30, 13], "tuning": {"fused_tma": True, "fold_scale": True, "bwd_tma": True}},
]
PACKED_P3 = [
    {"name": "p3_long_causal", "spec": {"segment_lengths": [8, 32], "dilation_rates": [1, 2],
                                        "causal": True}, "lengths": [3, 50, 7]},
    {"name": "p3_tiny_zero", "spec": {"segment_lengths": [4, 8], "dilation_rates": [1, 2]},
     "lengths": [1, 2, 0, 3, 1, 5, 2, 0, 1, 9]},
    {"name": "p3_gqa_r3", "spec": {"segment_lengths": [10, 20], "dilation_rates": [1, 3],
                                   "num_heads": 4, "num_kv_heads": 2}, "lengths": [0, 31, 14, 15]},
    {"name": "err_cu_differs", "expect_error": "packed_cu_differs", "expect_in": "disagree on cu_seqlens"},
    {"name": "err_not_divisible", "expect_error": "packed_not_divisible", "expect_in": "not divisible"},
    {"name": "err_bad_cu", "expect_error": "packed_bad_cu", "expect_in": "bad inputs"},
]


@pytest.mark.ranks
@pytest.mark.timeout(560)
@pytest.mark.parametrize("P, cases", [(2, PACKED_P2), (3, PACKED_P3)], ids=["P2", "P3"])
def test_packed_ring_matches_single_device_packed_call(P, cases, tmp_path):
    reports = _run_ring(P, cases, tmp_path, timeout_s=480)
    fails = [f for r in reports for f in r["fails"]]
    assert not fails, "\n".join(fails)
    want = [c["name"] for c in cases if not c.get("expect_error")]
    for r in reports:
        assert r["passed"] == want


# -- issue 35: a refused call leaves the process group usable and the process exits cleanly --
def _refused_run(mode: str, tmp_path, P: int = 2) -> list[tuple[int, str]]:
    """refused_main (ring_worker.py) on P ranks started as torchrun starts them (fresh
    interpreters that end through the interpreter's teardown); (exit code, stderr) per rank."""
    import os
    import sys
    from pathlib import Path
    script = Path(ring_worker.__file__)
    for attempt in (1, 2):
        port = _free_port()
        cmds = [([sys.executable, str(script), "refused", mode, str(tmp_path)],
                 dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(P),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1"))
                for rank in range(P)]
        results = run_together(cmds, tmp_path, 240, f"refused ring ({mode})")
        if attempt == 1 and any("EADDRINUSE" in err for _, err in results):
            continue                      # the port was taken before rank 0 listened on it
        return results
    raise AssertionError("unreachable")


@pytest.mark.ranks
@pytest.mark.timeout(600)
def test_refused_ring_call_leaves_nothing_pending(tmp_path):
    """Issue 35: rank 0 alone passes an fp16 q to a float32 ring spec. Every rank raises the
    same RingError; a process group worker thread must hold none of the call's tensors once
    it is raised (else, the process ending next, the thread takes the GIL while the
    interpreter finalizes: std::terminate, SIGABRT, seen in 1-3 of 5 runs); good calls on
    the same group then work; and every rank exits cleanly: 0 after catching, 1 (the
    RingError's traceback, nothing after it) when the last refusal is left uncaught."""
    for mode in ("raise", "catch", "raise"):
        results = _refused_run(mode, tmp_path)
        want_rc = 1 if mode == "raise" else 0
        for rank, (rc, err) in enumerate(results):
            assert "terminate called" not in err, f"{mode}: rank {rank} aborted at exit:\n{err[-2000:]}"
            assert rc == want_rc, f"{mode}: rank {rank} exited {rc}:\n{err[-2000:]}"
            if mode == "raise":
                last = err.strip().splitlines()[-1]
                assert "RingError: ring_refused: ring call refused on every rank" in last, last
            report = json.loads((tmp_path / f"refused{rank}.json").read_text())
            assert report["wrong"] == [], report["wrong"]
            assert report["held"] == [], f"rank {rank}: tensors held after a refusal: {report['held']}"
            assert len(report["good"]) == 2 and max(report["good"]) < 1e-4, report["good"]
