"""The processes a test run started, read from /proc (Linux) or `ps` (elsewhere), and the
ending of them on Ctrl-C (tests/conftest.py) - ring ranks and their fork server, Inductor's
compile workers, CLI runs: several of them ignore SIGINT by design, so the terminal's Ctrl-C
alone does not end them."""
from __future__ import annotations

import os
import signal
import socket
import subprocess

# multiprocessing's resource tracker ignores SIGINT and SIGTERM and ends by itself once every
# process holding its pipe is gone, unlinking what they leaked: it is left to do that.
_SPARED = "multiprocessing.resource_tracker"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a test's rank 0 to listen on)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_taken(errors: list[dict]) -> bool:
    """Rank 0 could not listen on the port free_port gave: another process took it between
    free_port's close and rank 0's bind (CI runs two suites side by side). `errors`: the
    ranks' error reports ({"phase", "traceback"}); such a run may be tried once more."""
    return any(e.get("phase") == "init_process_group"
               and any(s in e.get("traceback", "") for s in ("EADDRINUSE", "failed to listen", "Address already in use"))
               for e in errors)


def run_together(cmds: list, out_dir, timeout_s: float, what: str, merge: bool = False,
                 detail=None, cwd=None) -> list[tuple[int, str]]:
    """Run processes that wait on each other (ring ranks, torchrun nodes): `cmds` is a list of
    (argv, env); (exit code, stderr, or stdout and stderr with merge) of each. Each one's output
    goes to a file of out_dir, not a pipe: a pipe fills while the test reads another process's,
    and a rank blocked writing to it stalls every rank that waits for it. Past timeout_s all
    are killed and the test fails, "`what` did not finish in N s (a hang?)", with each one's
    exit code, output tail and `detail(i)` (what else it left behind)."""
    import time

    import pytest
    from pathlib import Path
    paths = [Path(out_dir) / f"proc{i}.out" for i in range(len(cmds))]
    procs = []
    for (argv, env), path in zip(cmds, paths):
        with open(path, "w") as f:
            procs.append(subprocess.Popen(argv, env=env, cwd=cwd, stdout=f if merge else subprocess.DEVNULL,
                                          stderr=subprocess.STDOUT if merge else f))
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
        pytest.fail(f"{what} did not finish in {timeout_s:.0f} s (a hang?)" + "".join(
            f"\n-- process {i} exit {p.returncode}{detail(i) if detail else ''}:\n"
            f"{path.read_text(errors='replace')[-4000:]}" for i, (p, path) in enumerate(zip(procs, paths))))
    return [(p.returncode, path.read_text(errors="replace")) for p, path in zip(procs, paths)]


def join_ranks(ctx, timeout_s: float, what: str) -> None:
    """Wait for the ranks torch.multiprocessing.start_processes(join=False) started: a rank's
    failure raises as join raises it (ProcessExitedException, ProcessRaisedException); past
    timeout_s every rank is killed and the test fails with "`what` did not finish in N s"."""
    import time

    import pytest
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=0.2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{what} did not finish in {timeout_s:.0f} s (a hang?)")


def _table() -> list[tuple[int, int, int, str, str]]:
    """(pid, parent pid, process group, state, command line) of every live process."""
    rows = []
    if os.path.isdir("/proc/self"):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:                        # ended meanwhile
                continue
            state, ppid, pgid = stat[stat.rindex(")") + 2:].split()[:3]
            rows.append((int(name), int(ppid), int(pgid), state, cmd))
        return rows
    out = subprocess.run(["ps", "-A", "-o", "pid=,ppid=,pgid=,stat=,command="],
                         capture_output=True, text=True, timeout=30).stdout
    for line in out.splitlines():
        pid, ppid, pgid, state, *cmd = line.split(None, 4)
        rows.append((int(pid), int(ppid), int(pgid), state[:1], " ".join(cmd)))
    return rows


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live process below `pid`, parents before children."""
    rows = _table()
    children: dict[int, list[tuple[int, str]]] = {}
    for p, ppid, _, state, cmd in rows:
        if state != "Z":
            children.setdefault(ppid, []).append((p, cmd))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            found.append(child)
            todo.append(child[0])
    return found


def group_members(pgid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live (not zombie) process of process group `pgid`."""
    return [(p, cmd) for p, _, g, state, cmd in _table() if g == pgid and state != "Z"]


def end_descendants() -> None:
    """SIGKILL every process below this one (the tree read once, first, so that a child
    whose parent ends meanwhile is still found), resource trackers excepted (see _SPARED)."""
    for pid, cmd in descendants(os.getpid()):
        if _SPARED not in cmd:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
