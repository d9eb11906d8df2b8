"""One rank of a ring test: torch.multiprocessing + gloo on CPU (nccl on GPUs).

Every rank builds the same full random inputs (same seed), takes its rows, runs the
ring forward and backward, and asserts its rows of out, lse and of the q, k, v gradients
against the float64 single-device reference (tests/ring_checks.py). Failures are written to a per-rank JSON
file (the parent asserts on them); a rank never prints instead of asserting. A rank ends
by os._exit after a final barrier, never by the interpreter's teardown (see _leave).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from datetime import timedelta

import torch

# tests/ is on sys.path: pytest's, a spawned rank's (copied from its parent), a script's own folder
from ring_checks import check_case, check_packed_case, share_packed_reference, transport


def write_json(out_dir: str, name: str, obj: dict) -> None:
    """Write atomically (a temp file, then os.replace): the parent sees all of it or none."""
    path = os.path.join(out_dir, name)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _leave(code: int) -> None:
    """End the rank now: flush, then os._exit; the interpreter's teardown never runs. Why:
    just after barrier() returns, a gloo worker thread drops the finished barrier Work, and
    with it the earlier Works it waited on, whose tensors belong to Python: the thread takes
    the GIL to release them. If the main thread is already finalizing the interpreter,
    Python ends that thread with pthread_exit, whose unwind through a noexcept destructor
    calls std::terminate ("terminate called without an active exception", SIGABRT, seen in
    CI rehearsals, reproduced in reruns; the core shows ~AsyncBarrierWork ->
    ~AsyncAllgatherWork -> take_gil -> pthread_exit). destroy_process_group does not stop
    those threads here: after the ring calls, references to the group outlive it, so the
    group is not freed (its destructor would join them)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not change the exit code
            pass
    os._exit(code)


def worker(rank: int, P: int, port: int, cases: list[dict], out_dir: str, backend: str = "gloo") -> None:
    """One rank: run the cases, write rank{rank}.json, meet every rank at a barrier, exit 0
    by os._exit. Wrong results and exceptions inside a case go to the report (the parent
    asserts on it); an exception anywhere else (start-up, the report, the final barrier)
    goes to rank{rank}.error.json with its phase and traceback, and to stderr, and the rank
    exits 1. No path runs the interpreter's teardown (see _leave)."""
    phase = "init_process_group"
    try:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        import torch.distributed as dist
        from dilgen.runtime import set_poison
        set_poison(True)
        torch.set_num_threads(1)
        dist.init_process_group(backend, rank=rank, world_size=P, timeout=timedelta(seconds=60))
        dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(dev)
        phase = "cases"
        report = {"rank": rank, "fails": [], "passed": []}
        try:
            packed = [c for c in cases if c.get("lengths") and not c.get("expect_error")]
            for case in packed[rank::P]:        # each single-device reference made once
                share_packed_reference(case, P, dev, out_dir)
            if packed:
                dist.barrier()
            for case in cases:
                if case.get("expect_error"):
                    report["fails"].extend(check_error(case, rank, P, dev))
                    continue
                fails = (check_packed_case(case, rank, P, dev, out_dir=out_dir) if case.get("lengths")
                         else check_case(case, rank, P, dev))
                report["fails"].extend(fails)
                if not fails:
                    report["passed"].append(case["name"])
        except Exception:  # noqa: BLE001 - the parent asserts on the report
            report["fails"].append(f"rank {rank} crashed:\n{traceback.format_exc()}")
        phase = "report"
        write_json(out_dir, f"rank{rank}.json", report)
        phase = "final barrier"
        dist.barrier()        # every rank has its report written and its transfers done
    except BaseException:  # noqa: BLE001 - reported to the parent, then a nonzero exit
        tb = traceback.format_exc()
        print(f"ring rank {rank} failed in {phase}:\n{tb}", file=sys.stderr)
        try:
            write_json(out_dir, f"rank{rank}.error.json", {"rank": rank, "phase": phase, "traceback": tb})
        finally:
            _leave(1)
    _leave(0)


def check_error(case: dict, rank: int, P: int, dev) -> list[str]:
    """Cases that must fail the same way on every rank (never hang)."""
    import dilgen
    from dilgen.runtime.ring import RingError
    kind = case["expect_error"]
    fields = dict(num_heads=2, head_dim=16, dtype="float32", segment_lengths=[8, 16],
                  dilation_rates=[1, 2], ring_size=P)
    if kind.startswith("packed_"):
        return check_packed_error(case, rank, P, dev, fields)
    n_loc = 16
    if kind == "ring_size":
        fields["ring_size"] = P + 1
    if kind == "spec" and rank == 0:
        fields["causal"] = True           # rank 0 compiled a different spec
    if kind == "rows" and rank == P - 1:
        n_loc = 12                        # N not divisible by P: the last rank is short
    if kind == "dtype" and rank == 1:
        fields_dtype = torch.float16
    else:
        fields_dtype = torch.float32
    spec = dilgen.Spec(name=f"ring_err_{kind}", **fields)
    q, k, v = (torch.randn(1, n_loc, 2, 16, dtype=fields_dtype, device=dev) for _ in range(3))
    order = "contiguous"
    if rank == 1 and kind == "none_q":          # bad arguments on one rank, the default group
        q = None
    if rank == 1 and kind == "meta":
        q, k, v = (t.to("meta") for t in (q, k, v))
    if rank == 1 and kind == "order_none":
        order = None
    try:
        if kind == "skipped_backward":          # rank 1 skips the backward and calls again
            leaves = [t.requires_grad_(True) for t in (q, k, v)]
            out = dilgen.compile(spec)(*leaves)
            out.sum().backward() if rank == 0 else dilgen.compile(spec)(*leaves)
        # "transport": rank 0 forces the all-gather, the others the ring (a hang if it ran)
        # "agree": every rank names a channel that does not exist (refused together, on the group)
        with transport(("allgather" if rank == 0 else "ring") if kind == "transport" else "auto",
                       env={"DILGEN_RING_AGREE": "gpu"} if kind == "agree" else None):
            dilgen.compile(spec)(q, k, v, chunk_order=order)
    except RingError as exc:
        msg = str(exc)
        if "\n" in msg or case["expect_in"] not in msg:
            return [f"{kind} rank {rank}: unexpected message: {msg!r}"]
        return []
    except Exception as exc:  # noqa: BLE001
        return [f"{kind} rank {rank}: wrong exception {type(exc).__name__}: {exc}"]
    return [f"{kind} rank {rank}: no error raised"]


def check_packed_error(case: dict, rank: int, P: int, dev, fields: dict) -> list[str]:
    """Packed rows on a ring that must fail the same way on every rank (never hang):
    cu_seqlens differing across ranks, a total not divisible by P, a bad cu on one rank."""
    import dilgen
    from dilgen.runtime.ring import RingError
    kind = case["expect_error"]
    n_loc = 12
    cu = [0, 5, 6 * P, n_loc * P]
    if kind == "packed_cu_differs" and rank == 1:
        cu = [0, 7, 6 * P, n_loc * P]            # same total, other borders
    if kind == "packed_not_divisible":
        cu = [0, 5, n_loc * P + 1]               # one row more than P chunks of n_loc
    if kind == "packed_bad_cu" and rank == P - 1:
        cu = [0, 9, 5, n_loc * P]                # decreasing offsets on the last rank only
    spec = dilgen.Spec(name=f"ring_perr_{kind[7:]}", **fields)
    q, k, v = (torch.randn(n_loc, 2, 16, device=dev) for _ in range(3))
    try:
        dilgen.compile(spec)(q, k, v, cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=dev))
    except RingError as exc:
        msg = str(exc)
        if "\n" in msg or case["expect_in"] not in msg:
            return [f"{kind} rank {rank}: unexpected message: {msg!r}"]
        return []
    except Exception as exc:  # noqa: BLE001
        return [f"{kind} rank {rank}: wrong exception {type(exc).__name__}: {exc}"]
    return [f"{kind} rank {rank}: no error raised"]


# -- issue 35: a refused call leaves nothing pending -----------------------------------------
# Run as a script under torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT):
#   python tests/ring_worker.py refused catch|raise OUT_DIR
# Unlike worker() above, it ends as a user's script does, through the interpreter's teardown
# (no os._exit, no destroy_process_group), which is where a collective left pending aborts.

def _held_by_collectives(exc: BaseException) -> list[str]:
    """Tensors that the ring's frames of a raised error's traceback hold, which some other
    owner (a process group's worker thread) still references: _use_count() > 1."""
    held, tb = [], exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if "dilgen/runtime/ring" in frame.f_code.co_filename.replace(os.sep, "/"):
            for name, value in frame.f_locals.items():
                for t in (value if isinstance(value, (list, tuple)) else [value]):
                    if isinstance(t, torch.Tensor) and t._use_count() > 1:
                        held.append(f"{frame.f_code.co_name}.{name} (use count {t._use_count()})")
        tb = tb.tb_next
    return held


def refused_main(mode: str, out_dir: str) -> None:
    """Rank 0 passes an fp16 q to a float32 ring spec, 20 times (the default group's custom
    op and an explicit group in turn), catching the RingError every rank raises; then good
    calls on both paths, checked against the float64 reference; then (mode "raise") one
    more refused call left uncaught, so that the script ends by it (exit 1). Writes
    refused{rank}.json: the messages that were wrong, the tensors still held after a
    refusal, the good calls' errors."""
    import torch.distributed as dist
    import dilgen
    from dilgen.reference import reference_attention
    from dilgen.runtime.ring import RingError, shard
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, P = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(P)))
    spec = dilgen.Spec(name="ring_refused", num_heads=2, head_dim=16, dtype="float32",
                       segment_lengths=[8, 32], dilation_rates=[1, 2], ring_size=P)
    kernel = dilgen.compile(spec)
    gen = torch.Generator().manual_seed(35)
    full = [torch.randn(1, 16 * P, 2, 16, generator=gen) for _ in range(3)]
    q, k, v = (shard(t, P, rank) for t in full)
    bad = q.half() if rank == 0 else q
    report = {"rank": rank, "wrong": [], "held": [], "good": []}
    want = "ring_refused: ring call refused on every rank: rank(s) [0] passed bad inputs"
    for i in range(20):
        try:
            kernel(bad, k, v, group=None if i % 2 == 0 else group)
        except RingError as exc:
            if not str(exc).startswith(want) or "\n" in str(exc):
                report["wrong"].append(str(exc))
            report["held"].extend(_held_by_collectives(exc))
        else:
            report["wrong"].append(f"call {i}: no error")
    ref = shard(reference_attention(*(t.double() for t in full), spec), P, rank)
    for g in (None, group):
        out = kernel(q, k, v, group=g)
        report["good"].append(float((out.double() - ref).abs().max()))
    write_json(out_dir, f"refused{rank}.json", report)
    if mode == "raise":
        kernel(bad, k, v)          # uncaught: the interpreter prints it and exits 1


# -- a rank that fails in the middle of a ring call (tests/test_ring_faults.py) -------------
# name: (DILGEN_RING_TRANSPORT, failing rank, pass, step index, "raise" or "kill", group)
FAULTS = {
    "setup": ("ring", 1, "setup", 0, "raise", "own"),       # RingRun's set-up, past the agreement
    "fwd_ring": ("ring", 1, "forward", 1, "raise", "own"),
    "bwd_ring": ("ring", 2, "backward", 2, "raise", "own"),
    "bwd_allgather": ("allgather", 0, "backward", 3, "raise", "own"),
    # the default group, left uncaught: every rank ends by the error (exit 1)
    "fwd_allgather_uncaught": ("allgather", 3, "forward", 0, "raise", "default"),
    "fwd_kill": ("ring", 2, "forward", 1, "kill", "default"),
    # rank 0 killed when it hosts the store (started without torchrun)
    "host_kill": ("ring", 0, "forward", 1, "kill", "default"),
    # "recut": the kernels of a rank's own blocks raise while its posted transfers travel
    "fwd_recut": ("recut", 0, "forward", 0, "kernel", "own"),
    "bwd_recut": ("recut", 2, "backward", 0, "kernel", "own"),
}


class injected:
    """Test hook, this process only: on rank `fail`, RingRun.run (the kernels of one step)
    raises, or kills the process, when pass `direction` reaches step index `step`; for
    direction "setup", RingRun._transport raises (the forward's set-up); how "kernel": the
    recut transport's single-device kernels raise at their call index `step` of the pass."""

    def __init__(self, rank: int, fail: int, direction: str, step: int, how: str):
        self.active, self.args = rank == fail, (rank, direction, step, how)

    def __enter__(self):
        from dilgen.runtime.ring.run import RingRun
        self.plain, (rank, direction, step, how) = RingRun.run, self.args
        plain = self.plain

        self.plain_transport = RingRun._transport

        def run(ring, fn):
            if ring.direction == direction and ring.at[:2] == ("step", step):
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"injected fault on rank {rank}, {direction} step index {step}")
            return plain(ring, fn)

        def setup(ring, *inputs):
            raise RuntimeError(f"injected fault on rank {rank}, {direction} step index {step}")
        if self.active and how == "kernel":
            self._patch_recut(rank, direction, step)
        elif self.active:
            RingRun.run = run
            if direction == "setup":
                RingRun._transport = setup

    def _patch_recut(self, rank, direction, step):
        from dilgen.runtime.ring import recut
        name = "forward_raw" if direction == "forward" else "backward_raw"
        plain, calls = getattr(recut, name), []
        self.restore = (recut, name, plain)

        def kernels(*args, **kwargs):
            calls.append(1)
            if len(calls) == step + 1:
                raise RuntimeError(f"injected fault on rank {rank}, {direction} step index {step}")
            return plain(*args, **kwargs)
        setattr(recut, name, kernels)

    def __exit__(self, *exc):
        from dilgen.runtime.ring.run import RingRun
        RingRun.run, RingRun._transport = self.plain, self.plain_transport
        if getattr(self, "restore", None):
            setattr(*self.restore)


def fault_main(names: str, out_dir: str) -> None:
    """Run the FAULTS cases in order (P ranks under torchrun's environment): each one a
    forward and backward on P * 16 rows whose w = P * 16 branch spans every rank, with
    the fault injected on one rank. Writes fault{rank}.json after each case: where each
    rank raised (forward or backward), what, and how many seconds after the call began."""
    import faulthandler
    import time
    import torch.distributed as dist
    import dilgen
    from dilgen.runtime.ring import shard
    # a hang shows where: every thread's stack on stderr before the parent gives up (its
    # DILGEN_TEST_HANG_S, tests/test_ring_faults.py), which the parent prints
    faulthandler.dump_traceback_later(float(os.environ.get("DILGEN_TEST_HANG_S", "150")), exit=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, P = dist.get_rank(), dist.get_world_size()
    report = {}
    for name in names.split(","):
        transport, fail, direction, step, how, where = FAULTS[name]
        group = dist.new_group(list(range(P))) if where == "own" else None
        os.environ["DILGEN_RING_TRANSPORT"] = transport
        # recut (P = 4): lcm 6, so the borders at 16 and 32 move to 12 and 30; ranks 0 and 2 each
        # run a block of their own rows on a view and assemble one that takes rank 1's rows
        spec = dilgen.Spec(name=f"fault_{name}", num_heads=2, head_dim=16, dtype="float32",
                           segment_lengths=[2, 6] if transport == "recut" else [16, 16 * P],
                           dilation_rates=[1, 2], ring_size=P)
        kernel = dilgen.compile(spec)
        gen = torch.Generator().manual_seed(5)
        q, k, v = (shard(torch.randn(1, 16 * P, 2, 16, generator=gen), P, rank).requires_grad_(True)
                   for _ in range(3))
        entry = report[name] = {"raised_in": None, "type": None, "error": None, "seconds": None}
        write_json(out_dir, f"fault{rank}.json", report)
        with injected(rank, fail, direction, step, how):
            t0, phase = time.monotonic(), "forward"
            try:
                out = kernel(q, k, v, group=group)
                phase = "backward"
                out.square().sum().backward()
            except Exception as exc:  # noqa: BLE001 - the parent asserts on the report
                entry.update(raised_in=phase, type=type(exc).__name__, error=str(exc))
                if name.endswith("uncaught"):
                    raise
            finally:
                entry["seconds"] = time.monotonic() - t0
                write_json(out_dir, f"fault{rank}.json", report)


if __name__ == "__main__":
    if sys.argv[1:2] == ["refused"]:
        refused_main(sys.argv[2], sys.argv[3])
    if sys.argv[1:2] == ["fault"]:
        fault_main(sys.argv[2], sys.argv[3])
