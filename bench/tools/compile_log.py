"""Probe (issue 40): why the first compiled training step of the transformers bench's model
takes minutes with dilgen (seconds with sdpa): one forward + backward under
torch.compile(fullgraph=True) with TORCH_LOGS=output_code,graph_code set by the caller."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import toolkit as tk  # noqa: E402,F401
import bench_transformers as bt  # noqa: E402
import torch  # noqa: E402

dev = torch.device("cuda")
model = bt.make_model("dilgen", 4097, False, dev)
model.config.use_cache = False
ids = torch.randint(0, 256, (1, 4097), device=dev)
compiled = torch.compile(model, fullgraph=True)
t0 = time.perf_counter()
compiled(ids[:, :-1], labels=ids[:, :-1]).loss.backward()
torch.cuda.synchronize()
print(f"first compiled step {time.perf_counter() - t0:.1f} s", flush=True)
print(torch._dynamo.utils.compile_times(repr="str"), flush=True)
