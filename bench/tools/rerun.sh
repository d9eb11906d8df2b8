#!/bin/bash
# one device call: issue 42's rows re-run (forward A-F, fwd+bwd A and C, decode, varlen, ring at 2)
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R=$OUT/r; mkdir -p $R/fwd $R/bwd $R/dec $R/var $R/ring
(export CUDA_VISIBLE_DEVICES=0
 timeout 150 python -m pytest -q -o addopts="" -p no:cacheprovider tests/test_gluon_bwd.py -k "head_dim_64" > $R/tests.log 2>&1; echo "exit $?" >> $R/tests.log
 timeout 260 python bench/bench_forward.py --quick --no-plot --methods dilgen,cudnn_floor --out $R/fwd > $R/fwd.log 2>&1
 timeout 120 python bench/bench_decode.py --methods dilgen --contexts 16384,131072 --warmup 5 --reps 20 --no-plot --out $R/dec > $R/dec.log 2>&1) &
(export CUDA_VISIBLE_DEVICES=1
 timeout 240 python bench/bench_backward.py --configs A,C --quick --no-plot --methods dilgen,cudnn_floor --out $R/bwd > $R/bwd.log 2>&1
 timeout 250 python bench/bench_varlen.py --methods dilgen_varlen,dilgen_one_sequence --warmup 2 --reps 5 --out $R/var > $R/var.log 2>&1) &
wait
timeout 100 python bench/bench_ring.py --gpus 1 2 --orders raster --no-plot --out $R/ring > $R/ring.log 2>&1
cd $OUT && tar -czf r.tgz r && rm -rf r
