#!/usr/bin/env python3
"""Per-kernel times of one decode step from an `ncu --csv --page raw` capture.

ncu measures each kernel alone (serialised, no overlap with its neighbours), so a step's sum
here is longer than the step measured without it; what it shows is where the time goes. The
step is the launches from one `kvf_embed` to the next.

Usage: ncu_step.py CAPTURE.csv                  summarise a capture
       ncu_step.py --capture CAPTURE.csv [--skip N] [--count N] -- EXE [ARGS...]
                                              run EXE under ncu (the step's metrics, no cache
                                              or clock control, launches N.. of it; the
                                              environment passed on), then summarise
"""
import csv
import io
import os
import subprocess
import sys
from collections import defaultdict


def main(path):
    text = open(path).read()
    if '"ID","Process ID"' not in text:
        sys.exit(f"{path}: not an ncu raw CSV capture (ncu's messages: {path}.err, if it ran here)")
    rows = list(csv.reader(io.StringIO(text[text.index('"ID","Process ID"'):])))
    hdr, units, data = rows[0], rows[1], rows[2:]
    col = {name: hdr.index(name) for name in
           ("Kernel Name", "Grid Size", "gpu__time_duration.sum", "dram__bytes_read.sum")}
    t_unit = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3}[units[col["gpu__time_duration.sum"]]]
    b_unit = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}[units[col["dram__bytes_read.sum"]]]
    starts = [i for i, r in enumerate(data) if "embed" in r[col["Kernel Name"]]]
    if len(starts) < 2:
        sys.exit("no whole step in the capture (fewer than two kvf_embed launches)")
    per = defaultdict(lambda: [0, 0.0, 0.0])
    for r in data[starts[0]:starts[1]]:
        key = f'{r[col["Kernel Name"]][:40]} {r[col["Grid Size"]]}'
        per[key][0] += 1
        per[key][1] += float(r[col["gpu__time_duration.sum"]].replace(",", "")) * t_unit
        per[key][2] += float(r[col["dram__bytes_read.sum"]].replace(",", "")) * b_unit
    total = sum(v[1] for v in per.values())
    print(f"step: {starts[1] - starts[0]} launches, {total:.1f} us of kernels (each alone)")
    for key, (n, us, b) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        rate = b / us / 1e3 if us else 0.0
        print(f"{key:58s} x{n:<3d} {us:8.1f} us  {us / n:6.2f} us each  {b / 1e6:8.1f} MB  {rate:5.0f} GB/s")


NCU = os.environ.get("NCU", "/usr/local/cuda/bin/ncu")


def capture(args):
    """`--capture CAPTURE.csv [--skip N] [--count N] -- EXE [ARGS...]`: ncu's raw CSV of EXE."""
    if "--" not in args:
        sys.exit("usage: ncu_step.py --capture CAPTURE.csv [--skip N] [--count N] -- EXE [ARGS...]")
    opts, exe = args[: args.index("--")], args[args.index("--") + 1 :]
    path, skip, count = opts[1], "3000", "400"
    for flag, value in zip(opts[2::2], opts[3::2]):
        if flag == "--skip":
            skip = value
        elif flag == "--count":
            count = value
        else:
            sys.exit(f"ncu_step.py: unknown option {flag}")
    cmd = [NCU, "--metrics", "gpu__time_duration.sum,dram__bytes_read.sum", "--cache-control", "none",
           "--clock-control", "none", "--launch-skip", skip, "--launch-count", count, "--csv", "--page", "raw", *exe]
    with open(path, "w") as out, open(path + ".err", "w") as err:
        subprocess.run(cmd, stdout=out, stderr=err, check=False, timeout=300)
    return path


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--capture":
        main(capture(sys.argv[1:]))
    else:
        main(sys.argv[1])
