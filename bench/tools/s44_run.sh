#!/bin/bash
# one device call: the Gluon forward beside lane branches, GPU tests (GPU 0) and E, F timing (GPU 1)
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$OUT/r; mkdir -p $R/fwd
(CUDA_VISIBLE_DEVICES=0 timeout 280 python -m pytest -q -o addopts="" -p no:cacheprovider tests/test_gluon.py -k "beside" -rs > $R/tests.log 2>&1; echo "exit $?" >> $R/tests.log) &
CUDA_VISIBLE_DEVICES=1 timeout 280 python bench/bench_forward.py --configs E,F --no-causal --quick --no-plot --methods dilgen,cudnn_floor --tunings '{"tl": {"gluon_fwd": false}}' --out $R/fwd > $R/fwd.log 2>&1
wait
cd $OUT && tar -czf r.tgz r && rm -rf r
