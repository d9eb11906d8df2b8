#!/bin/bash
# Device run (issue 42): the benches the Gluon lane defaults move, at the session's last code:
# GPU 0 forward A, B (causal and not) and E causal, then the Gluon lane tests; GPU 1 causal fwd+bwd A, B, C. One archive.
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv > $R/gpus.txt
(
  export CUDA_VISIBLE_DEVICES=0
  python bench/bench_forward.py --configs A,B --methods dilgen,cudnn_floor --no-plot \
     --tunings '{"tl_lanes": {"gluon_lanes": false}}' --out $R/fwd > $R/fwd.log 2>&1
  python bench/bench_forward.py --configs E --causal-only --methods dilgen --no-plot \
     --tunings '{"tl_e": {"gluon_lanes": false}}' --out $R/fwdE > $R/fwdE.log 2>&1
  timeout 280 python -m pytest -q -o addopts="" -p no:cacheprovider tests/test_gluon_lanes.py -k "sm90 or replay" -rs > $R/tests.log 2>&1
  echo "exit $?" >> $R/tests.log
) &
(
  export CUDA_VISIBLE_DEVICES=1
  python bench/bench_backward.py --configs A,B --causal-only --methods dilgen,cudnn_floor --no-plot \
     --tunings '{"tl_bwd": {"gluon_lanes_bwd": false}}' --out $R/bwd > $R/bwd.log 2>&1
  python bench/bench_backward.py --configs C --causal-only --methods dilgen,cudnn_floor --no-plot \
     --tunings '{"tl_bwd": {"gluon_lanes_bwd": false}}' --out $R/bwdC > $R/bwdC.log 2>&1
) &
wait
tar -czf $OUT/r.tgz -C $OUT r && rm -rf $R
