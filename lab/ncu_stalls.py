"""Where a kernel's warps wait: Nsight Compute's per-instruction stall samples, summed over address ranges.

The ping-pong kernel's partitions (loader, two consumers) and phases (main loop, epilogue) are contiguous
ranges of its SASS, so summing the samples of each range says which phase the time goes to and why. On
the GPU machine (ncu ships with the CUDA toolkit there):

    ncu --kernel-name regex:pingpong --launch-skip 3 --launch-count 1 --set full -o gelu python script.py
    ncu --import gelu.ncu-rep --page source --print-source sass --csv > gelu_sass.csv

then, anywhere:

    python lab/ncu_stalls.py gelu_sass.csv                  # blocks of 128 instructions: find the phases
    python lab/ncu_stalls.py gelu_sass.csv 0xd90 0x10f0 0x1210 0x6a80   # ranges cut at these offsets

Offsets are from the kernel's first instruction. Per range: its share of all samples (a warp stalled or
issuing is sampled alike, so with equal warp counts the shares compare times), warp-instructions executed,
the leading stall reasons, and the instruction kinds that locate it (HGMMA: main loop, UTMASTG: stores).
"""

import argparse
import collections
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"
MARKERS = ("HGMMA", "MUFU", "FFMA", "STSM", "UTMASTG", "UTMALDG", "BAR", "SYNCS", "SHFL", "LDG", "LDL", "STL")


def read_sass(path):
    """(stall-reason column names, instruction rows sorted by address, each with its offset)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header = rows[start]
    data = [dict(zip(header, r)) for r in rows[start + 1:] if len(r) == len(header)]
    data.sort(key=lambda d: int(d["Address"], 16))
    base = int(data[0]["Address"], 16)
    for d in data:
        d["offset"] = int(d["Address"], 16) - base
    return [h for h in header if h.startswith("stall_") and "Not Issued" not in h], data


def number(text):
    """A counter's value as ncu prints it (maybe empty, maybe with thousands separators)."""
    return float(text.replace(",", "") or 0)


def opcode(sass):
    words = sass.split()
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]  # skip a predicate
    return word.split(".")[0]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", help="ncu --page source --print-source sass --csv output")
    p.add_argument("cuts", nargs="*", help="offsets (hex) where ranges start; default: blocks of --block")
    p.add_argument("--block", type=int, default=128, help="instructions per range without cuts")
    a = p.parse_args()
    stalls, data = read_sass(a.csv)
    total = sum(number(d[SAMPLES]) for d in data)
    if not total:
        raise SystemExit(f"{a.csv} has no stall samples: profile with --set full (or the SourceCounters section)")
    if a.cuts:
        cuts = [0] + sorted(int(c, 16) for c in a.cuts)
        ranges = [[d for d in data if lo <= d["offset"] < hi] for lo, hi in zip(cuts, cuts[1:] + [1 << 62])]
    else:
        ranges = [data[i:i + a.block] for i in range(0, len(data), a.block)]
    print(f"{len(data)} instructions, {total:.0f} samples")
    print(f"{'from':>6s} {'samples':>7s} {'executed':>9s}  leading stall reasons / instruction kinds")
    for r in ranges:
        if not r:
            continue
        reasons = collections.Counter()
        for d in r:
            for s in stalls:
                reasons[s[len("stall_"):]] += number(d[s])
        n = sum(reasons.values()) or 1
        kinds = collections.Counter(opcode(d["Source"]) for d in r if d["Source"].strip())
        executed = sum(number(d["Instructions Executed"]) for d in r)
        share = sum(number(d[SAMPLES]) for d in r) / total * 100
        top = ", ".join(f"{k} {v / n * 100:.0f}%" for k, v in reasons.most_common(4))
        marks = " ".join(f"{k}:{kinds[k]}" for k in MARKERS if kinds[k])
        print(f"{r[0]['offset']:6x} {share:6.1f}% {executed / 1e6:8.2f}M  {top}  | {marks}")


if __name__ == "__main__":
    main()
