#!/bin/bash
# Probe driver, second call on the same x4 machine: one GPU each, side by side; every output in one tarball.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
O=/tmp/s2; rm -rf $O; mkdir -p $O/gen $O/train
L=${LEFT:-540}
CUDA_VISIBLE_DEVICES=0 timeout $L python3 bench/bench_forward.py --host --configs A,C,F --quick --out $O > $O/host.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout $L python3 -m pytest -o addopts="" -q -p no:cacheprovider --tb=long tests/test_compile.py tests/test_decode_compile.py tests/test_transformers_compile.py > $O/pytest_compile.txt 2>&1 &
CUDA_VISIBLE_DEVICES=2 timeout $L python3 bench/tools/hf_compiled.py --contexts "" --out $O/gen > $O/hf_gen.txt 2>&1 &
CUDA_VISIBLE_DEVICES=3 timeout $L python3 bench/tools/hf_compiled.py --contexts 8192 --no-generate --out $O/train > $O/hf_train.txt 2>&1 &
( while sleep 20; do tar czf $OUT/s2.tgz -C $O . 2>/dev/null; done ) &
wait -n; wait -n; wait -n; wait -n
tar czf $OUT/s2.tgz -C $O .
