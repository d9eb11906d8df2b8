"""The ring cost model's rates (issue 59 §1, dilgen/calibration.py, dilgen/calibrate.py): a `Rates` refuses what is
not a rate; a calibration is kept in the cache under its machine's key and read back by
`rates_for`, and any change of that key (templates, world size, device) or a corrupt or
untrusted record gives the committed profile again; the rates decide the transport; ranks
pricing with different rates are refused in one line; `dilgen calibrate` under torchrun
measures the links over gloo and fits the ring's and the head-parallel call's factors on a
call of each; `dilgen explain --ring` forecasts with the rates it names."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dilgen import calibrate as measure
from dilgen import calibration as cal
from dilgen import schedule
from dilgen.runtime.ring.agreement import _FIELDS, _verdict
from proc_tree import free_port

ROOT = Path(__file__).resolve().parents[1]
FAKE = {"twin_fused_tflops": 111.0, "twin_bwd": 2.5, "twin_lanes_tflops": 222.0, "twin_causal_bwd": 3.5,
        "window_tflops": 99.0, "window_bwd": 2.5}


@pytest.fixture
def fresh(cache_dir, monkeypatch):
    """An empty cache, no remembered rates, and kernel measurements that return FAKE."""
    monkeypatch.setattr(cal, "_MEMO", {})
    monkeypatch.setattr(cal, "_MACHINES", {})
    monkeypatch.setattr(measure, "measure_kernels", lambda device, shape, P: dict(FAKE))
    return cache_dir


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "3", True])
def test_a_rate_is_a_finite_positive_number(bad):
    with pytest.raises(ValueError, match="link_gbytes_s"):
        cal.Rates(link_gbytes_s=bad)


def test_rates_round_trip_and_their_key_follows_the_numbers_only():
    r = dataclasses.replace(cal.DEFAULT, window_tflops=5.0, measured=("window_tflops",), source="x")
    assert cal.Rates.from_json(json.loads(json.dumps(r.to_json()))) == r
    assert r.key() == dataclasses.replace(r, source="y").key() != cal.DEFAULT.key()
    with pytest.raises(ValueError, match="measured"):
        cal.Rates(measured=("no_such_rate",))
    for bad in ([], {"window_tflops": 1.0, "extra": 2}, {"measured": "window_tflops"}):
        with pytest.raises((ValueError, TypeError)):
            cal.Rates.from_json(bad)


def test_a_calibration_is_read_back_under_its_machine_key_only(fresh, monkeypatch):
    assert cal.rates_for(1, "none") is cal.DEFAULT
    rates = measure.calibrate(None)
    assert rates.twin_fused_tflops == 111.0 and set(rates.measured) == set(FAKE)
    assert rates.link_gbytes_s == cal.DEFAULT.link_gbytes_s              # not measured alone
    records = list((fresh / "calibration").iterdir())
    assert len(records) == 1 and oct(records[0].stat().st_mode & 0o777) == "0o600"
    assert oct((fresh / "calibration").stat().st_mode & 0o777) == "0o700"
    monkeypatch.setattr(cal, "_MEMO", {})
    assert cal.rates_for(1, "none") == rates                             # read from the cache
    assert cal.rates_for(2, "none") is cal.DEFAULT                       # another world size
    monkeypatch.setattr(cal, "_MACHINES", {})
    import dilgen.codegen
    monkeypatch.setattr(dilgen.codegen, "template_hash", lambda: "0123456789abcdef")
    assert cal.rates_for(1, "none") is cal.DEFAULT                       # a kernel change


@pytest.mark.parametrize("damage", ["garbage", "not_rates", "negative", "group_writable_folder", "link"])
def test_a_corrupt_or_untrusted_record_is_not_read(fresh, monkeypatch, damage, tmp_path):
    measure.calibrate(None)
    folder = fresh / "calibration"
    (record,) = folder.iterdir()
    data = json.loads(record.read_text())
    if damage == "garbage":
        record.write_bytes(b"\x00{not json")
    elif damage == "not_rates":
        record.write_text(json.dumps({"rates": [1, 2]}))
    elif damage == "negative":
        data["rates"]["link_gbytes_s"] = -3.0
        record.write_text(json.dumps(data))
    elif damage == "group_writable_folder":
        folder.chmod(0o770)
    else:
        elsewhere = tmp_path / "theirs.json"
        elsewhere.write_text(json.dumps(data))
        record.unlink()
        record.symlink_to(elsewhere)
    monkeypatch.setattr(cal, "_MEMO", {})
    assert cal.rates_for(1, "none") is cal.DEFAULT


def test_the_rates_decide_the_transport():
    ring = {"ring_size": 4, "causal": False, "branches": [{"index": 0, "w": 256, "r": 4, "raster": True}],
            "one_kv_head_per_query_head": True, "curve": None}
    sched = schedule.ring_schedule(ring, 256)
    tiny = [0.0] * len(sched["steps"])
    fast_gather = dataclasses.replace(cal.DEFAULT, allgather_gbytes_s=1e4, link_gbytes_s=1.0)
    slow_gather = dataclasses.replace(cal.DEFAULT, allgather_gbytes_s=1e-3, link_gbytes_s=1e4)
    pick = [schedule.choose_transport(ring, sched, bytes_per_row=1 << 20, step_compute_s=tiny, rates=r)
            for r in (fast_gather, slow_gather)]
    assert pick == ["allgather", "ring"]


def test_ranks_pricing_with_different_rates_are_refused_by_name():
    rows = [[0] * len(_FIELDS) for _ in range(2)]
    rows[1][_FIELDS.index("cost model rates")] = 12345
    message = _verdict("ring_x", rows, None, 2)
    assert "different cost-model rates" in message and "dilgen calibrate" in message, message


@pytest.mark.ranks
def test_calibrate_under_torchrun_measures_the_links(tmp_path):
    import torch
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"      # calibrate's own choice
    env = dict(os.environ, DILGEN_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    if backend == "gloo":
        env["CUDA_VISIBLE_DEVICES"] = ""              # one GPU or none: both ranks on the CPU
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "dilgen.cli", "calibrate", "--link-mib", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert f"x 2 ({backend})" in done.stdout and "link_gbytes_s" in done.stdout, done.stdout
    records = {(d["machine"]["world_size"], d["machine"]["backend"]): cal.Rates.from_json(d["rates"])
               for d in (json.loads(p.read_text()) for p in (tmp_path / "cache" / "calibration").iterdir())}
    assert set(records) == {(2, backend), (1, "none")}, records      # the kernels' rates hold for one process too
    links = {"link_gbytes_s", "allgather_gbytes_s", "alltoall_gbytes_s", "step_latency_us", "ring_overhead",
             "heads_fused_slowdown", "heads_lanes_slowdown", "ring_call_fwd_ms", "ring_call_ms", "heads_call_fwd_ms",
             "heads_call_ms", "recut_call_fwd_ms", "recut_call_ms"}
    assert links <= set(records[2, backend].measured)
    assert set(records[2, backend].measured) == set(cal.Rates.numbers())       # no rate left to the profile
    assert set(records[1, "none"].measured) == set(measure.KERNEL_RATES)


@pytest.mark.ranks
def test_calibrate_spec_under_torchrun_times_the_specs_ring_call(tmp_path):
    """`dilgen calibrate --spec` over two ranks: the record for two ranks holds the spec's rate on a
    rank's rows and its ring call's own factor (Rates.windows); one process's, its rate alone."""
    import torch

    import dilgen
    spec = dilgen.Spec(name="mine", num_heads=2, head_dim=16, segment_lengths=[16, 64], dilation_rates=[1, 2],
                       dtype="float32")
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(spec.to_json()))
    two = torch.cuda.device_count() >= 2
    env = dict(os.environ, DILGEN_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    if not two:
        env["CUDA_VISIBLE_DEVICES"] = ""              # one GPU or none: both ranks on the CPU
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "dilgen.cli", "calibrate", "--spec", str(path), "--seq-len", "128"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    records = {d["machine"]["world_size"]: cal.Rates.from_json(d["rates"])
               for d in (json.loads(p.read_text()) for p in (tmp_path / "cache" / "calibration").iterdir())}
    digest = cal.spec_digest(spec.to_json())
    assert set(records) == {1, 2} and all(r.for_spec(digest) for r in records.values()), records
    assert records[1].windows == ()
    if two:     # 128 rows on two GPUs: the call's floor binds, so no factor is fitted, or one inside the bracket
        assert records[2].windows == () or 0.25 < records[2].window_for(digest) < 8.0, records[2]
    else:       # the interpreter takes far longer than GPU rates price: the factor at the bracket's top
        assert [d for d, _ in records[2].windows] == [digest], records[2]
        assert records[2].window_for(digest) == pytest.approx(8.0, rel=1e-6)


def test_explain_forecasts_every_gpu_count_with_the_rates_it_names(fresh, capsys):
    from dilgen.cli import main
    spec = ROOT / "examples" / "specs" / "longnet_base.json"
    assert main(["explain", str(spec), "--ring", "4", "--seq-len", "262144"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and "GiB" in line]
    assert [r[0] for r in rows] == ["1", "2", "4"], out
    assert rows[0][1:3] == ["single", "device"] and rows[0][-3] == "1.00", out
    assert "the committed 4 x H200 profile" in out
    from dilgen import forecast
    spec_obj = __import__("dilgen").load_spec(spec)
    assert forecast.call_bytes(spec_obj, 262144, 2) * 2 == forecast.call_bytes(spec_obj, 262144, 1)
    measure.calibrate(None)                                       # a record for one process
    assert main(["explain", str(spec), "--ring", "1", "--seq-len", "262144"]) == 0
    out = capsys.readouterr().out
    assert "this machine's calibration, the family rates for this spec" in out, out
    # a spec measured by `calibrate --spec` (its rate; over P ranks, its ring call's factor too)
    digest = cal.spec_digest(spec_obj.to_json())
    machine = cal.Machine.current(2, "nccl")
    cal.store(machine, dataclasses.replace(cal.DEFAULT, specs=((digest, 400.0, 3.0),), windows=((digest, 1.5),),
                                           measured=("window_tflops",)))
    assert main(["explain", str(spec), "--ring", "2", "--seq-len", "262144"]) == 0
    out = capsys.readouterr().out
    assert "with this spec's own single-device rate and ring factor" in out, out


def test_a_factor_is_fitted_where_the_model_meets_the_measured_time():
    assert abs(measure._fit(lambda x: 3.0 * x + 1.0, 7.0) - 2.0) < 1e-6
    assert measure._window_factor(lambda x: 2.0 * x, 3.0) == pytest.approx(1.5, abs=1e-6)
    assert measure._window_factor(lambda x: max(1.0, 2.0 * x), 0.9) is None      # the floor binds
    assert measure._fit(lambda x: x, 100.0) == pytest.approx(8.0, abs=1e-6)     # clamped to the bracket


def test_no_rate_is_priced_without_a_rates_object():
    """The model's numbers live in Rates only: schedule keeps none of its own, and every
    function that prices takes its rates with no default."""
    import inspect
    assert not hasattr(schedule, "RATES")
    for fn in (schedule.transport_costs, schedule.transport_times, schedule.choose_transport,
               schedule.single_device_times):
        assert inspect.signature(fn).parameters["rates"].default is inspect.Parameter.empty, fn.__name__


# the committed profile's choices at bench_ring sizes (moved with the model from test_ring.py)
def _costs(P, T, w, r, heads=(16, 16), hilbert=None, causal=False, rates=cal.DEFAULT):
    """The cost model at a bench_ring size (bf16, D 128) and its pick."""
    import types

    import dilgen
    from dilgen.planner import plan
    from dilgen.targets import get_target
    spec = dilgen.Spec(name="costs", num_heads=heads[0], num_kv_heads=heads[1], head_dim=128, dtype="bfloat16",
                       segment_lengths=w, dilation_rates=r, causal=causal, ring_size=P, hilbert=hilbert)
    dilgen.Kernel(spec)          # a Kernel in the process: the single-device twins can be built
    attn = types.SimpleNamespace(spec=spec.to_json(), plan=plan(spec, get_target("sm90")).to_json())
    from dilgen.runtime.ring.costs import call_costs
    sched = schedule.ring_schedule(attn.plan["ring"], T * P, "zigzag" if causal else "contiguous")
    costs = call_costs(attn, sched, 1, heads[0], heads[1], 128, 2, rates=rates)
    return costs, schedule.pick_transport(costs)


def test_cost_model_picks_per_pattern():
    ws, rs = [2048, 8192, 32768, 131072, 524288, 1048576], [1, 2, 4, 8, 16, 32]
    # every segment inside a rank: no transfer at all, the single-device kernels on its rows
    assert _costs(4, 262144, ws[:4], rs[:4], hilbert={"scope": "segment"})[1] == "local"
    # Hilbert tiles spanning ranks: a ring window walks whole segments of rows it mostly
    # does not keep (measured 0.04 strong scaling at P = 4); head shards run the lanes
    costs, pick = _costs(4, 262144, ws, rs, hilbert={"scope": "segment"})
    assert pick == "heads" and costs["ring"]["fwd_bwd_s"] > 10 * costs["heads"]["fwd_bwd_s"]
    # GQA with fewer kv heads than ranks cannot take head shards
    assert "heads" not in _costs(4, 262144, ws, rs, heads=(16, 2))[0]
    # tiny problems: latency decides, one collective beats the steps
    assert _costs(4, 256, [16, 1024], [1, 4])[1] == "allgather"
    # the ring_users specs: LongNet's five branches, the last crossing the ranks, split (hybrid);
    # segments straddling the border, short against a rank's rows, re-cut (recut)
    assert _costs(2, 262144, [2048, 8192, 32768, 131072, 524288], [1, 2, 4, 8, 16])[1] == "hybrid"
    assert _costs(2, 100_000, [1000, 48000], [1, 5])[1] == "recut"


def test_no_call_is_priced_below_its_hosts_measured_time():
    """Rates.<transport>_call_fwd_ms / _call_ms: the least one call takes (its host's time, timed
    by calibrate on a few rows first): a transport's price is at least that ("allgather" and
    "hybrid" the ring's), and never for "local"; above it the kernels and links decide."""
    ws, rs = [2048, 8192, 32768, 131072, 524288], [1, 2, 4, 8, 16]
    slow_host = dataclasses.replace(cal.DEFAULT, ring_call_fwd_ms=1000.0, ring_call_ms=3000.0, heads_call_fwd_ms=7e3,
                                    heads_call_ms=7e4, recut_call_fwd_ms=11e3, recut_call_ms=11e4)
    for w, r, floor in ((ws, rs, {"ring": (1, 3), "allgather": (1, 3), "hybrid": (1, 3), "heads": (7, 70)}),
                        ([1000, 48000], [1, 5], {"recut": (11, 110), "ring": (1, 3)})):
        base, slow = (_costs(2, 131072, w, r, rates=x)[0] for x in (cal.DEFAULT, slow_host))
        for t, (f, fb) in floor.items():
            assert (slow[t]["fwd_s"], slow[t]["fwd_bwd_s"]) == pytest.approx((f, fb)), t
            assert base[t]["fwd_s"] < f and base[t]["fwd_bwd_s"] < fb, t
    big = _costs(2, 131072, ws, rs, rates=dataclasses.replace(cal.DEFAULT, ring_call_ms=1e-3))[0]
    assert big["ring"] == _costs(2, 131072, ws, rs)[0]["ring"]          # far above the floor: the kernels'
    local = [_costs(2, 262144, ws[:3], rs[:3], rates=x)[0]["local"] for x in (cal.DEFAULT, slow_host)]
    assert local[0] == local[1]
    specs = measure._ring_specs(2, dict(B=1, H=16, N=32768, D=128))
    calls = [(s["name"], n, [t for t, f in fits]) for s, _, n, fits in specs if all(f is None for _, f in fits)]
    assert calls == [("calibrate_call_2", 2048, ["ring", "heads"]), ("calibrate_recut_2", 2048, ["recut"])]
    from dilgen.schedule import recut_pieces
    recut = next(s for s, *_ in specs if s["name"] == "calibrate_recut_2")
    assert recut_pieces({"ring_size": 2, "causal": False, "branches": [{"w": 768, "r": 1}]}, 2048) is not None
    assert recut["segment_lengths"] == [768]


def test_a_spec_measured_by_calibrate_prices_its_ring_calls_and_a_full_calibration_keeps_it(fresh, monkeypatch):
    """`dilgen calibrate --spec`: the spec's own single-device rate (forward TFLOP/s, backward over
    forward) is kept in the machine's record under the spec's digest (name and ring size aside), and
    replaces the family rates for that spec only; the record's key follows it."""
    import dilgen
    spec = dilgen.Spec(name="measured", num_heads=2, head_dim=16, segment_lengths=[16, 32], dilation_rates=[1, 2])
    monkeypatch.setattr(measure, "measure_spec", lambda spec, n, device, **kw: (123.0, 2.0) if n == 64 else (1.0, 1.0))
    entries = measure.calibrate_specs([spec], 64)
    digest = cal.spec_digest(spec.replace(ring_size=2, name="another_name").to_json())
    assert entries == [(digest, 123.0, 2.0)]
    monkeypatch.setattr(cal, "_MEMO", {})
    rates = cal.rates_for(1, "none")
    assert rates.for_spec(digest) == (123.0, 2.0) and rates.key() != cal.DEFAULT.key()
    assert rates.for_spec(cal.spec_digest(spec.replace(causal=True).to_json())) is None
    # priced by it: one device, and "local" on a ring (flops / rate, backward 2 x)
    ring = {"causal": False, "branches": [{"w": 16, "r": 1}, {"w": 32, "r": 2}]}
    flops = schedule.useful_flops(ring, 128, 1, 2, 16)
    assert schedule.single_device_times(ring, 128, 1, 2, 16, False, rates, rates.for_spec(digest)) == \
        pytest.approx((flops / 123e12, 2 * flops / 123e12))
    # a ring call of that spec (at another name and ring size) is priced by it too
    ring_spec = dilgen.Spec(name="costs", num_heads=16, head_dim=128, dtype="bfloat16", segment_lengths=[16, 32],
                            dilation_rates=[1, 2], ring_size=2)
    spec_rates = dataclasses.replace(cal.DEFAULT, specs=((cal.spec_digest(ring_spec.to_json()), 50.0, 3.0),))
    local = _costs(2, 64, [16, 32], [1, 2], rates=spec_rates)[0]["local"]
    f = schedule.useful_flops(ring, 128, 1, 16, 128) / 50e12 / 2
    assert local["fwd_s"] == pytest.approx(f) and local["fwd_bwd_s"] == pytest.approx(4 * f)
    assert _costs(2, 64, [16, 32], [1, 2])[0]["local"]["fwd_s"] != pytest.approx(f)   # the family rate otherwise
    # the model's answer names what priced it (bench_ring keeps it beside each row)
    import types

    from dilgen.planner import plan
    from dilgen.runtime.ring.costs import predicted_ms
    from dilgen.targets import get_target
    attn = types.SimpleNamespace(spec=ring_spec.to_json(), plan=plan(ring_spec, get_target("sm90")).to_json())
    measured = dataclasses.replace(spec_rates, link_gbytes_s=99.0, measured=("link_gbytes_s",))
    priced = predicted_ms(attn, 128, "local", rates=measured)["priced_with"]
    assert priced == {"source": cal.DEFAULT.source, "measured": {"link_gbytes_s": 99.0}, "spec_rate": [50.0, 3.0],
                      "spec_ring_overhead": None}
    assert predicted_ms(attn, 128, "local", rates=cal.DEFAULT)["priced_with"]["spec_rate"] is None
    # a full calibration keeps the measured specs; a later --spec replaces only that spec's entry
    again = measure.calibrate(None)
    assert again.for_spec(digest) == (123.0, 2.0)
    monkeypatch.setattr(measure, "measure_spec", lambda spec, n, device, **kw: (7.0, 3.0))
    measure.calibrate_specs([spec], 64)
    monkeypatch.setattr(cal, "_MEMO", {})
    assert cal.rates_for(1, "none").for_spec(digest) == (7.0, 3.0) and len(cal.rates_for(1, "none").specs) == 1
    with pytest.raises(ValueError, match="specs"):
        cal.Rates(specs=(("x", -1.0, 2.0),))


def test_calibrate_spec_over_ranks_keeps_a_ranks_rate_and_one_process_rate_at_the_whole_length(fresh, monkeypatch):
    """Under P ranks, the record for P ranks takes the spec's rate on a rank's rows (seq_len / P),
    the record for one process its rate on all seq_len rows, or a rank's where a rank cannot
    run them (every rank alike: a failure travels in the all_reduce)."""
    import torch.distributed as dist

    import dilgen
    spec = dilgen.Spec(name="ranks", num_heads=2, head_dim=16, segment_lengths=[16, 32], dilation_rates=[1, 2])
    for name, value in (("is_initialized", lambda: True), ("get_world_size", lambda group=None: 2),
                        ("get_backend", lambda group=None: "gloo"), ("all_reduce", lambda *a, **k: None)):
        monkeypatch.setattr(dist, name, value)       # a world of 2 whose other rank agrees with this one
    rates = {(32, True): (100.0, 3.0), (64, False): (150.0, 2.5)}   # a rank's kernels on its rows; the spec's own on all
    monkeypatch.setattr(measure, "measure_spec", lambda spec, n, device, as_rank: rates[n, as_rank])
    digest = cal.spec_digest(spec.to_json())
    timed = []           # the spec's ring call over the two ranks, priced with its rate on a rank's rows
    monkeypatch.setattr(measure, "window_entry", lambda spec, n, group, device, priced: timed.append(
        (n, priced.for_spec(digest))) or (digest, 1.7))
    assert measure.calibrate_specs([spec], 64) == [(digest, 100.0, 3.0)]
    records = lambda: {P: cal.load(cal.Machine.current(P, "gloo" if P == 2 else "none")).for_spec(digest)  # noqa: E731
                       for P in (2, 1)}
    assert records() == {2: (100.0, 3.0), 1: (150.0, 2.5)} and timed == [(64, (100.0, 3.0))]
    windows = lambda: {P: cal.load(cal.Machine.current(P, "gloo" if P == 2 else "none")).windows  # noqa: E731
                       for P in (2, 1)}
    assert windows() == {2: ((digest, 1.7),), 1: ()}          # a ring's factor: the P ranks' record only
    def too_big(spec, n, device, as_rank):
        if n == 64:
            raise MemoryError("64 rows do not fit")
        return rates[n, as_rank]
    monkeypatch.setattr(measure, "measure_spec", too_big)
    measure.calibrate_specs([spec], 64)
    assert records() == {2: (100.0, 3.0), 1: (100.0, 3.0)}
    def nothing_fits(spec, n, device, **kw):
        raise MemoryError("none")
    monkeypatch.setattr(measure, "measure_spec", nothing_fits)
    with pytest.raises(RuntimeError, match="calibrating ranks on 32 rows failed on a rank: none"):
        measure.calibrate_specs([spec], 64)


def test_dilgen_calibrate_spec_measures_the_spec_on_this_device(fresh, tmp_path, capsys):
    import dilgen
    from dilgen.cli import main
    path = tmp_path / "mine.json"
    spec = dilgen.Spec(name="mine", num_heads=2, head_dim=16, segment_lengths=[16, 32], dilation_rates=[1, 2],
                       dtype="float32")
    path.write_text(json.dumps(spec.to_json()))
    assert main(["calibrate", "--spec", str(path), "--seq-len", "64"]) == 0
    assert "mine:" in capsys.readouterr().out
    fwd, ratio = cal.rates_for(1, "none").for_spec(cal.spec_digest(spec.to_json()))
    assert fwd > 0 and ratio > 0
    with pytest.raises(SystemExit, match="--seq-len"):
        main(["calibrate", "--spec", str(path)])


def test_a_spec_whose_ring_call_was_timed_prices_its_windows_by_its_own_factor():
    """Rates.windows: a spec's own ring_overhead (calibrate.window_entry) replaces the family's in
    that spec's "ring", "allgather" and "hybrid" prices only; records without one keep their key."""
    import dilgen
    spec = dilgen.Spec(name="costs", num_heads=16, num_kv_heads=16, head_dim=128, dtype="bfloat16",
                       segment_lengths=[4096, 65536], dilation_rates=[1, 4], ring_size=2)
    digest = cal.spec_digest(spec.to_json())
    base = dataclasses.replace(cal.DEFAULT, ring_call_ms=1e-3, ring_call_fwd_ms=1e-3)      # no floor binds
    slow = dataclasses.replace(base, windows=(("another spec", 0.5), (digest, 3 * base.ring_overhead)))
    (plain, _), (own, _) = (_costs(2, 32768, [4096, 65536], [1, 4], rates=r) for r in (base, slow))
    for t in ("ring", "allgather", "hybrid"):
        assert own[t]["fwd_bwd_s"] > plain[t]["fwd_bwd_s"], t
    for t in set(plain) - {"ring", "allgather", "hybrid"}:
        assert own[t] == plain[t], t
    assert slow.window_for(digest) == 3 * base.ring_overhead and base.window_for(digest) is None
    assert cal.Rates.from_json(json.loads(json.dumps(slow.to_json()))) == slow
    assert slow.key() != base.key() == dataclasses.replace(base, windows=()).key()
    old_record = {k: v for k, v in base.to_json().items() if k != "windows"}       # before Rates.windows
    assert cal.Rates.from_json(old_record) == base
    for bad in ((digest,), (digest, 0.0), (digest, float("nan")), (1, 2.0), (digest, True)):
        with pytest.raises(ValueError, match="windows"):
            cal.Rates(windows=(bad,))
    with pytest.raises(ValueError, match="windows"):
        cal.Rates.from_json(dict(base.to_json(), windows="x"))


def test_a_rank_is_timed_on_its_kernels_and_one_process_on_the_specs_own(monkeypatch):
    """measure_spec: a ring rank's rows of a sequence-scope curve arrive in curve order, so its
    kernels are the raster twin's; one device runs the spec's own, curve table and all."""
    import dilgen
    import dilgen.compiler
    spec = dilgen.Spec(name="curve", num_heads=2, head_dim=16, segment_lengths=[16, 64], dilation_rates=[1, 2],
                       hilbert={"scope": "sequence", "grid": [8, 8]}, ring_size=2)
    compiled = []
    class Stop(Exception):
        pass
    def compile_(s):
        compiled.append(s)
        raise Stop
    monkeypatch.setattr(dilgen.compiler, "compile", compile_)
    for as_rank in (True, False):
        with pytest.raises(Stop):
            measure.measure_spec(spec, 64, None, as_rank=as_rank)
    assert [s.hilbert for s in compiled] == [None, spec.hilbert] and {s.ring_size for s in compiled} == {1}


def test_a_specs_backward_is_timed_on_fresh_gradients(monkeypatch):
    """measure_spec's fwd+bwd calls start with no gradient, as bench_ring's and a training
    step's do: accumulating into the last call's would time an add per tensor on top."""
    import torch
    import dilgen
    import dilgen.compiler
    spec = dilgen.Spec(name="fresh", num_heads=2, head_dim=16, segment_lengths=[16, 64], dilation_rates=[1, 2])
    seen = []

    def kernel(q, k, v):
        seen.append((torch.is_grad_enabled(), q.grad is None and k.grad is None and v.grad is None))
        return q * k.sum() * v.sum()
    monkeypatch.setattr(dilgen.compiler, "compile", lambda s: kernel)
    measure.measure_spec(spec, 64, torch.device("cpu"), reps=3)
    backward_calls = [fresh for grad, fresh in seen if grad]
    assert len(backward_calls) == 4 and all(backward_calls)     # a warm-up and 3 timed


def test_a_spec_ring_call_is_timed_back_to_back():
    """stats.loop_seconds (window_entry's clock): one warm-up, then a fixed count of calls with
    one sync at their end, as a training step's calls run (and every rank the same count)."""
    from dilgen.stats import loop_seconds
    seen = []
    took = loop_seconds(lambda: seen.append("call"), lambda: seen.append("sync"), 4)
    assert seen == ["call", "sync"] + ["call"] * 4 + ["sync"] and took >= 0
