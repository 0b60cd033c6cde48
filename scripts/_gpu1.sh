#!/bin/bash
# one-off device call (deleted after): four converting producers for fp8 h16, checked against float64 and timed
export PYTHONPATH=. PYTHONUNBUFFERED=1
C=$1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 90 python -m pytest -q -m gpu tests/test_gpu_mla.py -k "test_swapped_alternate_vs_float64 and (None-4 or 16-4)" -p no:cacheprovider -rA 2>&1 | grep -E "passed|failed|PASS|FAIL|Error" | tee $OUT/gpu_tests_mla_producers4_$C.log
timeout 100 python scripts/check_mla_gpu.py --cases none --timing --iters 20 --commit $C --out $OUT/mla_producers4_check_$C.json \
  --only "fp8_e4m3 h16,fp8_e4m3 h16 producers 4,fp8_e4m3 h16 producers 4 no lookahead,fp8_e4m3 h16 l2 resident producers 4" 2>&1 | tail -6
