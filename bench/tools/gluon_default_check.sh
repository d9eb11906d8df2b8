# GPU check (issue 42): the Gluon forward as sm90's default at head_dim 128, built ahead of time.
set -x
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export DILGEN_CACHE_DIR=$OUT/cache
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -m dilgen.cli build examples/specs --arch sm90 --seq-len 32768 > $OUT/build.log 2>&1; tail -2 $OUT/build.log
python3 - > $OUT/aot.log 2>&1 <<'PY'
import json, torch, dilgen
from dilgen import aot
spec = dilgen.load_spec("examples/specs/longnet_base.json")
k = dilgen.compile(spec)
q = torch.randn(1, 32768, spec.num_heads, spec.head_dim, device="cuda", dtype=torch.bfloat16)
out, lse = k(q, q, q, return_lse=True)
torch.cuda.synchronize()
attn = k.compiled_for(q.device).attention
print(json.dumps({"gluon_fwd": attn.plan["config"].get("gluon_fwd"), "stats": dict(aot.STATS),
                  "fallbacks": aot.FALLBACKS, "nan": bool(out.isnan().any())}))
PY
cat $OUT/aot.log | tail -3
unset DILGEN_CACHE_DIR
python3 bench/tools/gluon_ncu_probe.py --host --out $OUT > $OUT/host.log 2>&1; tail -3 $OUT/host.log | cut -c1-300
python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/test_gluon.py tests/test_host_path.py 2>&1 | tail -3
