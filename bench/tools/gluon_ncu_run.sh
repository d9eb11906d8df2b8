set -x
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv,noheader
python3 bench/tools/gluon_ncu_probe.py --host --out $OUT > $OUT/host.log 2>&1; tail -4 $OUT/host.log
M=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
for c in ${NCU_CONFIGS:-A C B}; do
  timeout 150 ncu --profile-from-start off --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis --section LaunchStats \
    --metrics $M --csv --page details python3 bench/tools/gluon_ncu_probe.py --profile $c > $OUT/ncu_$c.csv 2> $OUT/ncu_$c.err
  echo "$c rc $?"
done
python3 -m pytest -q -o addopts="" -p no:cacheprovider tests/test_gluon.py 2>&1 | tail -3
