#!/bin/bash
# one-off device call (deleted after): the fp8 MLA defaults through the production path, issue 13's H200 numbers
# where the card is an H200, the MLA targets' shapes, and the V3 slice (its step's kernels on an H100)
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
C=$1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$GPU"
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
case "$GPU" in *H200*) TAG=h200;; *) TAG=h100;; esac
if [ $TAG = h200 ]; then
  timeout 170 python scripts/bench_w4a16.py --backends mosaic_sm90 --quick --commit $C --out $OUT/w4a16_quick_${TAG}_$C.json 2>&1 | tail -22
  timeout 130 python scripts/bench_generate.py --v3-slice --commit $C --out $OUT/generate_v3_slice_${TAG}_$C.json 2>&1 | tail -8
  timeout 150 python scripts/check_mla_gpu.py --cases none --timing --iters 20 --commit $C --out $OUT/mla_targets_check_${TAG}_$C.json \
    --only "fp8_e4m3 h16,fp8_e4m3 h16 b32 L16384,fp8_e4m3 h128,bfloat16 h128,fp8_e4m3 h128 sq2,fp8_e4m3 h16 l2 resident,bfloat16 h128 l2 resident,fp8_e4m3 h128 l2 resident" 2>&1 | tail -11
  timeout 90 python -m pytest -q -m gpu tests/test_gpu_mla.py -k "(test_mla_decode_vs_float64 and fp8) or (seesaw_kernel_vs_float64 and fp8)" -p no:cacheprovider -rA 2>&1 | grep -E "passed|failed|PASS|FAIL|Error" | tee $OUT/gpu_tests_mla_defaults_${TAG}_$C.log
else
  timeout 120 python -m pytest -q -m gpu tests/test_gpu_mla.py -k "(test_mla_decode_vs_float64 and fp8) or (seesaw_kernel_vs_float64 and fp8)" -p no:cacheprovider -rA 2>&1 | grep -E "passed|failed|PASS|FAIL|Error" | tee $OUT/gpu_tests_mla_defaults_${TAG}_$C.log
  timeout 160 python scripts/check_mla_gpu.py --cases none --timing --iters 20 --commit $C --out $OUT/mla_defaults_check_${TAG}_$C.json \
    --only "fp8_e4m3 h16,fp8_e4m3 h16 ragged[1..2L],fp8_e4m3 h16 b32 L16384,fp8_e4m3 h128,bfloat16 h128,bfloat16 h128 l2 resident,fp8_e4m3 h128 l2 resident" 2>&1 | tail -10
  timeout 130 python scripts/bench_generate.py --v3-slice --step-kernels --commit $C --out $OUT/v3_step_kernels_${TAG}_$C.json 2>&1 | tail -30
  timeout 120 python scripts/bench_generate.py --v3-slice --commit $C --out $OUT/generate_v3_slice_${TAG}_$C.json 2>&1 | tail -8
fi
