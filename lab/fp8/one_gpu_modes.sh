export PYTHONUNBUFFERED=1
(timeout 200 python3 -m pytest -q -m gpu tests/test_fp8.py tests/test_graphs.py tests/test_compile.py -p no:cacheprovider -x > $OUT/tests.txt 2>&1; tail -3 $OUT/tests.txt)
for mode in True False reduce-overhead; do
  timeout 150 python3 bench.py configs/gpt2_124m.py --mlps=eager,fused,fp8 --compile=$mode --rounds=3 --steps=10 > $OUT/bench_$mode.txt 2>&1
  grep -E "Error|error:" $OUT/bench_$mode.txt | head -3; grep -A5 "^variant" $OUT/bench_$mode.txt
done
