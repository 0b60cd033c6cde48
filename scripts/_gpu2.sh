#!/bin/bash
# one-off device call (deleted after): where the fp8 defaults' warps stall (ncu SASS samples), h16 then h128
export PYTHONPATH=. PYTHONUNBUFFERED=1
C=$1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$GPU"
case "$GPU" in *H200*) TAG=h200;; *) TAG=h100;; esac
for v in "fp8_e4m3 h16:fp8_h16" "fp8_e4m3 h128:fp8_h128"; do
  name=${v%%:*}; tag=${v##*:}
  timeout 100 ncu --clock-control none --kernel-name body_mosaic_gpu_kernel --launch-skip 1 --launch-count 1 --set full \
    -o /tmp/$tag python scripts/ncu_mla.py --variant "$name" > /tmp/$tag.log 2>&1; tail -2 /tmp/$tag.log
  python scripts/ncu_sass_summary.py /tmp/$tag.ncu-rep --top 40 > $OUT/ncu_${tag}_sass_${TAG}_$C.txt 2>&1; head -30 $OUT/ncu_${tag}_sass_${TAG}_$C.txt
done
