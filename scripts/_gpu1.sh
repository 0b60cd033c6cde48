#!/bin/bash
# one-off device call (deleted after): the on-chip bound (L2-resident pages)
export PYTHONPATH=. NCCL_NVLS_ENABLE=0
timeout 170 python scripts/check_mla_gpu.py --cases none --timing --iters 20 --commit $1 --out $OUT/mla_l2_resident_check.json \
  --only "fp8_e4m3 h16,fp8_e4m3 h16 l2 resident,bfloat16 h16,bfloat16 h16 l2 resident,fp8_e4m3 h128,fp8_e4m3 h128 l2 resident" 2>&1 | tail -9
