"""SM clock, power and temperature per run, from an nvidia-smi sampling log and a file of run windows (issue 6: under
the H200's 700 W cap, does a denser step run its kernels at lower clocks?).

Record both on the GPU machine, the sampler in the background while the runs go one after another:

    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,nounits -lms 100 > smi.csv &
    echo "START <config> <provider> $(date '+%Y/%m/%d %H:%M:%S.%N')" >> windows.txt   # around each run,
    echo "END <config> <provider> $(date '+%Y/%m/%d %H:%M:%S.%N')" >> windows.txt     # the same clock as the log

    python benchmarks/clocks_by_window.py smi.csv windows.txt [--busy-watts 300]

Only samples above --busy-watts count (training steps, not model building or process start-up).
"""

from __future__ import annotations

import argparse
import csv
import statistics
from datetime import datetime

_STAMP = "%Y/%m/%d %H:%M:%S.%f"


def _stamp(text: str) -> datetime:
    day, time = text.split()
    return datetime.strptime(f"{day} {time[:15]}", _STAMP)  # %f takes at most 6 digits; date prints 9


def samples(path: str) -> list[tuple[datetime, float, float, float]]:
    """(time, SM MHz, W, °C) rows of an nvidia-smi CSV; lines that are not samples (the header) are skipped."""
    out = []
    with open(path) as f:
        for row in csv.reader(f):
            try:
                out.append((_stamp(row[0].strip()), float(row[1]), float(row[2]), float(row[3])))
            except (ValueError, IndexError):
                continue
    return out


def windows(path: str) -> dict[tuple[str, str], tuple[datetime, datetime]]:
    starts, out = {}, {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 5 and parts[0] in ("START", "END"):
                key, when = (parts[1], parts[2]), _stamp(f"{parts[3]} {parts[4]}")
                if parts[0] == "START":
                    starts[key] = when
                elif key in starts:
                    out[key] = (starts[key], when)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("smi_csv")
    ap.add_argument("windows")
    ap.add_argument("--busy-watts", type=float, default=300.0)
    args = ap.parse_args()
    rows = samples(args.smi_csv)
    print("| config | provider | busy samples | median SM MHz (p10–p90) | median W | median °C |")
    print("|---|---|---|---|---|---|")
    for (config, provider), (start, end) in windows(args.windows).items():
        busy = [r for r in rows if start <= r[0] <= end and r[2] > args.busy_watts]
        if not busy:
            print(f"| {config} | {provider} | 0 | — | — | — |")
            continue
        clocks = sorted(r[1] for r in busy)
        p10, p90 = clocks[len(clocks) // 10], clocks[len(clocks) * 9 // 10]
        print(f"| {config} | {provider} | {len(busy)} | {statistics.median(clocks):.0f} ({p10:.0f}–{p90:.0f}) "
              f"| {statistics.median(r[2] for r in busy):.0f} | {statistics.median(r[3] for r in busy):.0f} |")


if __name__ == "__main__":
    main()
