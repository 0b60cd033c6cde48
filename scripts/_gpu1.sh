#!/bin/bash
# one-off device call (deleted after). On an H200: issue 13's W4A16 targets, the V3 slice, the MLA targets' shapes
# and the fp8 h16 default against loads_first / the producers' plan. On an H100: nothing (the figures exist).
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
C=$1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$GPU"
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
case "$GPU" in *H200*) TAG=h200;; *) TAG=h100;; esac
[ $TAG = h200 ] || exit 0
timeout 170 python scripts/bench_w4a16.py --backends mosaic_sm90 --quick --commit $C --out $OUT/w4a16_quick_${TAG}_$C.json 2>&1 | tail -22
timeout 170 python scripts/bench_generate.py --v3-slice --commit $C --out $OUT/generate_v3_slice_${TAG}_$C.json 2>&1 | tail -6
V="fp8_e4m3 h16,fp8_e4m3 h16 loads first,fp8_e4m3 h16 producers,fp8_e4m3 h16 l2 resident,fp8_e4m3 h16 l2 resident loads first"
V="$V,fp8_e4m3 h16 ragged[1..2L],fp8_e4m3 h16 ragged[1..2L] loads first,fp8_e4m3 h16 b32 L16384,fp8_e4m3 h16 b32 L16384 loads first"
V="$V,bfloat16 h128,fp8_e4m3 h128,fp8_e4m3 h128 sq2,fp8_e4m3 h128 ragged[1..2L],bfloat16 h128 l2 resident"
timeout 230 python scripts/check_mla_gpu.py --cases none --timing --iters 20 --commit $C --out $OUT/mla_targets_${TAG}_$C.json \
  --only "$V" 2>&1 | grep -vE "^\s*$|WARNING|^I[0-9]" | tail -18
