#!/bin/bash
# one-off device call (deleted after): the routing kernels (align_kernel, moe_router's selection) on the GPU: tests,
# bench_router, then the MoE and the V3 slice with them; on an H200 also the MLA targets' shapes.
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
C=$1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$GPU"
case "$GPU" in *H200*) TAG=h200;; *) TAG=h100;; esac
if [ "$2" = mla ]; then
V="fp8_e4m3 h16,fp8_e4m3 h16 loads first,fp8_e4m3 h16 l2 resident,fp8_e4m3 h16 l2 resident loads first"
V="$V,fp8_e4m3 h16 b32 L16384,fp8_e4m3 h16 b32 L16384 loads first,bfloat16 h128,fp8_e4m3 h128,fp8_e4m3 h128 sq2"
timeout 150 python scripts/check_mla_gpu.py --cases none --timing --iters 20 --commit $C --out $OUT/mla_targets_${TAG}_$C.json \
  --only "$V" 2>&1 | grep -vE "^\s*$|WARNING|^I[0-9]" | tail -14
  exit 0
fi
timeout 120 python -m pytest -q -m gpu tests/test_gpu_w4a16.py -k "align_kernel or router_select" -p no:cacheprovider \
  -rA 2>&1 | grep -E "passed|failed|PASS|FAIL|Error|assert" | head -20 | tee $OUT/gpu_tests_routing_${TAG}_$C.log
timeout 100 python scripts/bench_router.py --commit $C --out $OUT/router_${TAG}_$C.json 2>&1 | grep -v "^\[time\]" | tail -32
timeout 170 python scripts/bench_generate.py --v3-slice --commit $C --out $OUT/generate_v3_slice_${TAG}_$C.json 2>&1 | tail -6
timeout 150 python scripts/bench_w4a16.py --backends mosaic_sm90 --quick --commit $C --out $OUT/w4a16_quick_${TAG}_$C.json 2>&1 | tail -22
