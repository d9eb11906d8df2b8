"""What each architecture can do, and the block choices the planner starts from.

Standard library only. A Target is frozen data with a stable key, like Triton's
GPUTarget: codegen reads its flags, the planner reads its block table.
"""
from __future__ import annotations

import hashlib
import json
import re
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    name: str                 # "sm90", "sm80", "interpreter"
    capability: int | None    # CUDA compute capability as 90, 80; None for the interpreter
    smem_bytes: int           # shared memory per block the tiles may use
    max_block_m: int
    tensor_descriptors: bool  # TMA (sm90): descriptor loads in the forward and lane kernels

    def key(self) -> str:
        blob = json.dumps(self.__dict__, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def block_table(self, head_dim: int, itemsize: int, causal: bool = False,
                    descriptors: bool = False) -> tuple[int, int, int, int]:
        """(block_m, block_n, num_warps, num_stages) before lattice constraints. The sm90
        rows are the autotune winners on an H200 (2026-11-21; bench_forward.py --tunings re-times them):
        causal prefers 64-row tiles, whose lattice span is shorter, so fewer keys past
        the diagonal are visited. descriptors: the fused kernel reads keys through tensor
        descriptors (fused_tma), which take 128 keys per step at head_dim 128 (H200, bf16,
        forward: A 2.06 -> 1.86 ms, B 9.75 -> 8.98; head_dim 64 (C) keeps 64: 1.26 against
        1.62 ms; 128 x 128 with 2 stages: A 2.17 ms; 4 stages exceed shared memory)."""
        if descriptors and self.capability is not None and self.capability >= 90 \
                and head_dim == 128 and itemsize == 2 and not causal:
            return (128, 128, 8, 3)
        if self.name == "interpreter":
            # The interpreter runs each tile op in numpy: fewer, larger tiles run faster,
            # but tests use short sequences, so keep tiles small enough to cover them.
            return (16, 16, 1, 1)
        if self.capability is not None and self.capability >= 90:
            table = {16: (128, 64, 4, 3), 32: (128, 64, 8, 3), 64: (128, 64, 8, 3),
                     128: (128, 64, 8, 3), 256: (64, 64, 8, 2)}
        else:
            table = {16: (128, 64, 4, 3), 32: (128, 64, 4, 3), 64: (128, 64, 4, 3),
                     128: (128, 32, 8, 3), 256: (64, 32, 8, 2)}
        bm, bn, warps, stages = table[head_dim]
        if causal and head_dim <= 128:
            bm, bn, warps, stages = 64, 64, 4, 3
        if itemsize == 4:             # fp32 tiles are twice as large
            bm, bn, stages = max(bm // 2, 32), max(bn // 2, 32), max(stages - 1, 1)
        return (bm, bn, warps, stages)


    def backward_table(self, head_dim: int, itemsize: int, causal: bool = False
                       ) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
        """Backward tiles before lattice constraints: dkdv (keys per program, queries per
        step, warps, stages) and dq (largest query rows, keys per step, warps, stages).
        GPU rows: the fastest of sweeps on an H200 (bench/results/tune_backward-2026-11-21-h200.json;
        bench_backward.py --tunings '{"name": {"bwd_kv": [...]}}' re-times such tiles)."""
        if self.name == "interpreter":
            return (16, 16, 1, 1), (16, 16, 1, 1)
        table = {16: ((128, 32, 4, 3), (128, 64, 4, 3)), 32: ((128, 32, 4, 3), (128, 64, 4, 3)),
                 64: ((64, 32, 4, 3), (128, 64, 4, 3)), 128: ((64, 32, 4, 3), (128, 64, 8, 3)),
                 256: ((32, 32, 4, 2), (64, 16, 4, 2))}
        kv, dq = table[head_dim]
        if causal and head_dim == 128:
            # causal A (H200, bench/results/tune_backward-*.json): dq 64 x 32 keys, 4 warps: 5.0 ms
            # backward against 6.5 ms with 64 keys and 8 warps
            dq = (64, 32, 4, 3)
        if causal and head_dim == 64 and self.capability is not None and self.capability >= 90:
            # causal C, per-branch dK/dV (H200, fwd+bwd): 128 keys per program 4.01 ms against
            # 4.15 with 64, 4.24 with 64 x 64 (bench/results/lanes_probe-*.json, s13_bwd_ws_causal_tiles)
            kv = (128, 32, 4, 3)
        if itemsize == 4:             # fp32 tiles are twice as large: no multi-buffering
            kv, dq = kv[:3] + (1,), dq[:3] + (1,)
        return kv, dq

    def lane_table(self, head_dim: int, itemsize: int, causal: bool = False
                   ) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
        """Tiles of the lane kernels (one branch, query tiles along its kept lanes):
        forward (rows, keys, warps, stages) and dq. A lane tile's causal diagonal is
        square, as in FlashAttention, so causal takes the non-causal tile."""
        if self.name == "interpreter":
            return (16, 16, 1, 1), (16, 16, 1, 1)
        if causal and self.lane_tma and itemsize == 2 and head_dim <= 128:
            # H200, every branch a lane branch, TMA + warp specialization: A causal
            # 1.29 ms with 128 x 128 against 1.42 with 128 x 64 (pointer loads: 1.43)
            _, dq = self.backward_table(head_dim, itemsize, causal)
            return (128, 128, 8, 3), dq
        fwd = self.block_table(head_dim, itemsize, causal=False)
        _, dq = self.backward_table(head_dim, itemsize, causal)
        return fwd, dq

    def decode_table(self, head_dim: int, itemsize: int) -> tuple[int, int, int, int]:
        """Incremental decoding (split kernel): (keys per step, largest split, warps,
        stages). Memory-bound, so sm80 and sm90 share the row; the interpreter takes small
        splits so that short test prefixes still span several programs."""
        if self.name == "interpreter":
            return (16, 32, 1, 1)
        if head_dim >= 256 or itemsize == 4:
            return (32, 1024, 4, 2)
        # H200, bf16, H 32/8, D 128, LongNet's five branches (bench/bench_decode.py --sweep,
        # bench/results/decode-2026-11-23-h200.json): batch 64 at 128K, split 2048 473 us
        # against 490 at 512; blocks of 32 or 64 keys, 2 or 4 warps, 2 or 3 stages within 4%.
        # The runtime halves the split for small batches (dilgen.runtime.decode.choose_split).
        return (64, 2048, 4, 3)

    # Causal: a lattice tile spans L*BLOCK_M positions, so its diagonal is L times wider
    # than a square one; lane tiles have square diagonals. On an H200 (bf16, forward):
    # causal A 1.60 -> 1.29 ms, B 6.35 -> 5.78, E 7.77 -> 6.20 with every branch a lane
    # branch and TMA + warp-specialized key loops (bench/results/lanes_probe-*.json).
    # The fused dkdv keeps its lattice up to L = 4 (A: 6.49 vs 6.97 ms fwd+bwd); above
    # it the per-branch dkdv wins (B: 32.5 vs 35.0 ms). sm90, since the per-branch dkdv
    # reads its query and dO lanes through descriptors (bwd_tma): the per-branch dkdv wins at
    # L = 4 too, its diagonal square where the lattice tile's is L times wider (H200, causal
    # fwd+bwd: C 4.69 -> 4.15 ms, A 5.90 -> 5.76; bench/results/lanes_probe-*.json, s13_causal_dkdv), so only an
    # L = 1 spec (one r = 1 branch, whose key tiles are raster tiles) keeps the fused one.
    causal_max_lattice: int = 4
    lane_tma: bool = False    # tensor-descriptor loads in causal lane kernels (KernelConfig)
    lane_ws: bool = False
    # the same descriptors in the dq lane kernel (tuning key lane_dq_tma): A causal fwd+bwd
    # 6.66 against 6.55 ms with pointer loads (H200, Triton 3.6); warp-specializing that loop
    # fails to compile there ("PassManager::run failed"), so it is off
    lane_dq_tma: bool = False
    # packed batches launch the lane kernels (forward and dq) on a grid with tiles fastest
    # (KernelConfig.lane_tiles_fastest, common.lane_program): on an H200 the packed causal
    # docs64 fwd+bwd (64 sequences, 1.3M rows, A's branches) ran 238.0 ms against 269.1 (one
    # sequence of the same length: 236.9). One sequence keeps (B*H, tiles, segments): A causal
    # forward 1.26 against 1.30 ms, D causal fwd+bwd 1.99 against 2.29 on tiles fastest. (The
    # illegal memory access first blamed on this grid was a 32-bit row offset in the lane
    # descriptors, past 2^31 elements; see tests/test_row_offsets.py.) On for sm90 (measured)
    lane_tiles_fastest: bool = False
    causal_lanes: bool = False  # causal specs run every branch as a lane branch
    # The fused forward kernel reads each raster branch's key lanes of a segment through
    # tensor descriptors (the lane kernels' 2-D box, row stride r*H_kv*D), non-causal, on one
    # device or in a ring's windows (KernelConfig.fused_tma; 2 x H200, 512K tokens: ring
    # fwd+bwd 378.0 -> 336.7 ms, strong scaling 0.85 -> 0.95). H200, bf16, forward with 128 keys per step: A 2.16 ->
    # 1.86 ms, B 10.17 -> 8.98, E 10.75 -> 9.34, C (64 keys) 1.30 -> 1.26; warp-specializing
    # the key loops changed nothing measurable (A 1.84, B 9.02), so it is off
    # (bench/results/lanes_probe-2026-11-23-h200.json, s10_fused_tma).
    fused_tma: bool = False
    # Scores leave the dot unscaled and softmax_scale*log2(e) enters exp2's argument as one
    # fused multiply-add (KernelConfig.fold_scale), as in FlashAttention: forward, H200, bf16,
    # fused kernel A/B/E 1-2% faster, causal lanes B 5.66 -> 5.59 ms, E 6.07 -> 5.99
    fold_scale: bool = False
    # The backward's raster branches read through the same descriptors (KernelConfig.bwd_tma):
    # the dq kernel its key lanes, the dK/dV kernels their query and dO lanes. H200, bf16,
    # fwd+bwd: A 8.72 -> 8.53 ms, C 5.43 -> 5.39, A causal 6.07 -> 5.93, B causal 25.76 ->
    # 25.57, D causal 2.07 -> 2.05; B non-causal unchanged (40.9); 128 keys per dq step
    # slower (A 8.75, C 5.88)
    bwd_tma: bool = False
    # L2 bytes the lattice kernels size their groups of tiles to (KernelConfig.l2_bytes,
    # runtime.lattice_group_tiles); None: one group (class-major)
    l2_bytes: int | None = None
    # Two chains per fused forward tile (KernelConfig.dual_chain) at these head dims, with
    # (warps, keys per step): H200, bf16, C forward 1.244 -> 1.192 ms with 4 warps and 128
    # keys (64 keys 1.33, 8 warps 2.57, 2 or 4 stages 1.29 / 1.90); head_dim 128 loses
    # (A 1.72 -> 2.26 at best; bench/results/issue33_dual_chain-2026-11-25-h200.json)
    dual_chain_head_dims: tuple[int, ...] = ()
    dual_chain_tile: tuple[int, int] = (4, 128)
    # The forward's lattice branches as one warp-specialized Gluon kernel (KernelConfig.gluon_fwd,
    # templates/gluon_fwd.py.jinja): (head_dim, keys per block, K/V stages) where this target can
    # run it, and the head dims where it is the default. H200, bf16, non-causal forward, back to
    # back: A 1.876 -> 1.635 ms, B 8.436 -> 7.287 (the classes of a tile launched side by side);
    # C (head_dim 64) 1.191 -> 1.140 with one exponential in 8 on the FMA pipe (gluon_exp2)
    # (bench/results/gluon_ncu_probe-2026-11-27-, forward_gluon_exp2-2026-11-28-h200.json)
    gluon_fwd_tiles: tuple[tuple[int, int, int], ...] = ()
    gluon_fwd_default: tuple[int, ...] = ()
    # The fused dK/dV as a warp-specialized Gluon kernel (KernelConfig.gluon_dkdv,
    # templates/gluon_bwd.py.jinja) at the head dims of gluon_fwd_tiles: the head dims where it
    # is the default and its Q/dO stages. H200, bf16, non-causal forward + backward: A 7.90 ->
    # 7.36 ms, B 36.66 -> 34.80, C (head_dim 64) 4.94 -> 4.70; 4 stages over 3: A 7.54 -> 7.42
    # (bench/results/backward_gluon_dkdv_default-, gluon_dkdv_stages-2026-11-28-h200.json)
    gluon_dkdv_default: tuple[int, ...] = ()
    gluon_dkdv_stages: int = 4
    # dQ as a warp-specialized Gluon kernel (KernelConfig.gluon_dq, templates/gluon_dq.py.jinja):
    # the head dims where it is the default and its K/V stages. H200, bf16, non-causal forward +
    # backward: A 7.70 -> 7.49 ms, B 34.94 -> 33.68; C (head_dim 64) 4.63 -> 4.70, so head_dim
    # 64 keeps the `tl` dq (bench/results/backward_gluon_dq-2026-11-28-h200.json)
    gluon_dq_default: tuple[int, ...] = ()
    gluon_dq_stages: int = 4
    # A spec's lane branches as a warp-specialized Gluon kernel (KernelConfig.gluon_lanes,
    # templates/gluon_lanes.py.jinja) with the tile of gluon_fwd_tiles: the head dims where it
    # is the default. H200, bf16, causal forward: A 1.24 -> 1.01 ms, B 5.47 -> 4.48; C with
    # every branch as lanes (head_dim 64) 1.37 -> 1.03; E (r = 6, 12 keep the `tl` lane kernel
    # in the same call) 5.81 -> 5.18; D non-causal (no r = 1 branch) 0.49 -> 0.47
    # (bench/results/forward_gluon_lanes-, forward_gluon_lanes_tiles-, forward_mixed_lanes-,
    # forward_d_gluon_lanes-2026-11-28-h200.json)
    gluon_lanes_default: tuple[int, ...] = ()
    # A causal spec's per-branch dK/dV and lane dq as warp-specialized Gluon kernels
    # (KernelConfig.gluon_lanes_bwd, templates/gluon_lanes_bwd.py.jinja): the head dims where
    # they are the default, their stages, and whether the dK/dV is among them. H200, A causal
    # fwd+bwd 5.48 -> 4.67 ms (dK/dV 2.45 -> 2.19, dq 1.55 -> 1.21); C (head_dim 64) 3.70 -> 3.45
    # (bench/results/lanes_bwd_probe-, backward_gluon_lanes_hd64-2026-11-28-h200.json)
    gluon_lanes_bwd_default: tuple[int, ...] = ()
    # ... and where a non-causal plan with no r = 1 branch (config D) takes them in place of the
    # fused `tl` dK/dV: its per-branch dK/dV then holds queries along rows and spills nothing,
    # D fwd+bwd 2.14 against 2.25 ms in two runs (bench/results/backward_d_rows_first-2026-11-30-h200.json;
    # causal D keeps the `tl` lanes, 1.58 against 1.50), as far as it was measured: lanes of at
    # most gluon_lanes_bwd_no_r1_lane keys (w / r; D's are 1024). One branch w 131072, r 8, H 8
    # (16384 keys a lane) took 13.2 ms fwd+bwd on 131,072 rows with it, 9.4 with the fused dK/dV
    # (single_device_fwd_bwd_ms of one_long_branch: ring_users-2026-11-30-h200x2-floors.json,
    # ring_users-2026-11-29-h200x2-measured.json)
    gluon_lanes_bwd_no_r1: tuple[int, ...] = ()
    gluon_lanes_bwd_no_r1_lane: int = 0
    gluon_lanes_bwd_stages: int = 4
    gluon_dkdv_lanes: bool = False
    # (head_dim, n): the Gluon forward's and lanes' softmax compute one exponential in n as a
    # cubic on the FMA pipe (KernelConfig.gluon_exp2), where the MUFU unit bounds it. H200, C
    # (head_dim 64) forward 1.194 -> 1.140 ms (n = 8), 1.156 (4), 1.267 (2); A (head_dim 128)
    # 1.415 -> 1.447 (8), so not there (bench/results/forward_gluon_exp2-2026-11-28-h200.json)
    gluon_exp2: tuple[tuple[int, int], ...] = ()
    # The Gluon dK/dV and dQ take a plan's lattice branches beside its lane branches
    # (gluon_plan._beside_lanes); the lane branches add theirs after them. Same algorithm and
    # order as the fused `tl` kernels, so the same bits. H200, bf16 fwd+bwd: E 39.56 -> 34.86 ms,
    # F 8.67 -> 7.76 (bench/results/backward_beside_lanes-2026-11-29-h200.json)
    gluon_bwd_beside_lanes: bool = False
    # The branches whose rates keep the lattice from the Gluon forward run as lanes (tuning
    # lanes = "split", gluon_plan.gluon_split). H200, bench_ring's raster spec at 512K rows:
    # forward 151.9 -> 83.4 ms, fwd+bwd 600.5 -> 384.8, out/dq/dk/dv within 6e-4 of the unsplit
    # plan's (bench/results/raster_split-2026-11-30-h200.json)
    split_wide_lattice: bool = False
    # Beside the Gluon curve lanes, the raster lane branches (F causal's r = 1) in a Gluon lane
    # kernel of their own (KernelConfig.gluon_raster_lanes), not `tl`; the same bits. H200,
    # F causal forward 1.42 -> 1.26 ms (bench/results/forward_raster_lanes-2026-11-29-h200.json)
    gluon_raster_lanes_default: bool = False
    # The Gluon lane launches with programmatic dependent launch (KernelConfig.gluon_pdl): a
    # launch's programs compute while the one before it drains. H200, the same bits: A causal
    # forward 0.954 -> 0.928 ms, fwd+bwd 4.084 -> 3.962; D fwd+bwd 2.054 -> 2.002
    # (bench/results/pdl_delta-2026-12-02-h200.json)
    gluon_pdl_default: bool = False

    def lanes_mode(self, causal: bool, lattice: int, head_dim: int = 128,
                   every_row_kept: bool = True) -> str:
        """Which branches run as lane kernels by default: "auto" (those whose membership
        is per row: r does not divide w, or a curve table) or "all". Causal: square
        diagonals. Non-causal with no r = 1 branch (every_row_kept False): the fused
        kernel still tiles the lattice classes that no branch keeps, while the lane
        kernels walk kept lanes only (the first launch clears the other rows): D
        forward 0.645 -> 0.502 ms on an H200, with descriptor loads and warp
        specialization (the planner's lane_tma / lane_ws); B, A (an r = 1 branch) ran
        slower as lanes (10.59 against 10.17 ms). Measured for head_dim 128 only: C
        (head_dim 64) causal ran 1.40 ms with every branch a lane branch against 1.41
        fused, so other head dims keep the fused kernel."""
        if self.causal_lanes and head_dim == 128 and (causal or not every_row_kept):
            return "all"
        return "auto"

    def dual_chain(self, head_dim: int, itemsize: int) -> bool:
        """Whether the fused forward runs each tile as two chains of half the rows
        (KernelConfig.dual_chain) where the plan allows it."""
        return itemsize == 2 and head_dim in self.dual_chain_head_dims

    def fused_dkdv_ok(self, causal: bool, lattice: int) -> bool:
        """Whether the fused dkdv (key tiles of the query lattice) pays off."""
        return not causal or self.name == "interpreter" or lattice <= self.causal_max_lattice

    def fused_dkdv_tile(self, head_dim: int, itemsize: int, causal: bool = False
                        ) -> tuple[int, int, int, int] | None:
        """The dkdv tile the fused (all-branch) kernel prefers, or None for the
        backward_table row. H200 sweep (bench/results/tune_backward-2026-11-21-h200.json): A 8.85 against 9.28 ms
        with (128, 64, 8, 3); C 5.39 against 5.67 ms with (128, 32, 4, 3); causal: no gain."""
        if self.capability is None or self.capability < 90 or causal or itemsize != 2:
            return None
        return {64: (128, 32, 4, 3), 128: (128, 64, 8, 3)}.get(head_dim)


SM90 = Target("sm90", 90, 227 * 1024, 128, True, causal_max_lattice=1, lane_tma=True, lane_ws=True, causal_lanes=True,
              lane_tiles_fastest=True, fused_tma=True, fold_scale=True, bwd_tma=True, l2_bytes=50 * 2**20,
              dual_chain_head_dims=(64,), gluon_fwd_tiles=((64, 128, 3), (128, 128, 3)), gluon_fwd_default=(64, 128),
              gluon_dkdv_default=(64, 128), gluon_dq_default=(128,),
              gluon_lanes_default=(64, 128), gluon_lanes_bwd_default=(64, 128), gluon_lanes_bwd_no_r1=(128,),
              gluon_lanes_bwd_no_r1_lane=1024,
              gluon_dkdv_lanes=True, gluon_exp2=((64, 8),), gluon_bwd_beside_lanes=True,
              gluon_raster_lanes_default=True, split_wide_lattice=True, gluon_pdl_default=True)
SM80 = Target("sm80", 80, 163 * 1024, 128, False)
INTERPRETER = Target("interpreter", None, 1 << 30, 64, False)
TARGETS_BY_NAME: dict[str, Target] = {t.name: t for t in (SM90, SM80, INTERPRETER)}


ARCHES = ("sm90", "sm80", "interpreter")      # the plans dilgen has (--arch)
NEWEST = "sm90"
ARCH_HELP = ("sm90 (Hopper), sm80 (Ampere) or interpreter (CPU); sm86 and sm89 take the sm80 "
             "plan, a newer GPU (sm100, sm120, ...) the sm90 plan")


class TargetWarning(UserWarning):
    """A GPU newer than every target runs the newest target's plan."""


def resolve_arch(name: str) -> tuple[Target, str | None, bool]:
    """(target, note, newer) for an --arch value: a target's name, or smNN for a GPU that
    has no plan of its own, which takes its family's (sm86, sm89: sm80) or, newer than
    every target, the newest (sm100, sm120: sm90). note says which plan and why (None
    for a target's own name); newer: the GPU is newer than every target. Anything else
    raises ValueError listing the accepted values."""
    if name in TARGETS_BY_NAME:
        return TARGETS_BY_NAME[name], None, False
    m = re.fullmatch(r"sm([1-9][0-9]{1,2})", name) if isinstance(name, str) else None
    if m is None:
        raise ValueError(f"unknown --arch {name!r}: choose one of {', '.join(ARCHES)} "
                         f"(or smNN of a newer GPU, e.g. sm100, which takes the sm90 plan)")
    cap = int(m.group(1))
    if cap > 90:
        return SM90, (f"--arch {name}: no {name} templates yet; building the {NEWEST} plan "
                      f"(Hopper's tiles and TMA; Triton compiles its kernels for {name} when "
                      f"they first run; not measured on {name})"), True
    if cap >= 80:
        return SM80, (f"--arch {name}: building the sm80 plan (the Ampere plan serves sm80 to "
                      f"sm89; Triton compiles its kernels for {name} when they first run)"), False
    raise ValueError(f"--arch {name}: dilgen needs sm80 (Ampere) or newer; choose one of "
                     f"{', '.join(ARCHES)}")


_WARNED: set = set()


def _warn_newer(name: str, note: str) -> None:
    """One TargetWarning per GPU name and process."""
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(f"dilgen: {note}", TargetWarning, stacklevel=3)


def get_target(name: str) -> Target:
    """Target by name ("sm90", "sm80", "interpreter"); other sm numbers map to their family
    (sm86, sm89: sm80), or, newer than sm90, to sm90 with a TargetWarning (resolve_arch)."""
    target, note, newer = resolve_arch(name)
    if newer:
        _warn_newer(name, note)
    return target


def target_for_capability(major: int, minor: int) -> Target:
    """The target of a GPU of compute capability major.minor: a newer GPU than sm90
    (Blackwell: 10.x, 12.x) runs the sm90 plan, with one TargetWarning per process."""
    name = f"sm{major}{minor}"
    if (major, minor) < (8, 0):
        raise ValueError(f"this GPU ({name}, compute capability {major}.{minor}): dilgen needs "
                         f"sm80 (Ampere) or newer; use a newer GPU, or CPU tensors (Triton's "
                         f"interpreter)")
    target, note, newer = resolve_arch(name)
    if newer:
        _warn_newer(name, f"this GPU ({name}, compute capability {major}.{minor}) has no "
                          f"templates of its own yet; it runs the {NEWEST} plan (Hopper's tiles "
                          f"and TMA, compiled by Triton for {name}; not measured on {name})")
    return target
