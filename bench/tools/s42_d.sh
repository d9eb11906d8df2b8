#!/bin/bash
# Device run (issue 42): GPU 0 the Gluon lane tests (new: no r = 1 branch, causal and not);
# GPU 1 D forward and fwd+bwd, causal and not, Gluon lanes (default) against the tl lanes.
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$OUT/r; mkdir -p $R
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 330 python -m pytest -q -o addopts="" -p no:cacheprovider tests/test_gluon_lanes.py -k "sm90 or replay" -rs > $R/tests.log 2>&1
  echo "exit $?" >> $R/tests.log
) &
(
  export CUDA_VISIBLE_DEVICES=1
  python bench/bench_forward.py --configs D --methods dilgen,cudnn_floor --no-plot \
     --tunings '{"tl_lanes": {"gluon_lanes": false}}' --out $R/fwd > $R/fwd.log 2>&1
  python bench/bench_backward.py --configs D --methods dilgen,cudnn_floor --no-plot \
     --tunings '{"tl_lanes": {"gluon_lanes": false}}' --out $R/bwd > $R/bwd.log 2>&1
) &
wait
tar -czf $OUT/r.tgz -C $OUT r && rm -rf $R
