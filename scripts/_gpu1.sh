#!/bin/bash
# one-off device call (deleted after): the opt-in cuts scale_on_s / lazy_rescale on a GPU (tests, then timing)
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
C=$1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$GPU"
case "$GPU" in *H200*) TAG=h200;; *) TAG=h100;; esac
timeout 200 python -m pytest -q -m gpu tests/test_gpu_mla.py -k "test_swapped_shared_loop_vs_float64 and (scale_on_s or lazy)" \
  -p no:cacheprovider -rA 2>&1 | grep -E "passed|failed|PASS|FAIL|Error|assert" | head -40 | tee $OUT/gpu_tests_mla_cuts_${TAG}_$C.log
V=""
for l in "" " l2 resident" " ragged[1..2L]" " b32 L16384"; do
  for n in "" " scale on s" " lazy rescale" " lazy rescale scale on s"; do V="$V,fp8_e4m3 h16$l$n"; done
done
V="${V#,},fp8_e4m3 h16 sq2 rows_per_cta 16,fp8_e4m3 h16 sq2 rows_per_cta 16 scale on s"
timeout 330 python scripts/check_mla_gpu.py --cases none --timing --iters 20 --commit $C \
  --out $OUT/mla_cuts_${TAG}_$C.json --only "$V" 2>&1 | grep -vE "^\s*$|WARNING|^I[0-9]" | tail -40
