set -x
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name --format=csv,noheader
python3 bench/tools/gluon_ncu_probe.py --host --out $OUT > $OUT/host.log 2>&1; tail -4 $OUT/host.log
ncu --query-metrics --chip gh100 > $OUT/metrics.txt 2>&1
grep -E "tensor_op_(gmma|hmma)" $OUT/metrics.txt | head -20
M=""
grep -q "^sm__pipe_tensor_op_gmma_cycles_active " $OUT/metrics.txt && M="sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"
grep -q "^sm__pipe_tensor_op_hmma_cycles_active " $OUT/metrics.txt && M="$M${M:+,}sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
for c in A C B; do
  timeout 150 ncu --profile-from-start off --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis --section LaunchStats \
    ${M:+--metrics $M} --csv --page details python3 bench/tools/gluon_ncu_probe.py --profile $c > $OUT/ncu_$c.csv 2> $OUT/ncu_$c.err
  echo "$c rc $?"; tail -2 $OUT/ncu_$c.err; wc -l $OUT/ncu_$c.csv
done
