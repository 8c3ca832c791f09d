"""What is alive at a training step's peak memory, by the code that allocated it (CUDA caching-allocator history).

Records the allocator's history (with Python stacks) from before the model is built, runs warm-up steps and the
measured steps of bench_e2e's provider, then replays the recorded allocs/frees to find the moment of peak
allocated bytes within the measured steps, and groups every block alive at that moment by its innermost frame in
this repository (or in torch when none is ours). Answers "which 0.5 GiB is not in the saved-activation account".

    python benchmarks/tools/memory_at_peak.py --out DIR [--configs mistral-7b-w4l] [--provider ours]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: harness, bench_*
from bench_e2e import training_step  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WARMUP, MEASURED = 3, 2
MAX_ENTRIES = 1_000_000  # the allocator's history is a ring: hitting this would drop the oldest events
GiB = 2**30


def owner(frames: list[dict]) -> str:
    """The innermost frame in this repository ('file:line function'), else the innermost Python frame at all."""
    ours = [f for f in frames if f["filename"].startswith(REPO) or "/liger_models/" in f["filename"]]
    pick = (ours or frames or [dict(filename="?", line=0, name="(no Python frame)")])[0]
    name = os.path.relpath(pick["filename"], REPO) if pick["filename"].startswith(REPO) else pick["filename"]
    return f"{name}:{pick['line']} {pick['name']}"


def live_at_peak(events: list[dict], start: int) -> tuple[int, int, dict[int, dict]]:
    """Replays alloc / free_completed events; returns (peak bytes, event index of the peak, blocks alive then),
    the peak taken among events from index ``start`` on (the measured steps)."""
    total, peak, peak_at = 0, -1, start
    sizes: dict[int, int] = {}
    for i, ev in enumerate(events):
        if ev["action"] == "alloc":
            sizes[ev["addr"]] = ev["size"]
            total += ev["size"]
        elif ev["action"] == "free_completed" and ev["addr"] in sizes:
            total -= sizes.pop(ev["addr"])
        if i >= start and total > peak:
            peak, peak_at = total, i
    alive: dict[int, dict] = {}
    for ev in events[: peak_at + 1]:
        if ev["action"] == "alloc":
            alive[ev["addr"]] = ev
        elif ev["action"] == "free_completed":
            alive.pop(ev["addr"], None)
    return peak, peak_at, alive


def _worker(name: str, provider: str) -> dict:
    import torch

    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
    _, _, _, step = training_step(name, provider, WARMUP + MEASURED)
    for i in range(WARMUP):
        step(i)
    torch.cuda.synchronize()
    marker = len(torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()])
    torch.cuda.reset_peak_memory_stats()
    for i in range(WARMUP, WARMUP + MEASURED):
        step(i)
    torch.cuda.synchronize()
    measured_peak = torch.cuda.max_memory_allocated()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = snap["device_traces"][torch.cuda.current_device()]
    peak, peak_at, alive = live_at_peak(events, marker)
    groups: dict[str, list[int]] = defaultdict(list)
    for ev in alive.values():
        groups[owner(ev.get("frames", []))].append(ev["size"])
    rows = sorted(((sum(s), len(s), k) for k, s in groups.items()), reverse=True)
    return dict(config=name, provider=provider, measured_peak_gib=measured_peak / GiB, replayed_peak_gib=peak / GiB,
                events=len(events), measured_from_event=marker, peak_event=peak_at,
                peak_while=owner(events[peak_at].get("frames", [])), history_truncated=len(events) >= MAX_ENTRIES,
                groups=[dict(gib=b / GiB, blocks=n, owner=k, sizes_mib=_size_counts(groups[k])) for b, n, k in rows])


def _size_counts(sizes: list[int]) -> list[tuple[float, int]]:
    """The four most common block sizes of a group, MiB and count: tells a workspace from an activation."""
    counts: dict[int, int] = defaultdict(int)
    for s in sizes:
        counts[s] += 1
    top = sorted(counts.items(), key=lambda kv: (kv[1] * kv[0], kv[1]), reverse=True)[:4]
    return [(round(s / 2**20, 2), n) for s, n in top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--configs", default="mistral-7b-w4l")
    ap.add_argument("--provider", default="ours")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(_worker(*args.worker)))
        return
    os.makedirs(args.out, exist_ok=True)
    results = []
    for name in args.configs.split(","):
        proc = subprocess.run([sys.executable, __file__, "--worker", name, args.provider], capture_output=True,
                              text=True, timeout=400)
        if proc.returncode:
            results.append(dict(config=name, error=proc.stderr[-2000:]))
            print(name, "failed:", proc.stderr[-2000:])
            continue
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(row)
        print(f"\n{name} ({args.provider}): peak {row['measured_peak_gib']:.3f} GiB measured, "
              f"{row['replayed_peak_gib']:.3f} replayed; peak while allocating at {row['peak_while']}")
        for g in row["groups"][:25]:
            print(f"  {g['gib']:8.3f} GiB {g['blocks']:6d} blocks  {g['owner']}  (MiB x n: {g['sizes_mib']})")
    with open(os.path.join(args.out, "memory_at_peak.json"), "w") as f:
        json.dump(dict(results=results), f, indent=1)


if __name__ == "__main__":
    main()
