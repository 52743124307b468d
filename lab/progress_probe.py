"""Does train.py's progress bar slow a host-bound step (fp8 + FP8 classifier + plain compile, 27 ms a step
with the bar, 22 without, on an H200)? Runs train.py in this process after one change, so that each suspect can be
tried alone: tqdm's monitor thread off (--monitor=0), or Python's GIL switch interval (--switch=seconds, default 0.005).

    python lab/progress_probe.py --monitor=0 -- configs/gpt2_124m.py --fp8=True --classifier=fp8 --mlp=fused ...
"""

import argparse
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ap = argparse.ArgumentParser()
ap.add_argument("--monitor", type=float, default=None, help="tqdm.tqdm.monitor_interval (0: no monitor thread)")
ap.add_argument("--switch", type=float, default=None, help="sys.setswitchinterval")
a, rest = ap.parse_known_args()
if a.monitor is not None:
    import tqdm
    tqdm.tqdm.monitor_interval = a.monitor
if a.switch is not None:
    sys.setswitchinterval(a.switch)
sys.argv = ["train.py", *[r for r in rest if r != "--"]]
sys.path.insert(0, ROOT)
os.chdir(ROOT)
runpy.run_path(os.path.join(ROOT, "train.py"), run_name="__main__")
