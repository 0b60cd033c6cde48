#!/bin/bash
# one-off device call (deleted after): loads_ahead without the L2 prefetch, early_p0 with fp8
export PYTHONPATH=. NCCL_NVLS_ENABLE=0
C=$1
nvidia-smi --query-gpu=name --format=csv | tee $OUT/gpu.txt
timeout 120 python -m pytest -q -m gpu tests/test_gpu_mla.py -k "other_p0_order and fp8" -v -p no:cacheprovider 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -8 | tee $OUT/gpu_tests.log
timeout 400 python scripts/check_mla_gpu.py --cases none --timing --iters 20 --commit $C --out $OUT/mla_loads_ahead2_check.json \
  --only "fp8_e4m3 h128,fp8_e4m3 h128 loads_ahead l2 0,fp8_e4m3 h128 early_p0,fp8_e4m3 h128 loads_ahead l2 0 early_p0,fp8_e4m3 h128 b64,fp8_e4m3 h128 b64 loads_ahead l2 0,fp8_e4m3 h128 b64 early_p0,fp8_e4m3 h128 sq2,fp8_e4m3 h128 sq2 loads_ahead l2 0,fp8_e4m3 h128 ragged[1..2L],fp8_e4m3 h128 ragged[1..2L] loads_ahead l2 0" 2>&1 | tail -14
