#!/bin/bash
# one-off device call (deleted after): b0_before_a1
export PYTHONPATH=. NCCL_NVLS_ENABLE=0
C=$1
nvidia-smi --query-gpu=name --format=csv | tee $OUT/gpu.txt
timeout 150 python -m pytest -q -m gpu tests/test_gpu_mla.py -k "b0_before_a1" -v -p no:cacheprovider 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -8 | tee $OUT/gpu_tests.log
timeout 360 python scripts/check_mla_gpu.py --cases none --timing --iters 20 --commit $C --out $OUT/mla_b0_first_check.json \
  --only "fp8_e4m3 h128,fp8_e4m3 h128 b0_before_a1,fp8_e4m3 h128 b64,fp8_e4m3 h128 b64 b0_before_a1,fp8_e4m3 h128 sq2,fp8_e4m3 h128 sq2 b0_before_a1,fp8_e4m3 h128 ragged[1..2L],fp8_e4m3 h128 ragged[1..2L] b0_before_a1,bfloat16 h128,bfloat16 h128 b0_before_a1" 2>&1 | tail -12
