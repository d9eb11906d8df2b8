"""The ring when a rank fails in the middle of a call (gloo, P = 4, CPU): every rank raises
RingAborted naming the rank that failed, where and why, within seconds, and every process
ends cleanly (tests/ring_worker.py's FAULTS, injected by a hook in the worker process).
And the ring over two "nodes" on one machine: torchrun --nnodes 2, launched twice."""
from __future__ import annotations

import json
import os
import re
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

import ring_worker
from proc_tree import free_port as _free_port, run_together  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.ranks]     # each starts ranks: -m "not slow" skips them

ROOT = Path(__file__).resolve().parents[1]
P = 4
SECONDS = 20          # each rank raises within this after its call began (group timeout: 60 s)




def _launch(names: str, tmp_path, timeout_s: float = 180, agent: bool = True,
            extra: dict | None = None) -> list[tuple[int, str]]:
    """ring_worker.fault_main on P processes started as torchrun starts them, the store
    hosted here as torchrun's agent hosts it (so that it outlives any rank), or by rank 0
    (agent=False: started without torchrun); (exit code, stderr) per rank. A rank still
    running after timeout_s fails the test (a hang)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60)) if agent else None
    port = store.port if agent else _free_port()
    cmds = []
    for rank in range(P):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(P),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   DILGEN_TEST_HANG_S=str(timeout_s - 20),
                   **({"TORCHELASTIC_USE_AGENT_STORE": "True"} if agent else {}))
        env.update(extra or {})
        cmds.append(([sys.executable, ring_worker.__file__, "fault", names, str(tmp_path)], env))

    def report(rank):               # the cases it had written (the stacks faulthandler dumped are in its stderr)
        rep = tmp_path / f"fault{rank}.json"
        return f", report {rep.read_text() if rep.exists() else 'none'}"
    results = run_together(cmds, tmp_path, timeout_s, f"fault cases {names}", detail=report)
    del store
    return results


def _reports(tmp_path) -> list[dict]:
    return [json.loads((tmp_path / f"fault{r}.json").read_text()) for r in range(P)]


def _check_case(reports, name: str, extra: str = "") -> None:
    """Every rank raised RingAborted (one line) in time; the failing rank names itself, the
    others name it, where it failed and its error."""
    _, fail, direction, step, _, _ = ring_worker.FAULTS[name]
    at = "the set-up of the ring call" if direction == "setup" else f"step {step + 1} of "
    for rank, rep in enumerate(reports):
        e = rep[name]
        where = f"{name} rank {rank}: {e}{extra}"
        assert e["type"] == "RingAborted" and "\n" not in e["error"], where
        assert e["seconds"] < SECONDS, where
        assert f"injected fault on rank {fail}, {direction} step index {step}" in e["error"], where
        assert "the process group is no longer usable" in e["error"], where
        if rank == fail:
            assert e["raised_in"] == direction.replace("setup", "forward"), where
            assert e["error"].startswith(f"fault_{name}: rank {fail} (this rank) failed during {at}"), where
            continue
        if direction == "backward":
            assert e["raised_in"] == "backward", where
        if e["raised_in"] == "backward" and direction != "backward":
            # its forward needed nothing more from the failed rank: it returned its rows
            # and the backward's agreement refused, naming the earlier failure
            assert f"an earlier ring call on this group failed (rank {fail}, {at}" in e["error"], where
        else:
            assert f"rank {fail} failed during {at}" in e["error"], where


@pytest.mark.timeout(400)
@pytest.mark.parametrize("agree", ["device", "cpu"])
def test_rank_failing_mid_call_makes_every_rank_raise(tmp_path, agree):
    """Rank f raises in its set-up past the agreement, or inside the kernels of one step:
    forward and backward, both transports, an explicit group each. A rank whose rest of
    the call needs nothing more from a stopped rank returns its rows and raises at its
    next ring call on the group (here: the backward). Last, on the default group, uncaught: the failing rank ends by its error in the forward, the others by the
    backward's refused agreement; exit 1, the RingAborted's traceback last, no abort at
    exit. The same with the agreements on a gloo group of their own (DILGEN_RING_AGREE=cpu),
    which the failing rank closes with the ring's group."""
    cases = ["setup", "fwd_ring", "bwd_ring", "bwd_allgather", "fwd_allgather_uncaught"]
    results = _launch(",".join(cases), tmp_path, extra={"DILGEN_RING_AGREE": agree})
    reports = _reports(tmp_path)
    stderr = "".join(f"\n-- rank {r} exit {rc}:\n{err[-3000:]}" for r, (rc, err) in enumerate(results))
    for name in cases[:-1]:
        _check_case(reports, name, stderr)
    for rank, (rc, err) in enumerate(results):
        assert "terminate called" not in err, f"rank {rank} aborted at exit:{stderr}"
        assert rc == 1, f"rank {rank} exited {rc}:{stderr}"
        last = err.strip().splitlines()[-1]
        assert "RingAborted: fault_fwd_allgather_uncaught: " in last, last
        e = reports[rank]["fwd_allgather_uncaught"]
        assert e["seconds"] < SECONDS, e
        if rank == 3:
            assert e["raised_in"] == "forward" and "rank 3 (this rank) failed during step 1 of" in last
        else:
            assert e["raised_in"] == "backward", e
            assert "ring call refused: an earlier ring call on this group failed (rank 3, step 1 of" in last


@pytest.mark.timeout(300)
def test_a_recut_kernel_failing_while_transfers_travel_makes_every_rank_raise(tmp_path):
    """The recut transport posts its transfers, then runs the kernels of a rank's own blocks
    while they travel. A rank whose kernels raise there (forward, then backward) closes the
    group with its transfers still posted: a rank that exchanges rows with it raises
    RingAborted naming it, within seconds; in the forward every other rank is refused by the
    backward's agreement; in the backward a rank that needs nothing more from it may return
    its rows. Every process ends cleanly (each case caught: exit 0)."""
    cases = ["fwd_recut", "bwd_recut"]
    results = _launch(",".join(cases), tmp_path)
    reports = _reports(tmp_path)
    stderr = "".join(f"\n-- rank {r} exit {rc}:\n{err[-3000:]}" for r, (rc, err) in enumerate(results))
    for rank, (rc, err) in enumerate(results):
        assert rc == 0 and "terminate called" not in err, f"rank {rank} exited {rc}:{stderr}"
    for name in cases:
        _, fail, direction, step, _, _ = ring_worker.FAULTS[name]
        where = f"the single-device kernels of the ring {direction}"
        raised = []
        for rank, rep in enumerate(reports):
            e, at = rep[name], f"{name} rank {rank}: {rep[name]}{stderr}"
            if e["type"] is None:            # returned its rows: only where nothing more was needed
                assert direction == "backward" and rank != fail, at
                continue
            raised.append(rank)
            assert e["type"] == "RingAborted" and "\n" not in e["error"] and e["seconds"] < SECONDS, at
            assert f"injected fault on rank {fail}, {direction} step index {step}" in e["error"], at
            if rank == fail:
                assert e["error"].startswith(f"fault_{name}: rank {fail} (this rank) failed during {where}"), at
            else:
                assert f"rank {fail} failed during {where}" in e["error"] or \
                    f"an earlier ring call on this group failed (rank {fail}, {where}" in e["error"], at
        assert fail in raised and (len(raised) == P or direction == "backward") and len(raised) > 1, \
            f"{name}: ranks {raised} raised{stderr}"


@pytest.mark.timeout(300)
def test_killed_rank_makes_every_rank_raise(tmp_path):
    """Rank 2 is killed (SIGKILL) inside a forward step on the default group: the others
    raise RingAborted (a lost peer, no record: it may have died) within seconds and exit 0
    after catching it."""
    results = _launch("fwd_kill", tmp_path)
    stderr = "".join(f"\n-- rank {r} exit {rc}:\n{err[-3000:]}" for r, (rc, err) in enumerate(results))
    for rank, (rc, err) in enumerate(results):
        assert "terminate called" not in err, f"rank {rank} aborted at exit:{stderr}"
        assert rc == (-9 if rank == 2 else 0), f"rank {rank} exited {rc}:{stderr}"
        if rank == 2:
            continue
        e = json.loads((tmp_path / f"fault{rank}.json").read_text())["fwd_kill"]
        assert e["type"] == "RingAborted" and e["seconds"] < SECONDS, e
        # in the forward; or, when its forward needed nothing more from rank 2, refused by
        # the backward's agreement
        lost = rf"fault_fwd_kill: rank {rank} \(this rank\) lost a peer during step \d of \d of the ring forward"
        refused = "fault_fwd_kill: ring call refused: the agreement's all_gather failed"
        assert re.match(lost if e["raised_in"] == "forward" else refused, e["error"]), e
        assert "a rank may have died" in e["error"], e


@pytest.mark.timeout(300)
def test_store_host_killed_leaves_one_line(tmp_path):
    """Started without torchrun, rank 0 hosts the store; it is killed inside a forward step.
    The others raise RingAborted within seconds and print no C++ backtrace of the store
    client that cannot reach its host (c10d's TCPStore warning). The store's port is picked
    free before rank 0 binds it, so another process may take it meanwhile (CI runs two suites
    side by side): then rank 0 fails to listen, and the run is tried once more on another port."""
    for attempt in (1, 2):
        results = _launch("host_kill", tmp_path, agent=False)
        if attempt == 2 or "failed to listen" not in results[0][1]:
            break
    stderr = "".join(f"\n-- rank {r} exit {rc}:\n{err[-3000:]}" for r, (rc, err) in enumerate(results))
    for rank, (rc, err) in enumerate(results[1:], start=1):
        assert rc == 0, f"rank {rank} exited {rc}:{stderr}"
        assert "frame #" not in err and "TCPStore" not in err, f"rank {rank}:{stderr}"
        e = json.loads((tmp_path / f"fault{rank}.json").read_text())["host_kill"]
        assert e["type"] == "RingAborted" and "\n" not in e["error"] and e["seconds"] < SECONDS, e


@pytest.mark.timeout(400)
def test_ring_over_two_nodes_on_one_machine(tmp_path):
    """torchrun --nnodes 2 --nproc-per-node 2, started twice (node ranks 0 and 1) on one
    machine: P = 4 over gloo, ranks 1 and 2 on different "nodes", w = 64 over 16 rows per
    rank spans all four (examples/ring_torchrun.py --check exits 1 past 1e-4)."""
    for attempt in (1, 2):
        port = _free_port()
        cmd = lambda i: ["torchrun", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(i),  # noqa: E731
                         "--master-addr", "127.0.0.1", "--master-port", str(port), "--rdzv-backend", "static",
                         str(ROOT / "examples" / "ring_torchrun.py"), "--cpu", "--tokens", "64", "--check"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        nodes = run_together([(cmd(i), env) for i in (0, 1)], tmp_path, 300, "torchrun --nnodes 2", merge=True)
        outs = [out for _, out in nodes]
        if attempt == 1 and any("EADDRINUSE" in o or "address already in use" in o for o in outs):
            continue                        # the port was taken before node 0 listened on it
        for i, (rc, out) in enumerate(nodes):
            assert rc == 0, f"node {i} exited {rc}:\n{out[-4000:]}"
        errors = {int(m[0]): float(m[1]) for m in
                  re.findall(r"rank (\d): relative error against float64 (\d\.\d+e[-+]\d+)", "".join(outs))}
        # (a node's two ranks share its stdout, so lines may run into each other: match the number only)
        assert sorted(errors) == [0, 1, 2, 3] and max(errors.values()) < 1e-4, errors
        return


_HALF_SENT = """
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from dilgen.runtime.ring import faults
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
group = dist.new_group([0, 1])
rows = torch.ones(50_000_000)              # 200 MB: still travelling when rank 0 closes
if rank == 0:                               # posts its rows, then fails: settles and closes
    faults.post_transfers(dist, [dist.P2POp(dist.isend, rows, 1, group)])
    faults._settle()
    faults.close_group(dist, group, 2, 0)
    time.sleep(3)
else:
    got = torch.empty_like(rows)
    try:
        dist.irecv(got, 0, group=group).wait()
        print("received", bool(got.eq(1).all()))
    except RuntimeError as exc:
        print("raised", str(exc)[:80])
"""


def test_a_failing_rank_lets_its_rows_in_flight_arrive_before_it_closes(tmp_path):
    """A rank that fails with rows half sent (gloo) waits for its posted transfers, at most
    2 s, before it closes its pairs: closed first, the peer's receive of those rows waited
    forever. The peer receives them (or raises); it never hangs."""
    script = tmp_path / "half_sent.py"
    script.write_text(_HALF_SENT)
    port = str(_free_port())
    env = lambda r: dict(os.environ, RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,  # noqa: E731
                         PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    results = run_together([([sys.executable, str(script)], env(r)) for r in range(2)], tmp_path, 90,
                           "a rank failing with rows in flight", merge=True)
    assert [rc for rc, _ in results] == [0, 0], results
    assert "received True" in results[1][1], results[1][1][-2000:]
