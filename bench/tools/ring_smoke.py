"""GPU smoke of the ring: tests/ring_worker.py's cases over NCCL (P = 2 and 4).

    python bench/tools/ring_smoke.py          # needs 4 GPUs
"""
import json, os, socket, sys, tempfile
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import torch.multiprocessing as mp
import ring_worker
from test_ring import CASES_P2, CASES_P4

def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]

if __name__ == "__main__":
    for P, cases in ((2, CASES_P2), (4, CASES_P4)):
        cases = [c for c in cases if not c.get("expect_error") or P == 4]
        d = tempfile.mkdtemp()
        mp.start_processes(ring_worker.worker, args=(P, port(), cases, d, "nccl"), nprocs=P, join=True, start_method="spawn")
        for r in range(P):
            rep = json.load(open(os.path.join(d, f"rank{r}.json")))
            print(f"P={P} rank {r}: passed {len(rep['passed'])}, fails: {rep['fails']}")
