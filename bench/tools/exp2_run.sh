#!/bin/bash
# one device call: GPU tests on GPU 0 beside the benches on GPU 1 (gluon_exp2 and the folded scale)
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p $OUT/r/new $OUT/r/old
(CUDA_VISIBLE_DEVICES=0 timeout 420 python -m pytest -q -o addopts="" -p no:cacheprovider tests/test_gluon.py tests/test_gluon_bwd.py tests/test_gluon_lanes.py -k "sm90 or replay" > $OUT/r/tests.log 2>&1; echo "exit $?" >> $OUT/r/tests.log) &
G='"gluon_fwd": true'
NC="{\"g\": {$G}, \"g_e2\": {$G, \"gluon_exp2\": 2}, \"g_e4\": {$G, \"gluon_exp2\": 4}, \"g_e8\": {$G, \"gluon_exp2\": 8}}"
L='"lanes": "all", "gluon_lanes": true'
CA="{\"L\": {$L}, \"L_e2\": {$L, \"gluon_exp2\": 2}, \"L_e4\": {$L, \"gluon_exp2\": 4}, \"L_e8\": {$L, \"gluon_exp2\": 8}}"
export CUDA_VISIBLE_DEVICES=1
python bench/bench_forward.py --configs A,C --no-causal --quick --no-plot --methods dilgen,cudnn_floor --tunings "$NC" --out $OUT/r/new > $OUT/r/new_nc.log 2>&1
python bench/bench_forward.py --configs A,C --causal-only --quick --no-plot --methods dilgen,cudnn_floor --tunings "$CA" --out $OUT/r/new/c > $OUT/r/new_ca.log 2>&1
(export PYTHONPATH=$PWD/old DILGEN_CACHE_DIR=/tmp/oldcache
 python old/bench/bench_forward.py --configs A,C --no-causal --quick --no-plot --methods dilgen --tunings "{\"g\": {$G}}" --out $OUT/r/old > $OUT/r/old_nc.log 2>&1
 python old/bench/bench_forward.py --configs A,C --causal-only --quick --no-plot --methods dilgen --tunings "{\"L\": {$L}}" --out $OUT/r/old/c > $OUT/r/old_ca.log 2>&1)
wait
cd $OUT && tar -czf r.tgz r && rm -rf r
