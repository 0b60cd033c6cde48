#!/bin/bash
# one-off device call (deleted after): p0_first
export PYTHONPATH=. NCCL_NVLS_ENABLE=0
C=$1
nvidia-smi --query-gpu=name --format=csv | tee $OUT/gpu.txt
timeout 100 python -m pytest -q -m gpu tests/test_gpu_mla.py -k "p0_first" -v -p no:cacheprovider 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -8 | tee $OUT/gpu_tests.log
timeout 250 python scripts/check_mla_gpu.py --cases none --timing --iters 20 --commit $C --out $OUT/mla_p0_first_check.json \
  --only "fp8_e4m3 h128,fp8_e4m3 h128 p0_first,fp8_e4m3 h128 p0_first early_p0,fp8_e4m3 h128 early_p0,fp8_e4m3 h128 b64,fp8_e4m3 h128 b64 p0_first,fp8_e4m3 h128 sq2,fp8_e4m3 h128 sq2 p0_first,fp8_e4m3 h128 ragged[1..2L],fp8_e4m3 h128 ragged[1..2L] p0_first,bfloat16 h128,bfloat16 h128 p0_first" 2>&1 | tail -14
