#!/bin/bash
# Probe driver (issues 40, 41, 43): one x4 machine. Phase 1: the ring example on 4 GPUs, cold
# (fresh dilgen and Triton caches) then warm, timed. Phase 2, one GPU each, side by side: the
# CUDA-graph capture diagnosis, the compile tests on the GPU, transformers compiled, the host bench.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
T0=$(date +%s)
nvidia-smi -L > $O/gpus.txt; python3 -c "import torch,triton;print(torch.__version__,triton.__version__)" >> $O/gpus.txt
ring() {   # label, args...
  local label=$1; shift
  local t=$(date +%s.%N)
  timeout 240 torchrun --nproc-per-node 4 examples/ring_torchrun.py "$@" > $O/ring_$label.txt 2>&1
  local rc=$?
  echo "{\"label\": \"$label\", \"args\": \"$*\", \"rc\": $rc, \"wall_s\": $(python3 -c "import time;print(round(time.time()-$t,1))")}" >> $O/ring_times.jsonl
}
if [ "${SKIP_RING:-0}" != 1 ]; then
  export DILGEN_CACHE_DIR=/tmp/dc_cold TRITON_CACHE_DIR=/tmp/tc_cold
  rm -rf /tmp/dc_cold /tmp/tc_cold
  ring cold_8192_check --tokens 8192 --check
  ring warm_8192_check --tokens 8192 --check
  ring warm_default
  ring warm_default_again
  unset DILGEN_CACHE_DIR TRITON_CACHE_DIR
fi
left=$(( 570 - ($(date +%s) - T0) ))
echo "phase 2 with $left s" >> $O/gpus.txt
(for c in "A 32768" "A 8192" "F 32768" "C 16384"; do CUDA_VISIBLE_DEVICES=0 timeout $left python3 bench/tools/graph_diag.py $O $c; done > $O/graph_diag.txt 2>&1) &
CUDA_VISIBLE_DEVICES=1 timeout $left python3 -m pytest -o addopts="" -q -p no:cacheprovider --tb=long tests/test_compile.py tests/test_decode_compile.py tests/test_transformers_compile.py > $O/pytest_compile.txt 2>&1 &
CUDA_VISIBLE_DEVICES=2 timeout $left python3 bench/tools/hf_compiled.py --out $O > $O/hf_compiled.txt 2>&1 &
CUDA_VISIBLE_DEVICES=3 timeout $left python3 bench/bench_forward.py --host --configs A,C,F --quick --out $O > $O/host.txt 2>&1 &
wait
echo "done at $(( $(date +%s) - T0 )) s" >> $O/gpus.txt
