#!/bin/bash
# one-off device call (deleted after). On an H200: issue 13's W4A16 targets, the V3 slice and the MLA targets'
# shapes at the present defaults (scale_on_s on). Else: the new default through the production op on the GPU
# (tests, the h16 correctness cases) and ncu of its L2-resident run (what bounds it now).
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
C=$1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$GPU"
case "$GPU" in *H200*) TAG=h200;; *) TAG=h100;; esac
if [ $TAG = h200 ]; then
  timeout 170 python scripts/bench_w4a16.py --backends mosaic_sm90 --quick --commit $C --out $OUT/w4a16_quick_${TAG}_$C.json 2>&1 | tail -22
  timeout 130 python scripts/bench_generate.py --v3-slice --commit $C --out $OUT/generate_v3_slice_${TAG}_$C.json 2>&1 | tail -8
  timeout 200 python scripts/check_mla_gpu.py --cases none --timing --iters 20 --commit $C --out $OUT/mla_targets_${TAG}_$C.json \
    --only "fp8_e4m3 h16,fp8_e4m3 h16 b32 L16384,fp8_e4m3 h16 ragged[1..2L],fp8_e4m3 h16 l2 resident,fp8_e4m3 h16 producers,bfloat16 h128,fp8_e4m3 h128,fp8_e4m3 h128 sq2,fp8_e4m3 h128 ragged[1..2L],bfloat16 h128 l2 resident" 2>&1 | grep -vE "^\s*$|WARNING|^I[0-9]" | tail -14
  exit 0
fi
timeout 150 python -m pytest -q -m gpu tests/test_gpu_mla.py -k "(test_mla_decode_vs_float64 and fp8) or test_swapped_shared_loop_vs_float64" \
  -p no:cacheprovider -rA 2>&1 | grep -E "passed|failed|FAIL|Error|assert" | head -30 | tee $OUT/gpu_tests_mla_sos_default_${TAG}_$C.log
timeout 120 python scripts/check_mla_gpu.py --cases full --case-grep h16 --commit $C --out $OUT/mla_sos_default_check_${TAG}_$C.json 2>&1 \
  | grep -vE "^\s*$|WARNING|^I[0-9]" | tail -25
timeout 100 python scripts/check_mla_gpu.py --cases none --timing --iters 20 --commit $C --out $OUT/mla_sos_default_timing_${TAG}_$C.json \
  --only "fp8_e4m3 h16,fp8_e4m3 h16 ragged[1..2L],fp8_e4m3 h16 l2 resident,fp8_e4m3 h16 b32 L16384" 2>&1 | grep -vE "^\s*$|WARNING|^I[0-9]" | tail -6
name="fp8_e4m3 h16 l2 resident"; tag=fp8_h16_l2_sos
timeout 120 ncu --clock-control none --kernel-name body_mosaic_gpu_kernel --launch-skip 1 --launch-count 1 --set full \
  -o /tmp/$tag python scripts/ncu_mla.py --variant "$name" > /tmp/$tag.log 2>&1; tail -2 /tmp/$tag.log
python scripts/ncu_sass_summary.py /tmp/$tag.ncu-rep --top 40 > $OUT/ncu_${tag}_sass_${TAG}_$C.txt 2>&1
head -30 $OUT/ncu_${tag}_sass_${TAG}_$C.txt
ncu -i /tmp/$tag.ncu-rep --page details --print-details all > $OUT/ncu_${tag}_details_${TAG}_$C.txt 2>&1
grep -iE "Duration|Issue Slots|Eligible|Active Warps|Pipe|Registers" $OUT/ncu_${tag}_details_${TAG}_$C.txt | head -20
