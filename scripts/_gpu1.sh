#!/bin/bash
# one-off device call (deleted after): lookahead (the converting producers load the next page ahead), with and
# without alternate: GPU tests and timing
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
C=$1
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
timeout 90 python -m pytest -q -m gpu tests/test_gpu_mla.py -k "lookahead" -p no:cacheprovider -rA 2>&1 | grep -E "passed|failed|PASS|FAIL" | tee $OUT/gpu_tests_mla_lookahead.log
V="fp8_e4m3 h16,fp8_e4m3 h16 lookahead,fp8_e4m3 h16 lookahead alternate,fp8_e4m3 h16 l2 resident lookahead,fp8_e4m3 h16 l2 resident lookahead alternate"
V="$V,fp8_e4m3 h16 ragged[1..2L] lookahead,fp8_e4m3 h16 b32 L16384 lookahead"
timeout 150 python scripts/check_mla_gpu.py --cases none --timing --iters 20 --commit $C --out $OUT/mla_lookahead_check.json \
  --only "$V" 2>&1 | tail -10
timeout 75 python scripts/check_mla_gpu.py --cases none --timing --iters 20 --commit $C --out $OUT/mla_tile_release_sq2_ragged_check.json \
  --only "fp8_e4m3 h128 sq2,fp8_e4m3 h128 sq2 tiles b0,fp8_e4m3 h128 ragged[1..2L],fp8_e4m3 h128 ragged[1..2L] tiles b0" 2>&1 | tail -6
