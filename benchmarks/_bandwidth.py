"""Bandwidth bookkeeping shared by the streaming-kernel benchmarks (rope, swiglu, geglu).

Each case knows the fewest bytes its op must move; achieved GB/s and the fraction of the copy bandwidth
measured in the same run go into ``Result.extra``, and the floor (bytes / copy bandwidth) into the table.
"""

from __future__ import annotations

from typing import Callable

import torch
from harness import Result, run_case, save, table


def time_case(label: str, providers: dict[str, Callable[[], object]], nbytes: int, copy_gbs: float,
              extra: dict, wanted: set[str]) -> list[Result]:
    """Time every wanted provider (run_case warms each up first) and add achieved bandwidth to the results."""
    results = run_case(label, providers, {**extra, "bytes": nbytes}, wanted)
    for r in results:
        if r.ms:
            r.extra["gbs"] = nbytes / (r.ms * 1e-3) / 1e9
            r.extra["frac_copy_bw"] = r.extra["gbs"] / copy_gbs
    torch.cuda.empty_cache()
    # Progress as it goes: a run cut short by a time limit still shows the cases it finished.
    def cell(r: Result) -> str:
        if not r.ms:
            return f"{r.provider} failed"
        graph = r.extra.get("graph_ms")
        return f"{r.provider} {r.ms:.3f} ms" + (f" (graph {graph:.3f})" if graph else "")

    print(f"{label}: " + ", ".join(cell(r) for r in results), flush=True)
    return results


def report(name: str, out: str, results: list[Result], copy_gbs: float, note: str) -> None:
    """Save JSON + plot, print the bandwidth fractions, then the markdown table (last)."""
    floors = {r.case: r.extra["bytes"] / (copy_gbs * 1e9) * 1e3 for r in results}
    save(name, out, results, {"copy_bandwidth_gbs": copy_gbs, "floor_ms": floors, "note": note})
    print(f"copy bandwidth {copy_gbs:.0f} GB/s; achieved bandwidth, fraction of it:")
    for r in results:
        status = f"{r.extra['gbs']:7.0f} GB/s  {r.extra['frac_copy_bw']:.2f}" if r.ms else r.error
        print(f"  {r.case:>30}  {r.provider:<20} {status}")
    print(table(results, floors))
