"""What one rank of a ring test checks (tests/ring_worker.py runs it): its rows of out, lse
and the q, k, v gradients against the float64 single-device reference (check_case), or, for
packed rows, against the single-device packed call that one rank makes for all
(packed_reference, check_packed_case)."""
from __future__ import annotations

import os
import tempfile

import torch


TOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    got = got.detach().double().cpu()
    ref = ref.detach().double().cpu()
    denom = ref.norm().item()
    return (got - ref).norm().item() / (denom if denom > 0 else 1.0)


class transport:
    """DILGEN_RING_TRANSPORT set to `name` inside the block (a case's "transport"); a case with
    "measure" also measures its spec's rate on the CPU (DILGEN_RING_MEASURE=1) into a cache of
    its own (DILGEN_CACHE_DIR: the session's keeps no record of it); `env`: more variables set
    inside the block (a case's "agree": DILGEN_RING_AGREE)."""

    def __init__(self, name: str, measure: str | None = None, env: dict | None = None):
        self.name, self.measure, self.extra = name, measure, dict(env or {})
        if measure:
            self.extra.update(DILGEN_RING_MEASURE="1", DILGEN_CACHE_DIR=measure)

    def __enter__(self):
        self.saved = os.environ.get("DILGEN_RING_TRANSPORT")
        os.environ["DILGEN_RING_TRANSPORT"] = self.name
        self.env = {k: os.environ.get(k) for k in self.extra}
        os.environ.update(self.extra)

    def __exit__(self, *exc):
        for k, v in self.env.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        if self.saved is None:
            del os.environ["DILGEN_RING_TRANSPORT"]
        else:
            os.environ["DILGEN_RING_TRANSPORT"] = self.saved


def check_case(case: dict, rank: int, P: int, dev: torch.device, group=None) -> list[str]:
    """Run one case on this rank; return failure messages (empty when it passed)."""
    import dilgen
    from dilgen.reference import differentiable_reference
    from dilgen.runtime.ring import shard

    fields = dict(case["spec"])
    fields.setdefault("num_heads", 2)
    fields.setdefault("head_dim", 16)
    fields.setdefault("dtype", "float32")
    fields["ring_size"] = P
    spec = dilgen.Spec(name=case["name"], **fields)
    order = case.get("order", "contiguous")
    B, N = case["shape"]
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    H, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    q, k, v = (torch.randn((B, N, h, D), generator=gen) for h in (H, Hkv, Hkv))
    gout = torch.randn((B, N, H, D), generator=gen)
    glse = torch.randn((B, H, N), generator=gen)

    # float64 single-device reference and its gradients
    leaves = [t.double().clone().requires_grad_(True) for t in (q, k, v)]
    ref_out, ref_lse = differentiable_reference(*leaves, spec)
    finite = torch.isfinite(ref_lse)
    loss = (ref_out * gout.double()).sum() + torch.where(finite, ref_lse, torch.zeros_like(ref_lse)).mul(glse.double()).sum()
    loss.backward()
    ref_grads = [t.grad for t in leaves]

    dt = getattr(torch, spec.dtype)
    sh = lambda t, dim=1: shard(t, P, rank, order, dim=dim, spec=spec)  # noqa: E731
    mine = [sh(t).to(dt).to(dev).clone().requires_grad_(True) for t in (q, k, v)]
    # a case's "tuning" forces planner flags (the sm90 descriptor loads run in the interpreter)
    kernel = dilgen.Kernel(spec, None, case["tuning"]) if case.get("tuning") else dilgen.compile(spec)
    from dilgen.runtime.ring import lane_windows
    agree = env = None
    before = dict(lane_windows.RAN)
    if case.get("compile"):
        # the ring as ops: the call traces as one graph (fullgraph=True), P2P inside the op
        from torch._dynamo.testing import CompileCounter
        counter = CompileCounter()
        fn = torch.compile(lambda a, b, c: kernel(a, b, c, return_lse=True, chunk_order=order),
                           fullgraph=True, backend=counter)
        out, lse = fn(*mine)
        if counter.frame_count != 1:
            return [f"{case['name']} rank {rank}: {counter.frame_count} graphs, want 1"]
    else:
        # the ring's windows unless a case names a transport ("auto": the cost model's)
        agree = {"DILGEN_RING_AGREE": case["agree"]} if case.get("agree") else None
        env = {**(agree or {}), **case.get("env", {})} or None        # a case's "env": more variables
        measure = case.get("measure") and tempfile.mkdtemp(prefix=f"dilgen_measure_rank{rank}_")
        with transport(case.get("transport", "ring"), measure, env):
            out, lse = kernel(*mine, group=group, return_lse=True, chunk_order=order)
            if measure:
                fails = measured(spec, P, dev, group)
                if fails:
                    return [f"{case['name']} rank {rank}: {f}" for f in fails]
            if agree and (fails := agreed_on_side_group(group)):
                return [f"{case['name']} rank {rank}: {fails}"]
        ran = kernel.compiled_for(dev).attention.last_ring_transport
        if case.get("expect_transport", ran) != ran:
            return [f"{case['name']} rank {rank}: transport {ran}, want {case['expect_transport']}"]
    g_out = sh(gout).to(dev)
    g_lse = sh(glse, 2).to(dev)
    lse_finite = torch.isfinite(lse.detach())
    loss = (out.float() * g_out).sum() + torch.where(lse_finite, lse, torch.zeros_like(lse)).mul(g_lse).sum()
    with transport(case.get("transport", "ring"), env=env):
        loss.backward()
    if case.get("lane_windows") and any(lane_windows.RAN[k] == before[k] for k in before):
        return [f"{case['name']} rank {rank}: no window ran as lanes ({lane_windows.RAN})"]

    return compare_rows(f"{case['name']} rank {rank}", TOL[spec.dtype], (out, lse, *(t.grad for t in mine)),
                        (sh(ref_out.detach()), sh(ref_lse.detach(), 2), *(sh(g) for g in ref_grads)))


def agreed_on_side_group(group) -> str | None:
    """DILGEN_RING_AGREE=cpu: the agreement made a gloo group of the ring group's ranks, its
    own, kept for the group (faults.side_groups); else what went wrong."""
    import torch.distributed as dist
    from dilgen.runtime.ring.faults import _group_name, side_groups
    side = side_groups.get(_group_name(dist, group))
    if side is None or side is group:
        return f"no gloo group of its own for the agreement: {side_groups}"
    if dist.get_backend(side) != "gloo" or dist.get_world_size(side) != dist.get_world_size(group):
        return f"the agreement's group is {dist.get_backend(side)} of {dist.get_world_size(side)} ranks"
    return None


def measured(spec, P: int, dev, group) -> list[str]:
    """The first auto call measured the spec's rate and the group's links: every rank prices
    with the same entry and link rates, the forward's backward re-used them (one entry, not
    two), and no record was written."""
    import torch.distributed as dist

    from dilgen import cache
    from dilgen import calibration as cal
    rates = cal.rates_for(P, dist.get_backend(group), dev)
    if (cache.cache_dir() / "calibration").exists() and any((cache.cache_dir() / "calibration").iterdir()):
        return ["a ring call's own measurement wrote a record"]
    entry = rates.for_spec(cal.spec_digest(spec.to_json()))
    if entry is None or len(rates.specs) != 1:
        return [f"no single measured entry for the spec in its record: {rates.specs}"]
    from dilgen.runtime.ring.measure import LINKS
    if not set(LINKS) <= set(rates.measured):        # no calibration: the links too
        return [f"the first call measured no links: measured {rates.measured}"]
    if not rates.source.startswith("links: measured by this group's first ring call"):
        return [f"the rates' source does not say the links were measured: {rates.source!r}"]
    entry = (entry, tuple(getattr(rates, f) for f in LINKS))
    every = [None] * P
    dist.all_gather_object(every, entry, group=group)
    return [] if all(e == entry for e in every) else [f"the ranks measured differently: {every}"]


def compare_rows(who: str, tol: float, got, want) -> list[str]:
    """Failure messages for this rank's rows: got and want are (out, lse, dq, dk, dv); out
    within tol and written (no NaN), lse -inf where and only where the reference's is and
    within tol elsewhere, each gradient within 2 * tol."""
    out, lse, *grads = got
    want_out, want_lse, *want_grads = (t.detach().cpu() for t in want)
    fails = []
    if torch.isnan(out).any():
        fails.append(f"{who}: NaN in out (unwritten rows?)")
    err = rel_error(out, want_out)
    if not err < tol:
        fails.append(f"{who}: out rel error {err:.3g} >= {tol}")
    if not torch.equal(torch.isfinite(lse.detach().cpu()), torch.isfinite(want_lse)):
        fails.append(f"{who}: lse -inf pattern differs")
    else:
        fin = torch.isfinite(want_lse)
        e = rel_error(lse.detach().cpu()[fin], want_lse[fin]) if fin.any() else 0.0
        if not e < tol:
            fails.append(f"{who}: lse rel error {e:.3g}")
    for name, grad, ref in zip("qkv", grads, want_grads):
        e = rel_error(grad, ref)
        if not e < 2 * tol:
            fails.append(f"{who}: d{name} rel error {e:.3g} >= {2 * tol}")
    return fails


def _packed_inputs(case: dict, P: int, dev: torch.device):
    """(ring spec, single-device spec, cu, (q, k, v), gout, glse) of a packed case: the same
    values on every rank (seeded)."""
    import dilgen
    fields = dict(case["spec"])
    fields.setdefault("num_heads", 2)
    fields.setdefault("head_dim", 16)
    fields.setdefault("dtype", "float32")
    ring_spec = dilgen.Spec(name=case["name"], ring_size=P, **fields)
    one_spec = dilgen.Spec(name=case["name"] + "_1dev", ring_size=1, **fields)
    lengths = case["lengths"]
    cu_list = [0]
    for n in lengths:
        cu_list.append(cu_list[-1] + n)
    total = cu_list[-1]
    assert total % P == 0, f"{case['name']}: total {total} not divisible by {P}"
    cu = torch.tensor(cu_list, dtype=torch.int32, device=dev)
    H, Hkv, D = ring_spec.num_heads, ring_spec.num_kv_heads, ring_spec.head_dim
    dt = getattr(torch, ring_spec.dtype)
    gen = torch.Generator().manual_seed(case.get("seed", 0))
    q, k, v = (torch.randn((total, h, D), generator=gen).to(dt).to(dev) for h in (H, Hkv, Hkv))
    gout = torch.randn((total, H, D), generator=gen).to(dev)
    glse = torch.randn((H, total), generator=gen).to(dev)
    return ring_spec, one_spec, cu, (q, k, v), gout, glse


def _packed_loss(out, lse, g_out, g_lse):
    fin = torch.isfinite(lse.detach())
    return (out.float() * g_out).sum() + torch.where(fin, lse, torch.zeros_like(lse)).mul(g_lse).sum()


def packed_reference(case: dict, P: int, dev: torch.device) -> list[torch.Tensor]:
    """The single-device packed call of a case: [out, lse, dq, dk, dv] on the CPU."""
    import dilgen
    _, one_spec, cu, qkv, gout, glse = _packed_inputs(case, P, dev)
    full = [t.clone().requires_grad_(True) for t in qkv]
    out, lse = dilgen.compile(one_spec)(*full, cu_seqlens=cu, return_lse=True)
    _packed_loss(out, lse, gout, glse).backward()
    return [t.detach().cpu() for t in (out, lse, *(x.grad for x in full))]


def _reference_path(out_dir: str, case: dict) -> str:
    return os.path.join(out_dir, f"{case['name']}.ref.pt")


def share_packed_reference(case: dict, P: int, dev: torch.device, out_dir: str) -> None:
    """packed_reference written (atomically) to out_dir for every rank to read: one rank
    makes it, not each of the P."""
    path = _reference_path(out_dir, case)
    torch.save(packed_reference(case, P, dev), f"{path}.{os.getpid()}.tmp")
    os.replace(f"{path}.{os.getpid()}.tmp", path)


def check_packed_case(case: dict, rank: int, P: int, dev: torch.device, group=None,
                      out_dir: str | None = None) -> list[str]:
    """A packed row (cu_seqlens over the whole row) split in P contiguous chunks: this rank's
    rows of out, lse and the q, k, v gradients against the single-device packed call of the
    same spec with ring_size 1 (itself checked against the float64 reference in
    tests/test_varlen.py), read from out_dir (share_packed_reference) or made here."""
    import dilgen
    ring_spec, _, cu, (q, k, v), gout, glse = _packed_inputs(case, P, dev)
    want = torch.load(_reference_path(out_dir, case)) if out_dir else packed_reference(case, P, dev)
    total, H, D = q.shape[0], ring_spec.num_heads, ring_spec.head_dim
    c = total // P
    rows = slice(rank * c, (rank + 1) * c)
    mine = [t[rows].clone().requires_grad_(True) for t in (q, k, v)]
    ring_kernel = (dilgen.Kernel(ring_spec, None, case["tuning"]) if case.get("tuning")
                   else dilgen.compile(ring_spec))
    with transport(case.get("transport", "auto")):
        out, lse = ring_kernel(*mine, cu_seqlens=cu, return_lse=True, group=group)
    if tuple(out.shape) != (c, H, D) or tuple(lse.shape) != (H, c):
        return [f"{case['name']} rank {rank}: shapes out {tuple(out.shape)}, lse {tuple(lse.shape)}"]
    _packed_loss(out, lse, gout[rows], glse[:, rows]).backward()

    return compare_rows(f"{case['name']} rank {rank}", TOL[ring_spec.dtype], (out, lse, *(t.grad for t in mine)),
                        (want[0][rows], want[1][:, rows], *(g[rows] for g in want[2:])))
