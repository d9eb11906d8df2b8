"""A ring call's errors, and what every rank sees when one rank fails in the middle of it.

Before any transfer the agreement (agreement.py) makes the ranks refuse a call together
(RingError; the group stays usable). After it, the ranks exchange keys step by step, and
a rank that raises there (a kernel launch, an allocation) would leave its peers waiting in
a posted transfer until the process group's timeout. Instead, `Guard` (one per pass):

  1. records the failure (rank, step, error) in the default group's store, under the key
     of the call that every rank took from the agreement (`RingRun.fault_key`);
  2. closes this rank's connections of the group (gloo: a receive that no rank sends,
     waited with a 1 ms timeout, makes gloo close every pair of the group's context,
     gloo/transport/tcp/unbound_buffer.cc), so that each peer's pending or next transfer
     with this rank raises at once ("Connection closed by peer");
  3. raises RingAborted.

A peer whose transfer raises (PeerLost) closes its own connections in turn, so the
closing spreads along the ring, and raises RingAborted naming the rank that failed (from
the store). A rank that exchanges nothing more with a stopped rank in this call returns
its rows; its next ring call on the group is refused by the agreement, with the same
record. The group is then unusable (docs/ring.md, "When a rank fails during a call"). The
normal path runs none of this: Python try blocks and one attribute per step (`run.at`).
Other backends than gloo: the record and RingAborted on the failing rank only (NCCL peers
wait until the group's timeout).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch

from ..checks import InputError

_KEY = "dilgen_ring_fault/"
_CLOSE_TAG = 0x5D11_6E00        # a tag no transfer uses: the closing receive never matches
_UNUSABLE = ("the process group is no longer usable: destroy it and create a new one (or "
             "restart the job) to go on")
_last_key: dict[str, str] = {}  # group name -> fault key of its last agreed call (this process)
# group name -> the gloo group of the same ranks that its agreements travel on (DILGEN_RING_AGREE=cpu,
# agreement._agreement_group); closed with the group, so that the next call's agreement refuses
side_groups: dict[str, Any] = {}


class RingError(InputError):
    """The ranks of a ring call disagree, or the process group does not fit the spec."""


class RingAborted(RingError):
    """A rank failed (or died) in the middle of a ring call; every rank raises this, and the
    process group is no longer usable."""


class PeerLost(Exception):
    """A transfer of a ring call raised (a peer stopped or died); the cause is chained."""


def let_go(tensors, timeout_s: float = 2.0) -> None:
    """Return once no thread of the process group holds a reference to `tensors` (the
    inputs and outputs of a finished collective), or after timeout_s.

    Why: gloo runs a collective on a worker thread (ProcessGroupGloo::runLoop), which
    drops its Work, and with it its references to the tensors, just after wait() returns
    on this thread. A tensor made in Python keeps its Python object alive while C++ holds
    it, so dropping the Work takes the GIL (c10 PyObject preservation:
    TensorImpl::decref_pyobject), once per tensor. If the interpreter is
    already finalizing by then (the call raised and nothing caught it, or the script ended
    right after the collective), Python ends that thread with pthread_exit inside the
    noexcept ~AsyncAllgatherWork: std::terminate, "terminate called without an active
    exception", SIGABRT (seen in a core: ProcessGroupGloo::runLoop -> ~AsyncAllgatherWork ->
    decref_pyobject -> take_gil -> PyThread_exit_thread). Sleeping here releases the GIL, so
    the worker finishes now. The tensors' use counts say when: 1 is this thread's own
    Python reference."""
    deadline = time.monotonic() + timeout_s
    while any(getattr(t, "_use_count", lambda: 1)() > 1 for t in tensors):
        if time.monotonic() > deadline:
            return
        time.sleep(0.0002)


def transfer(fn, *args):
    """fn(*args), a posting or a wait of the ring's transfers; its failure raises PeerLost."""
    try:
        return fn(*args)
    except Exception as exc:
        raise PeerLost(exc) from exc


#: the gloo transfers this pass posted (Guard lets them finish before it closes the pairs)
_POSTED: list = []


def post_transfers(dist, ops: list) -> list:
    """dist.batch_isend_irecv(ops) (PeerLost if it raises), its works. On a gloo group they
    are kept for the pass's Guard: a rank that fails with rows half sent lets its transfers
    finish (or time out) before it closes its pairs, for a peer's receive of rows in flight
    would wait on a closed pair forever."""
    works = transfer(dist.batch_isend_irecv, ops) if ops else []
    if works and dist.get_backend(ops[0].group) == "gloo":
        _POSTED.extend(works)
    return works


def _settle(timeout_s: float = 2.0) -> None:
    """Wait for this pass's posted gloo transfers, all of them within timeout_s (a timeout
    closes that context's pairs, as close_group does), and forget them."""
    deadline = time.monotonic() + timeout_s
    for work in _POSTED:
        try:
            work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except Exception:  # noqa: BLE001 - a peer gone, or the time up: closed below anyway
            pass
    _POSTED.clear()


def collective(dist, group, fn, tensors) -> None:
    """Run a blocking collective of a ring call; on gloo, return (or raise PeerLost) only
    once no process group thread holds its tensors (let_go): the process may end next."""
    gloo = dist.get_backend(group) == "gloo"
    try:
        fn()
    except Exception as exc:
        if gloo:
            let_go(tensors)
        raise PeerLost(exc) from exc
    if gloo:
        let_go(tensors)


def new_key() -> int:
    """This rank's proposal for the call's fault key (the agreement keeps rank 0's)."""
    return int.from_bytes(os.urandom(7), "big")


def fault_key(proposal: int) -> str:
    """The store key of a call's failure record, from the proposal the agreement kept."""
    return f"{_KEY}{proposal:x}"


def remember(dist, group, key: str) -> None:
    """The fault key of this group's last agreed call: a later call refused by a closed
    group reads the failure from it."""
    _last_key[_group_name(dist, group)] = key


def _group_name(dist, group) -> str:
    pg = group if group is not None else dist.group.WORLD
    return getattr(pg, "group_name", "") or str(id(pg))


def _store(dist):
    return dist.distributed_c10d._get_default_store()


def _short(exc: BaseException) -> str:
    """One line of an error: its type and first line, without gloo's [file.cc:line] prefix."""
    lines = str(exc).strip().splitlines()
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\] ", "", lines[0]) if lines else ""
    text = text.split(". This is typically caused")[0]
    one = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return one if len(one) <= 240 else one[:237] + "..."


def close_group(dist, group, P: int, me: int) -> None:
    """Close this rank's connections of a gloo group, and of the gloo group its agreements
    travel on (side_groups, whatever the group's backend), so that no peer waits on this rank.
    Other backends' own connections: nothing (peers wait in a transfer until the group's
    timeout, docs/ring.md; their next agreement over a closed side group refuses)."""
    side = side_groups.get(_group_name(dist, group))
    if side is not None:
        _close_gloo(dist, side, P, dist.get_rank(side))
    try:
        if dist.get_backend(group) != "gloo":
            return
    except Exception:  # noqa: BLE001 - a destroyed group has nothing to close
        return
    _close_gloo(dist, group, P, me)


def _close_gloo(dist, group, P: int, me: int) -> None:
    """One receive per tag residue (gloo picks a context by tag), from the first peer whose
    pair is still open, waited 1 ms: the timeout closes every pair of that context."""
    peers = [r if group is None else dist.get_global_rank(group, r)
             for r in ((me + d) % P for d in range(1, P))]
    for tag in range(_CLOSE_TAG, _CLOSE_TAG + 8):
        for peer in peers:
            try:
                work = dist.irecv(torch.empty(1), src=peer, group=group, tag=tag)
            except Exception:  # noqa: BLE001 - this pair is closed already
                continue
            try:
                work.wait(timeout=timedelta(milliseconds=1))
            except Exception:  # noqa: BLE001 - the timeout that closes the context
                pass
            break


# a c10d warning line of the store client, then its C++ backtrace ("frame #..") and blank lines
_STORE_NOISE = re.compile(r"^.*(?:TCPStore|socket)\.cpp:\d+\].*\n"
                          r"(?:(?:Exception raised from |frame #|<omitting python frames>).*\n|\n)*",
                          re.MULTILINE)


@contextlib.contextmanager
def _quiet_store():
    """Read or write the store with its C++ client's failure log held back. When the store's
    host has gone (rank 0 started without torchrun, and it ended), each read fails and
    c10d's TCPStore logs a warning with a 20-line C++ backtrace to stderr (c10 logging, not
    the exception: TORCH_CPP_LOG_LEVEL is read only when the process starts). The exception
    is caught and the failure reported in RingAborted's one line, so while the store is used
    file descriptor 2 goes to a temporary file, and whatever else was written there in that
    time is written back, without those warnings."""
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    held = saved = None
    with contextlib.suppress(OSError):
        held = tempfile.TemporaryFile()
        saved = os.dup(2)
    if saved is None:                     # no room for a file, or no stderr: as it is
        if held is not None:
            held.close()
        yield
        return
    with held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            rest = _STORE_NOISE.sub("", held.read().decode(errors="replace"))
            if rest:
                os.write(2, rest.encode())


def _record(dist, key: str, me: int, where: str, error: str) -> None:
    try:
        with _quiet_store():
            _store(dist).compare_set(key, "", json.dumps({"rank": me, "where": where, "error": error}))
    except Exception:  # noqa: BLE001 - no store: peers report a lost peer instead
        pass


def _lookup(dist, keys: list[str], wait_s: float) -> dict | None:
    """The first failure recorded under one of keys, waiting up to wait_s for one (a
    rank writes its record before it closes its connections, so it is usually there)."""
    deadline = time.monotonic() + wait_s
    try:
        store = _store(dist)
        with _quiet_store():
            return _poll(store, keys, deadline)
    except Exception:  # noqa: BLE001 - the store is gone (its host died)
        return None


def _poll(store, keys: list[str], deadline: float) -> dict | None:
    while True:
        for key in keys:
            if store.check([key]):
                return json.loads(store.get(key).decode())
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)


def _where(run, keys: bool = True) -> str:
    phase, i, offset = run.at
    kind = f"the ring {run.direction}"
    if phase == "step":
        whose = "its own keys" if offset == 0 else f"the keys of rank {(run.me - offset) % run.P}"
        return f"step {i + 1} of {len(run.sched['steps'])} of {kind}" + (f" ({whose})" if keys else "")
    return {"gather": f"the key all-gather of {kind}", "reduce": f"the dK, dV reduction of {kind}",
            "preprocess": f"the preprocess of {kind}", "start": f"{kind}, before its first step",
            "setup": f"the set-up of {kind} (past the agreement)",
            "end": f"the end of {kind}", "exchange": f"the exchange of rows before the kernels of {kind}",
            "kernels": f"the single-device kernels of {kind}",
            "return": f"the return of the kernels' rows of {kind}"}[phase]


class Guard:
    """One pass of a ring call (direction "forward" or "backward"; "call", phase "setup":
    RingRun's set-up past the agreement): an exception inside it takes the failure path of
    the module docstring. The executor sets run.at as the pass goes."""

    def __init__(self, run, direction: str, phase: str = "start"):
        self.run = run
        run.direction, run.at = direction, (phase, 0, 0)
        _POSTED.clear()             # an earlier pass's transfers all arrived

    def __enter__(self):
        return self

    def __exit__(self, tp, exc, tb) -> bool:
        if exc is None or isinstance(exc, RingAborted):
            return False
        run = self.run
        lost = isinstance(exc, PeerLost)
        cause = exc.__cause__ if lost else exc
        name, me, where = run.attn.spec["name"], run.me, _where(run, keys=not lost)
        if not lost:
            _record(run.dist, run.fault_key, me, where, _short(cause))
        _settle()
        close_group(run.dist, run.group, run.P, me)
        if not isinstance(exc, Exception):
            return False                # KeyboardInterrupt, SystemExit: as they are
        if not lost:
            raise RingAborted(f"{name}: rank {me} (this rank) failed during {where}: "
                              f"{_short(cause)}; every rank of the ring raises, and "
                              f"{_UNUSABLE}") from cause
        rec = _lookup(run.dist, [run.fault_key], wait_s=1.0)
        if rec is not None:
            raise RingAborted(f"{name}: rank {rec['rank']} failed during {rec['where']}: "
                              f"{rec['error']} (see that rank's log); this rank ({me}) stopped "
                              f"in {where}, and {_UNUSABLE}") from cause
        raise RingAborted(f"{name}: rank {me} (this rank) lost a peer during {where}: "
                          f"{_short(cause)}; no rank recorded an error of its own, so a rank "
                          f"may have died (see the other ranks' logs); {_UNUSABLE}") from cause


def refuse_closed(name: str, dist, group, P: int, me: int, exc: PeerLost) -> RingAborted:
    """The agreement's all_gather failed: the group was closed by a failure in an earlier
    ring call on it (read from the store), or a rank died. Closes this rank's connections
    too (its peers may wait in the same all_gather) and returns the error to raise."""
    close_group(dist, group, P, me)
    last = _last_key.get(_group_name(dist, group))
    rec = _lookup(dist, [last], wait_s=1.0) if last else None
    cause = _short(exc.__cause__)
    if rec is not None:
        return RingAborted(f"{name}: ring call refused: an earlier ring call on this group "
                           f"failed (rank {rec['rank']}, {rec['where']}: {rec['error']}); "
                           f"{_UNUSABLE}")
    return RingAborted(f"{name}: ring call refused: the agreement's all_gather failed ({cause}): "
                       f"an earlier ring call failed, or a rank may have died; {_UNUSABLE}")
