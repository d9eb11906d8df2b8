"""The ring cost model's rates: what they are, where they come from, which a call uses.

schedule.transport_costs prices a ring call from a `Rates`: the useful TFLOP/s of the kernel
families (the single-device fused kernels, the lane kernels, a ring window), each pass's
backward over its forward, what a ring call and a head-parallel call add over their kernels,
the least time one call of each transport takes (its host issuing it), and the links (a P2P
ring shift, an all-gather's received bytes, an all-to-all's sent bytes, in GB/s; a step's
latency in µs).

`DEFAULT` is the profile committed in bench/results (4 x H200, ring_profile-2026-11-27-p4.json
and ring-2026-11-27.json). A calibration measures on this machine what it can (the links over
the group; the single-device rates, fused and lanes, forward and backward; a window's rate as
the fused kernel's on one rank's rows) and keeps the measured fields in the cache, keyed by
`Machine` (GPU, capability, CUDA and driver, torch, Triton, backend, world size, the templates'
hash): a kernel change, a new driver, GPU or group size each make a new key, and the old record
is never read again (the measuring is dilgen/calibrate.py's). `rates_for(P)` is what the
runtime prices with: the record of this machine, else DEFAULT; the ring's agreement compares
its digest across ranks, so ranks pricing with different rates (a node calibrated, another
not) are refused in one line, never left to choose different transports.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
from dataclasses import dataclass, fields

from . import cache

DEFAULT_SOURCE = ("profile of 4 x H200, bench/results/ring_profile-2026-11-27-p4.json and "
                  "ring-2026-11-27.json, each call's floor from 2 x H200, calibration-2026-11-30-h200x2.json "
                  "(not measured on this machine: `dilgen calibrate`)")


@dataclass(frozen=True)
class Rates:
    """The cost model's numbers (schedule.transport_costs says where each enters).

    The defaults were fitted on 4 x H200 (torch 2.11, Triton 3.6) from kernel times per rank
    over useful FLOPs: a ring window (the fused kernel on a window's rows: raster 298, causal
    GQA 278), the single-device kernels a "local" or "heads" call runs (fused raster 308; the
    lane kernels, which Hilbert segment and causal specs take on one device, 475-512);
    backward over forward (raster windows 3.0, causal windows 3.2, windows through a curve
    table 1.39 (their forward runs rows the dK/dV kernels skip), single device 3.05-3.15,
    causal lanes 4.0); a ring call over its per-step kernels (idle steps, merges, fills:
    1.04); the head-parallel call's kernels on H/(P C) heads beside its all-to-alls (1.10
    fused, 1.06 lanes; the all-to-alls are counted whole); the links at 1 GiB per rank. The
    floors under a call (*_call_fwd_ms, *_call_ms) come from a calibration of 2 x H200."""
    window_tflops: float = 298.0          # a ring window: the fused kernel on the window's rows
    twin_fused_tflops: float = 308.0      # one device, the fused kernels (raster)
    twin_lanes_tflops: float = 490.0      # one device, the lane kernels (causal, curve tables)
    window_bwd: float = 3.0               # backward / forward, raster windows
    causal_window_bwd: float = 3.2
    table_window_bwd: float = 1.39        # windows read through a curve table
    twin_bwd: float = 3.1
    twin_causal_bwd: float = 4.0
    ring_overhead: float = 1.04           # a ring call over its per-step kernels
    heads_fused_slowdown: float = 1.10    # the head-parallel call's kernels on H / P heads
    heads_lanes_slowdown: float = 1.06
    link_gbytes_s: float = 357.0
    allgather_gbytes_s: float = 338.0
    alltoall_gbytes_s: float = 334.0
    step_latency_us: float = 30.0
    # the least one eager call of a transport takes, forward and fwd+bwd, in ms: its host issues
    # the pieces' kernels, copies and transfers one by one and its agreement reads the group's
    # fingerprints, timed on a few rows where the kernels take microseconds; a call's price is at
    # least this ("hybrid" and "allgather" calls: the ring's; "local": its kernels alone)
    ring_call_fwd_ms: float = 1.06        # 2 x H200, calibration-2026-11-30-h200x2.json (c5a54f2)
    ring_call_ms: float = 4.14
    heads_call_fwd_ms: float = 6.26
    heads_call_ms: float = 12.33
    recut_call_fwd_ms: float = 1.19
    recut_call_ms: float = 4.18
    source: str = DEFAULT_SOURCE
    measured: tuple[str, ...] = ()        # the fields this machine's calibration measured
    # specs measured by `dilgen calibrate --spec`: (spec_digest, forward TFLOP/s, backward over
    # forward) of each spec's single-device kernels, which then replace the family rates for it
    specs: tuple[tuple[str, float, float], ...] = ()
    # (spec_digest, ring_overhead) of a spec whose ring call `dilgen calibrate --spec` timed over
    # P ranks: its window kernels' own factor, in place of ring_overhead (fitted on the family's
    # fit spec) for that spec's "ring", "allgather" and "hybrid" prices
    windows: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        for name in self.numbers():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"Rates.{name} = {value!r}: a rate is a finite number > 0")
        unknown = [m for m in self.measured if m not in self.numbers()]
        if unknown:
            raise ValueError(f"Rates.measured names {unknown}, not rates of the model")
        if not isinstance(self.source, str):
            raise ValueError("Rates.source must be a string")
        for entry in self.specs:
            if not (isinstance(entry, tuple) and len(entry) == 3 and isinstance(entry[0], str)
                    and all(not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) and x > 0
                            for x in entry[1:])):
                raise ValueError(f"Rates.specs entry {entry!r}: (spec digest, TFLOP/s > 0, backward ratio > 0)")
        for entry in self.windows:
            if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)
                    and not isinstance(entry[1], bool) and isinstance(entry[1], (int, float))
                    and math.isfinite(entry[1]) and entry[1] > 0):
                raise ValueError(f"Rates.windows entry {entry!r}: (spec digest, ring_overhead > 0)")

    @staticmethod
    def numbers() -> tuple[str, ...]:
        return tuple(f.name for f in fields(Rates) if f.name not in ("source", "measured", "specs", "windows"))

    def for_spec(self, digest: str) -> tuple[float, float] | None:
        """(forward TFLOP/s, backward over forward) measured for the spec of this digest, or None."""
        return next(((f, b) for d, f, b in self.specs if d == digest), None)

    def window_for(self, digest: str) -> float | None:
        """The ring_overhead measured for the spec of this digest (its own ring call), or None."""
        return next((x for d, x in self.windows if d == digest), None)

    def to_json(self) -> dict:
        return {**{n: getattr(self, n) for n in self.numbers()}, "source": self.source,
                "measured": list(self.measured), "specs": [list(e) for e in self.specs],
                "windows": [list(e) for e in self.windows]}

    @classmethod
    def from_json(cls, data) -> "Rates":
        """The Rates a record holds (ValueError when it is not one: a corrupt record)."""
        if not isinstance(data, dict) or set(data) - {*cls.numbers(), "source", "measured", "specs", "windows"}:
            raise ValueError("not a Rates record")
        measured, specs, windows = data.get("measured", []), data.get("specs", []), data.get("windows", [])
        if not isinstance(measured, list) or not all(isinstance(m, str) for m in measured):
            raise ValueError("Rates.measured must be a list of names")
        if not isinstance(specs, list) or not all(isinstance(e, list) for e in specs):
            raise ValueError("Rates.specs must be a list of [digest, TFLOP/s, ratio]")
        if not isinstance(windows, list) or not all(isinstance(e, list) for e in windows):
            raise ValueError("Rates.windows must be a list of [digest, ring_overhead]")
        return cls(**{**data, "measured": tuple(measured), "specs": tuple(tuple(e) for e in specs),
                      "windows": tuple(tuple(e) for e in windows)})

    def key(self) -> str:
        """A stable digest of the numbers (what the ring's agreement compares)."""
        return _rates_key(self)


@functools.lru_cache(maxsize=64)      # every ring call asks (the agreement, the costs)
def _rates_key(rates: Rates) -> str:
    text = json.dumps({**{n: float(getattr(rates, n)) for n in rates.numbers()},
                       "specs": sorted([d, float(f), float(b)] for d, f, b in rates.specs),
                       **({"windows": sorted([d, float(x)] for d, x in rates.windows)} if rates.windows else {})},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


DEFAULT = Rates()


def spec_digest(spec: dict) -> str:
    """What a spec's measured rate is kept under: the spec without its name and ring size (the
    single-device kernels a ring call of it runs are those of its ring_size 1 twin)."""
    fields_ = {k: v for k, v in spec.items() if k not in ("name", "ring_size")}
    return hashlib.sha256(json.dumps(fields_, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Machine:
    """What a calibration holds for: change any field and the record is another's."""
    device: str
    capability: tuple[int, ...]
    cuda: str
    driver: str
    torch: str
    triton: str
    backend: str
    world_size: int
    templates: str

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"Machine.world_size = {self.world_size!r}: a positive int")

    def key(self) -> str:
        return _machine_key(self)

    @classmethod
    def current(cls, world_size: int, backend: str = "nccl", device=None) -> "Machine":
        import torch
        import triton

        from .codegen import template_hash
        if device is None and torch.cuda.is_available():        # this process's GPU
            device = torch.device("cuda", torch.cuda.current_device())
        if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
            index = torch.device(device).index
            index = torch.cuda.current_device() if index is None else index
            name = torch.cuda.get_device_name(index)
            cap = tuple(torch.cuda.get_device_capability(index))
        else:
            name, cap = "cpu (Triton's interpreter)", ()
        return cls(device=name, capability=cap, cuda=str(torch.version.cuda), driver=_driver(),
                   torch=torch.__version__, triton=triton.__version__, backend=backend,
                   world_size=int(world_size), templates=template_hash())


@functools.lru_cache(maxsize=64)
def _machine_key(machine: Machine) -> str:
    text = json.dumps(dataclasses.asdict(machine), sort_keys=True)
    return "calib-" + hashlib.sha256(text.encode()).hexdigest()[:24]


def _driver() -> str:
    """The NVIDIA driver's version line (Linux), or "none"."""
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as fh:
            return " ".join(fh.readline().split()[-4:]) or "none"
    except OSError:
        return "none"


# --------------------------------------------------------------------------- records

_MEMO: dict[tuple, Rates] = {}          # (machine key, DILGEN_CACHE_DIR) -> the rates read there
_MACHINES: dict[tuple, Machine] = {}    # (world size, backend, device) -> this process's Machine


def load(machine: Machine) -> Rates | None:
    """This machine's calibration, or None (none yet, another machine's, or corrupt)."""
    return cache.load_record("calibration", machine.key(), lambda data: Rates.from_json(data["rates"]))


def store(machine: Machine, rates: Rates) -> None:
    """Keep `rates` as this machine's calibration (the cache, and this process's memory)."""
    cache.store_record("calibration", machine.key(), {"rates": rates.to_json(), "machine": dataclasses.asdict(machine)})
    _MEMO[machine.key(), os.environ.get("DILGEN_CACHE_DIR", "")] = rates


def remember(machine: Machine, rates: Rates) -> None:
    """Price with `rates` on this machine for the rest of this process, keeping no record (a
    ring call's own measurement: every rank of a job holds it alike, and a later job on other
    nodes measures again rather than meet records that differ by node)."""
    _MEMO[machine.key(), os.environ.get("DILGEN_CACHE_DIR", "")] = rates


def rates_for(world_size: int, backend: str | None = None, device=None) -> Rates:
    """The rates a ring call of `world_size` ranks prices with: this machine's calibration,
    else DEFAULT (read once per process and machine key). backend: the group's (default
    "nccl"; one process: "none"); device: the call's (default this process's GPU, if any)."""
    backend = backend or ("none" if world_size == 1 else "nccl")
    where = (world_size, backend, None if device is None else str(device))
    if where not in _MACHINES:
        _MACHINES[where] = Machine.current(world_size, backend, device)
    key = (_MACHINES[where].key(), os.environ.get("DILGEN_CACHE_DIR", ""))     # as configured: cheap
    if key not in _MEMO:
        _MEMO[key] = load(_MACHINES[where]) or DEFAULT
    return _MEMO[key]
