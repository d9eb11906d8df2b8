#!/bin/bash
# Device run (issue 42): GPU 0 the Gluon lane tests then ncu of the lanes forward; GPU 1 the
# benches: A, B causal and not with the paired-tile lanes and (old/, carried) the commit before;
# E causal; causal fwd+bwd A, B, C. Everything comes back as one archive.
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv > $R/gpus.txt
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 300 python -m pytest -q -o addopts="" -p no:cacheprovider tests/test_gluon_lanes.py -k "sm90 or replay" -rs > $R/tests.log 2>&1
  echo "exit $?" >> $R/tests.log
  timeout 200 ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \
     --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum \
     --csv --page raw python3 bench/tools/lanes_fwd_ncu.py > $R/ncu.csv 2> $R/ncu.err
) &
(
  export CUDA_VISIBLE_DEVICES=1
  (cd old && DILGEN_CACHE_DIR=/tmp/oldcache PYTHONPATH=$PWD/old python bench/bench_forward.py --configs A,B --causal-only \
     --methods dilgen --no-plot --out $R/fwd_old > $R/fwd_old.log 2>&1)
  python bench/bench_forward.py --configs A,B --methods dilgen,cudnn_floor --no-plot \
     --tunings '{"tl_lanes": {"gluon_lanes": false}}' --out $R/fwd > $R/fwd.log 2>&1
  python bench/bench_forward.py --configs E --causal-only --methods dilgen --no-plot \
     --tunings '{"tl_e": {"gluon_lanes": false}}' --out $R/fwdE > $R/fwdE.log 2>&1
  python bench/bench_backward.py --configs A,B --causal-only --methods dilgen,cudnn_floor --no-plot \
     --tunings '{"tl_bwd": {"gluon_lanes_bwd": false}}' --out $R/bwd > $R/bwd.log 2>&1
  python bench/bench_backward.py --configs C --causal-only --methods dilgen,cudnn_floor --no-plot \
     --tunings '{"tl_bwd": {"gluon_lanes_bwd": false}}' --out $R/bwdC > $R/bwdC.log 2>&1
) &
wait
tar -czf $OUT/r.tgz -C $OUT r && rm -rf $R
