#!/bin/bash
# one-off device call (deleted after). On an H200 (unless $2 = cuts): issue 13's W4A16 targets, the V3 slice and
# the MLA targets' shapes at the present defaults. Else: the opt-in cuts scale_on_s / lazy_rescale (tests, timing).
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
C=$1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$GPU"
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
case "$GPU" in *H200*) TAG=h200;; *) TAG=h100;; esac
if [ $TAG = h200 ] && [ "$2" != cuts ]; then
  timeout 170 python scripts/bench_w4a16.py --backends mosaic_sm90 --quick --commit $C --out $OUT/w4a16_quick_${TAG}_$C.json 2>&1 | tail -22
  timeout 130 python scripts/bench_generate.py --v3-slice --commit $C --out $OUT/generate_v3_slice_${TAG}_$C.json 2>&1 | tail -8
  timeout 200 python scripts/check_mla_gpu.py --cases none --timing --iters 20 --commit $C --out $OUT/mla_targets_${TAG}_$C.json \
    --only "fp8_e4m3 h16,fp8_e4m3 h16 b32 L16384,fp8_e4m3 h16 ragged[1..2L],fp8_e4m3 h16 l2 resident,fp8_e4m3 h16 producers,bfloat16 h128,fp8_e4m3 h128,fp8_e4m3 h128 sq2,fp8_e4m3 h128 ragged[1..2L],bfloat16 h128 l2 resident" 2>&1 | grep -vE "^\s*$|WARNING|^I[0-9]" | tail -14
  exit 0
fi
timeout 200 python -m pytest -q -m gpu tests/test_gpu_mla.py -k "test_swapped_shared_loop_vs_float64 and (scale_on_s or lazy)" \
  -p no:cacheprovider -rA 2>&1 | grep -E "passed|failed|PASS|FAIL|Error|assert" | head -40 | tee $OUT/gpu_tests_mla_cuts_${TAG}_$C.log
V=""
for l in "" " l2 resident" " ragged[1..2L]" " b32 L16384"; do
  for n in "" " scale on s" " lazy rescale" " lazy rescale scale on s"; do V="$V,fp8_e4m3 h16$l$n"; done
done
V="${V#,},fp8_e4m3 h16 sq2 rows_per_cta 16,fp8_e4m3 h16 sq2 rows_per_cta 16 scale on s"
timeout 330 python scripts/check_mla_gpu.py --cases none --timing --iters 20 --commit $C \
  --out $OUT/mla_cuts_${TAG}_$C.json --only "$V" 2>&1 | grep -vE "^\s*$|WARNING|^I[0-9]" | tail -40
