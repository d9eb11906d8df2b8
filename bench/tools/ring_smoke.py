"""GPU smoke of the ring: the cases of tests/test_ring.py (tests/ring_worker.py: every rank
checks its rows of out, lse and the q, k, v gradients against the float64 reference) over
NCCL, P = 2 and 4. Exit status 1 on any failure.

    python bench/tools/ring_smoke.py                  # needs 4 GPUs (P = 2 only with 2 or 3)
    python bench/tools/ring_smoke.py --dry-run-cpu    # gloo on the CPU, P = 2, two cases (~1 min)
"""
import argparse
import json
import os
import socket
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import ring_worker  # noqa: E402
from test_ring import CASES_P2, CASES_P4  # noqa: E402


def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run-cpu", action="store_true", help="gloo on the CPU, P = 2, two cases")
    args = ap.parse_args()
    if args.dry_run_cpu:
        backend, runs = "gloo", [(2, [c for c in CASES_P2 if c["name"] in ("mix_causal", "hilbert_segment")])]
    else:
        if not torch.cuda.is_available():
            print("ring_smoke.py needs CUDA GPUs (--dry-run-cpu: gloo on the CPU)")
            return 2
        n = torch.cuda.device_count()
        backend, runs = "nccl", [(P, cases) for P, cases in ((2, CASES_P2), (4, CASES_P4)) if P <= n]
    bad = 0
    for P, cases in runs:
        cases = [c for c in cases if not c.get("expect_error") or P == 4]
        d = tempfile.mkdtemp()
        mp.start_processes(ring_worker.worker, args=(P, port(), cases, d, backend), nprocs=P, join=True,
                           start_method="spawn")
        for r in range(P):
            with open(os.path.join(d, f"rank{r}.json")) as f:
                rep = json.load(f)
            bad += len(rep["fails"])
            print(f"P={P} rank {r}: passed {len(rep['passed'])}, fails: {rep['fails']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
