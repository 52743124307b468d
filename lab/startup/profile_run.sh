# cProfile of whole train.py runs (issue 28): where the wall-clock of a warm shakespeare_char run goes.
set -e
export TRITON_CACHE_DIR=/tmp/c/triton TORCHINDUCTOR_CACHE_DIR=/tmp/c/inductor FUSED_OPS_TUNING_CACHE=/tmp/c/tuning.json
ITERS=${ITERS:-1000}
t0=$(date +%s.%N); python3 -c "import train" ; t1=$(date +%s.%N); echo "import train: $(echo "$t1 - $t0" | bc) s"
for mlp in fused eager; do
  python3 train.py configs/shakespeare_char.py --mlp=$mlp --max_iters=$ITERS --lr_decay_iters=$ITERS --progress=False --plot=False --sample_after=False --out_dir=/tmp/o-$mlp > /dev/null 2>&1
done
for mlp in fused eager; do
  rm -rf /tmp/o-$mlp
  t0=$(date +%s.%N)
  python3 -m cProfile -o /tmp/prof-$mlp train.py configs/shakespeare_char.py --mlp=$mlp --max_iters=$ITERS --lr_decay_iters=$ITERS --progress=False --plot=False --sample_after=False --out_dir=/tmp/o-$mlp | grep -E "start-up|val loss" | head -3
  t1=$(date +%s.%N); echo "$mlp warm wall $(echo "$t1 - $t0" | bc) s"
  python3 - <<PY
import pstats
s = pstats.Stats("/tmp/prof-$mlp"); s.sort_stats("cumulative")
want = ("train.py", "checkpoint.py", "startup.py", "runlog.py", "stopping.py", "data.py", "<module>", "model.py")
rows = [(k, v) for k, v in s.stats.items() if k[0].endswith(want[:-2]) or (k[2] == "<module>" and ("torch/__init__" in k[0] or "triton/__init__" in k[0] or "/main/" in k[0]))]
rows.sort(key=lambda kv: -kv[1][3])
for (f, l, n), (cc, nc, tt, ct, _) in rows[:28]:
    print(f"{ct:8.2f} s cum {nc:7d} calls  {f.split('/')[-1]}:{l} {n}")
PY
done
