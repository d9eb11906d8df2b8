#!/bin/bash
# one device call: ncu of C's forward (gluon_exp2 8 against 0), then the ring at 1 and 2 GPUs
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$OUT/r; mkdir -p $R/ring
CUDA_VISIBLE_DEVICES=0 timeout 150 ncu --profile-from-start off --clock-control none --section SpeedOfLight \
  --section WarpStateStats --section ComputeWorkloadAnalysis \
  --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum \
  --csv --page raw python3 bench/tools/c_exp2_ncu.py > $R/ncu.csv 2> $R/ncu.err
timeout 300 python bench/bench_ring.py --gpus 1 2 --orders raster --no-plot --out $R/ring > $R/ring.log 2>&1
cd $OUT && tar -czf r.tgz r && rm -rf r
