#!/bin/bash
# Device run (issue 42, session 2026-11-28 third): GPU 0 the Gluon lane tests then ncu of the
# lanes forward; GPU 1 the benches (A, B causal forward; E causal mixed; causal backward A, B, C).
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name --format=csv > $OUT/gpus.txt
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 300 python -m pytest -q -o addopts="" -p no:cacheprovider tests/test_gluon_lanes.py -k "sm90 or replay" -rs > $OUT/tests.log 2>&1
  echo "exit $?" >> $OUT/tests.log
  timeout 200 ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \
     --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum \
     --csv --page raw python3 bench/tools/lanes_fwd_ncu.py > $OUT/ncu.csv 2> $OUT/ncu.err
) &
(
  export CUDA_VISIBLE_DEVICES=1
  python bench/bench_forward.py --configs A,B --causal-only --methods dilgen,cudnn_floor --no-plot \
     --tunings '{"tl_lanes": {"gluon_lanes": false}}' --out $OUT/fwd > $OUT/fwd.log 2>&1
  python bench/bench_forward.py --configs E --causal-only --methods dilgen --no-plot \
     --tunings '{"mix": {"gluon_lanes": true}}' --out $OUT/fwdE > $OUT/fwdE.log 2>&1
  python bench/bench_backward.py --configs A,B --causal-only --methods dilgen,cudnn_floor --no-plot \
     --tunings '{"tl_bwd": {"gluon_lanes_bwd": false}}' --out $OUT/bwd > $OUT/bwd.log 2>&1
  python bench/bench_backward.py --configs C --causal-only --methods dilgen,cudnn_floor --no-plot \
     --tunings '{"g64": {"gluon_lanes_bwd": true}}' --out $OUT/bwdC > $OUT/bwdC.log 2>&1
) &
wait
