#!/bin/bash
# one-off device call (deleted after): the new fp8 defaults (seesaw tile_release b0; swapped h16 alternate +
# lookahead) through the production path, and their timing
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
C=$1
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
timeout 140 python -m pytest -q -m gpu tests/test_gpu_mla.py -k "(test_mla_decode_vs_float64 and fp8) or (seesaw_kernel_vs_float64 and fp8)" -p no:cacheprovider -rA 2>&1 | grep -E "passed|failed|PASS|FAIL|Error" | tee $OUT/gpu_tests_mla_defaults.log
timeout 45 python scripts/check_mla_gpu.py --cases none --timing --iters 20 --commit $C --out $OUT/mla_new_defaults_check.json \
  --only "fp8_e4m3 h16,fp8_e4m3 h128" 2>&1 | tail -4
