#!/bin/bash
# Probe driver, third call: generation compiled (GPU 0), the one-call form under dynamo verbose (GPU 1).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=/tmp/s3; rm -rf $O; mkdir -p $O/gen
CUDA_VISIBLE_DEVICES=0 timeout 400 python3 bench/tools/hf_compiled.py --contexts "" --out $O/gen > $O/hf_gen.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 400 python3 -m pytest -o addopts="" -q -p no:cacheprovider --tb=long -x tests/test_compile.py tests/test_decode_compile.py tests/test_transformers_compile.py > $O/pytest_compile.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 TORCH_LOGS=output_code,graph_code timeout 400 python3 bench/tools/compile_log.py > $O/compile_log.txt 2>&1 &
( while sleep 15; do tar czf $OUT/s3.tgz -C $O . 2>/dev/null; done ) &
wait -n; wait -n; wait -n
tar czf $OUT/s3.tgz -C $O .
