#!/bin/bash
# one device call: GPU checks of the gl.fma softmax (GPU 0) beside A and C timing (GPU 1)
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$OUT/r; mkdir -p $R/fwd
(CUDA_VISIBLE_DEVICES=0 timeout 170 python -m pytest -q -o addopts="" -p no:cacheprovider tests/test_gluon.py tests/test_gluon_lanes.py -k "beside or a_like_gqa or head_dim_64_exp2" -rs > $R/tests.log 2>&1; echo "exit $?" >> $R/tests.log) &
CUDA_VISIBLE_DEVICES=1 timeout 170 python bench/bench_forward.py --configs A,C --quick --no-plot --no-check --methods dilgen --out $R/fwd > $R/fwd.log 2>&1
wait
cd $OUT && tar -czf r.tgz r && rm -rf r
