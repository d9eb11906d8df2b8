set -x
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
M="sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"
for c in ${CONFIGS:-A C}; do
  timeout 200 ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \
    --section Occupancy --section MemoryWorkloadAnalysis --section LaunchStats \
    --metrics "$M" --csv --page details python3 bench/tools/bwd_ncu_probe.py $c > $OUT/bncu_$c.csv 2> $OUT/bncu_$c.err
  echo "$c rc $?"; tail -3 $OUT/bncu_$c.err; wc -l $OUT/bncu_$c.csv
done
