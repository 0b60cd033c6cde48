set -x
export PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv
timeout 200 python -m pytest -q -m gpu tests/test_gpu_mla.py -k "crossover or seesaw_kernel_vs" -x > $OUT/gpu_tests_crossover.log 2>&1
rc=$?
tail -n 15 $OUT/gpu_tests_crossover.log
if [ $rc -ne 0 ]; then echo "GPU TESTS FAILED rc=$rc"; exit 0; fi
timeout 360 python scripts/check_mla_gpu.py --commit e0ec369 --out $OUT/mla_crossover_check.json --cases full --case-grep crossover --timing --only "fp8_e4m3 h128,fp8_e4m3 h128 seesaw,fp8_e4m3 h128 seesaw crossover regs 72/216,fp8_e4m3 h128 seesaw crossover regs 56/224,fp8_e4m3 h128 seesaw crossover regs 40/232,fp8_e4m3 h128 seesaw crossover early_p0,fp8_e4m3 h128 seesaw crossover ragged[1..2L],fp8_e4m3 h128 sq2 seesaw crossover,fp8_e4m3 h128 b64 rows,fp8_e4m3 h128 b64 seesaw crossover,bfloat16 h128 seesaw" > $OUT/crossover.log 2>&1
echo "check rc=$?"
grep -E "^\[check\]|^\[time\]" $OUT/crossover.log | cut -c1-220 | tail -n 30
