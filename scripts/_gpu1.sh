#!/bin/bash
# one-off device call (deleted after): four converting producers for fp8 h16, timed, checked against float64 and
# profiled (SASS stall samples with the STS rows' shared wavefronts; the details page)
export PYTHONPATH=. PYTHONUNBUFFERED=1
C=$1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$GPU"
case "$GPU" in *H200*) TAG=h200;; *) TAG=h100;; esac
timeout 170 python scripts/check_mla_gpu.py --cases none --timing --iters 20 --commit $C \
  --out $OUT/mla_producers4_check_${TAG}_$C.json --only "fp8_e4m3 h16,fp8_e4m3 h16 producers 4,fp8_e4m3 h16 producers 4 no \
lookahead,fp8_e4m3 h16 l2 resident producers 4,fp8_e4m3 h16 l2 resident" 2>&1 | tail -8
timeout 120 python -m pytest -q -m gpu tests/test_gpu_mla.py -k "test_swapped_alternate_vs_float64 and (None-4 or 16-4)" \
  -p no:cacheprovider -rA 2>&1 | grep -E "passed|failed|PASS|FAIL|Error" | tee $OUT/gpu_tests_mla_producers4_${TAG}_$C.log
for v in "fp8_e4m3 h16 producers 4:fp8_h16_p4" "fp8_e4m3 h16:fp8_h16"; do
  name=${v%%:*}; tag=${v##*:}
  timeout 110 ncu --clock-control none --kernel-name body_mosaic_gpu_kernel --launch-skip 1 --launch-count 1 --set full \
    -o /tmp/$tag python scripts/ncu_mla.py --variant "$name" > /tmp/$tag.log 2>&1; tail -2 /tmp/$tag.log
  python scripts/ncu_sass_summary.py /tmp/$tag.ncu-rep --top 40 > $OUT/ncu_${tag}_sass_${TAG}_$C.txt 2>&1
  head -30 $OUT/ncu_${tag}_sass_${TAG}_$C.txt
  ncu -i /tmp/$tag.ncu-rep --page details --print-details all > $OUT/ncu_${tag}_details_${TAG}_$C.txt 2>&1
  grep -iE "shared|pipe|Duration|Throughput|Registers" $OUT/ncu_${tag}_details_${TAG}_$C.txt | head -30
done
