#!/bin/bash
# device run 1: GPU w4a16 tests + sustained x_reuse A/B
export PYTHONPATH=$PWD
SHA=$1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
timeout 240 python -m pytest -q -m gpu tests/test_gpu_w4a16.py > $OUT/gpu_tests_w4a16_$SHA.log 2>&1; tail -3 $OUT/gpu_tests_w4a16_$SHA.log
timeout 300 python scripts/bench_w4a16_clocks.py --t 64 --group 128 --seconds 3 --commit $SHA \
  --configs '[{}, {"x_reuse":2}, {"x_reuse":4}, {"x_reuse":2,"x_reuse_min_stages":4}, {"num_stages":3}, {}, {"x_reuse":2}]' \
  --out $OUT/w4a16_clocks_xr_t64_h200_$SHA.json 2>&1 | tail -11
