#!/bin/bash
# one-off device call (deleted after): tile_release's GPU tests and timing; the L2-resident (on-chip) bounds
export PYTHONPATH=. NCCL_NVLS_ENABLE=0
C=$1
nvidia-smi --query-gpu=name,power.limit --format=csv,noheader
timeout 170 python -m pytest -q -m gpu tests/test_gpu_mla.py -k producer_option -p no:cacheprovider 2>&1 | tail -4 | tee $OUT/gpu_tests_mla_tile_release.log
V="fp8_e4m3 h128,fp8_e4m3 h128 tiles b0,fp8_e4m3 h128 tiles a1 b0"
for s in " b64" " sq2" " ragged[1..2L]"; do V="$V,fp8_e4m3 h128$s,fp8_e4m3 h128$s tiles b0,fp8_e4m3 h128$s tiles a1 b0"; done
timeout 230 python scripts/check_mla_gpu.py --cases none --timing --iters 20 --commit $C --out $OUT/mla_tile_release_check.json \
  --only "$V" 2>&1 | tail -14
timeout 110 python scripts/check_mla_gpu.py --cases none --timing --iters 20 --commit $C --out $OUT/mla_l2_resident_check.json \
  --only "fp8_e4m3 h16,fp8_e4m3 h16 l2 resident,bfloat16 h16,bfloat16 h16 l2 resident,fp8_e4m3 h128 l2 resident" 2>&1 | tail -8
