#!/bin/bash
# one-off device call (deleted after). On an H200: issue 13's W4A16 targets and the V3 slice.
# On an H100: the merge by tiling, the default fp8 h16 plan with loads_first (timing).
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
C=$1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$GPU"
case "$GPU" in *H200*) TAG=h200;; *) TAG=h100;; esac
if [ $TAG = h200 ]; then
  timeout 160 python scripts/bench_w4a16.py --backends mosaic_sm90 --quick --commit $C --out $OUT/w4a16_quick_${TAG}_$C.json 2>&1 | tail -22
  timeout 170 python scripts/bench_generate.py --v3-slice --commit $C --out $OUT/generate_v3_slice_${TAG}_$C.json 2>&1 | tail -5
  exit 0
fi
timeout 120 python scripts/bench_merge.py --commit $C --out $OUT/merge_${TAG}_$C.json 2>&1 | tail -8
timeout 140 python scripts/check_mla_gpu.py --cases none --timing --iters 20 --commit $C --out $OUT/mla_loads_first_${TAG}_$C.json \
  --only "fp8_e4m3 h16,fp8_e4m3 h16 loads first,fp8_e4m3 h16 l2 resident,fp8_e4m3 h16 l2 resident loads first,fp8_e4m3 h16 ragged[1..2L],fp8_e4m3 h16 ragged[1..2L] loads first,fp8_e4m3 h16 b32 L16384,fp8_e4m3 h16 b32 L16384 loads first" 2>&1 | grep -vE "^\s*$|WARNING|^I[0-9]" | tail -12
