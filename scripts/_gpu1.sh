#!/bin/bash
# one-off device call (deleted after): production-path tests and the V3 slice with b0_before_a1 on / off
export PYTHONPATH=. NCCL_NVLS_ENABLE=0
C=$1
nvidia-smi --query-gpu=name --format=csv | tee $OUT/gpu.txt
timeout 110 python -m pytest -q -m gpu tests/test_gpu_mla.py -k "test_mla_decode_vs_float64 and mosaic and fp8" -v -p no:cacheprovider 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -8 | tee $OUT/gpu_tests.log
timeout 230 python scripts/bench_generate.py --v3-slice --commit $C --out $OUT/generate_v3_slice_h100_$C.json 2>&1 | tail -6
timeout 200 python scripts/bench_generate.py --v3-slice --commit $C --mosaic-options '{"b0_before_a1": false}' --out $OUT/generate_v3_slice_release_order_h100_$C.json 2>&1 | tail -6
