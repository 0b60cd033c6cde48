#!/bin/bash
# one-off device call (deleted after): alternate pages (swapped kernel) and tile_release (seesaw) GPU tests and
# timing; the L2-resident (on-chip) bounds
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
C=$1
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
timeout 150 python -m pytest -q -m gpu tests/test_gpu_mla.py -k "alternate or (producer_option and tile and fp8)" -p no:cacheprovider 2>&1 | tail -5 | tee $OUT/gpu_tests_mla_alternate.log
V="fp8_e4m3 h16,fp8_e4m3 h16 alternate,fp8_e4m3 h16 alternate producers 1,fp8_e4m3 h16 l2 resident,fp8_e4m3 h16 l2 resident alternate"
V="$V,fp8_e4m3 h16 ragged[1..2L] alternate,fp8_e4m3 h16 b32 L16384 alternate"
timeout 130 python scripts/check_mla_gpu.py --cases none --timing --iters 20 --commit $C --out $OUT/mla_alternate_check.json \
  --only "$V" 2>&1 | tail -10
timeout 120 python scripts/check_mla_gpu.py --cases none --timing --iters 20 --commit $C --out $OUT/mla_tile_release_check.json \
  --only "fp8_e4m3 h128,fp8_e4m3 h128 tiles b0,fp8_e4m3 h128 tiles a1 b0,fp8_e4m3 h128 b64,fp8_e4m3 h128 b64 tiles b0,fp8_e4m3 h128 b64 tiles a1 b0" 2>&1 | tail -9
timeout 80 python scripts/check_mla_gpu.py --cases none --timing --iters 20 --commit $C --out $OUT/mla_l2_resident_check.json \
  --only "fp8_e4m3 h128 l2 resident,bfloat16 h16,bfloat16 h16 l2 resident" 2>&1 | tail -6
