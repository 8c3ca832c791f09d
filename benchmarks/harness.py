"""Shared benchmark plumbing: median GPU time, peak memory, device ceilings, JSON, tables and plots.

Every bench_<op>.py builds a list of (provider name -> callable) per shape and hands it to ``run_case``.
Results go to ``<out>/<name>.json`` and ``<out>/<name>.png``; a markdown table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import faulthandler
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

MiB = 1 << 20
# LIGER_BENCH_GRAPH=1: run_case also times each provider replayed as a CUDA graph (Result.extra["graph_ms"]), i.e.
# its GPU time without the host's launch cost. Opt-in: a provider that cannot be captured is retried as None, but a
# failed capture is the one place a benchmark run could be left in a bad CUDA state.
GRAPH_TIMING = os.environ.get("LIGER_BENCH_GRAPH") == "1"
# LIGER_BENCH_GPU_TIME=1: run_case also times each provider with the stream kept busy while the host enqueues it
# (Result.extra["gpu_ms"]): kernel time without launch cost, for any provider (no capture needed); a provider that
# syncs with the host (a label check) still pays for the sync.
GPU_TIMING = os.environ.get("LIGER_BENCH_GPU_TIME") == "1"
SLEEP_CYCLES = 4_000_000  # ~2 ms of GPU time: longer than the host takes to enqueue one call
# LIGER_BENCH_PARTIAL=FILE: run_case also appends each result to FILE as a JSON line the moment it is measured, so a
# run cut short by a device call's time limit (the JSON and table come only at the end) still leaves its numbers.
PARTIAL = os.environ.get("LIGER_BENCH_PARTIAL")


def arm_stack_dumps() -> None:
    """In a worker run by ``run_worker``: every thread's stack into its stderr log shortly before the parent's
    timeout (LIGER_BENCH_STACKS_AT), or every LIGER_BENCH_STACKS_EVERY seconds when set (faulthandler keeps one
    timer). A compile that never finishes shows its frame there."""
    every = float(os.environ.get("LIGER_BENCH_STACKS_EVERY", "0"))
    at = float(os.environ.get("LIGER_BENCH_STACKS_AT", "0"))
    if every > 0 or at > 0:
        faulthandler.dump_traceback_later(every or at, repeat=every > 0, exit=False)


def run_worker(args: list[str], log: str, timeout: float,
               env: dict | None = None) -> tuple[dict | None, bool, list[str]]:
    """``python args`` with its stderr in ``log`` (kept when it is killed) and stack dumps armed 15 s before
    ``timeout``: (the dict its ``RESULT <json>`` stdout line carries or None, whether it timed out, its stderr
    lines)."""
    env = dict(env or os.environ, LIGER_BENCH_STACKS_AT=str(max(timeout - 15, 1)))
    line, timed_out = None, False
    with open(log, "w") as err_file:
        try:
            proc = subprocess.run([sys.executable, *args], stdout=subprocess.PIPE, stderr=err_file, text=True,
                                  timeout=timeout, env=env)
            line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        except subprocess.TimeoutExpired:
            timed_out = True
    with open(log) as err_file:
        err = err_file.read().strip().splitlines()
    return (json.loads(line[7:]) if line else None), timed_out, err


@dataclass
class Result:
    case: str
    provider: str
    ms: float | None
    peak_mib: float | None
    extra: dict = field(default_factory=dict)
    error: str | None = None


def parse_args(description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="folder for JSON and plots")
    ap.add_argument("--quick", action="store_true", help="only the headline shapes")
    ap.add_argument("--providers", default="", help="comma-separated subset of providers")
    return ap.parse_args()


def median_ms(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median wall time of ``fn`` on the GPU, in ms (triton's do_bench: events, L2 flushed between reps)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def graph_ms(fn: Callable[[], object]) -> tuple[float | None, str | None]:
    """Median time of ``fn`` replayed as one CUDA graph: what a graph-captured step pays for it, with no host launch
    cost; or (None, why) when ``fn`` cannot be captured (a host sync such as a label check, a CPU-side op).

    Captures run in thread-local mode only. On the H200 every capture of the first case in which a script tried any
    failed in global mode (cudaErrorStreamCaptureInvalidated, eager PyTorch included) while later cases captured;
    the likeliest cause is a background thread touching the CUDA context during the capture (torch.compile's
    compile-worker start-up in that first case), which global mode counts as an error and thread-local mode does
    not (the pattern vLLM reported in its PR #48053). A retry in thread-local mode after a global failure failed
    too ("a previous error during capture"), so there is no global attempt any more. A failed capture also keeps
    memory (its pool is never given back and the allocator keeps routing into it: the swiglu / geglu scripts ran
    out of memory with ~130 GiB reserved after one at 16384×16384, H200, 2026-11-29), so the norms part times
    swiglu / geglu without graphs. In thread-local mode too the first case of each script does not capture (H200,
    2026-11-30): compare GPU ms (busy_gpu_ms), not graph_ms."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # capture needs warm-up on a side stream (allocator, lazy init)
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            fn()
    except Exception as e:  # noqa: BLE001 - not capturable: report why, no graph time
        torch.cuda.synchronize()
        _release_rng_from_failed_capture()
        return None, f"{type(e).__name__}: {e}"[:300]
    return median_ms(graph.replay), None


def busy_gpu_ms(fn: Callable[[], object], reps: int = 12) -> float:
    """Median GPU time of ``fn`` alone: L2 flushed before each rep, and a GPU sleep queued ahead of it so the events
    bracket its kernels, not the host's enqueueing (which at small sizes is most of what do_bench sees)."""
    fn()
    cache = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    events = []
    for _ in range(reps):
        torch.cuda._sleep(SLEEP_CYCLES)
        cache.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def _release_rng_from_failed_capture() -> None:
    """A capture that dies inside cudaStreamEndCapture never runs the CUDA generator's capture epilogue, so the default
    generator stays marked as capturing and the next torch.randn outside a graph raises "Offset increment outside
    graph capture". Re-seat the generator on a copy of its seed/offset, which carries no capture mark."""
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    gen.graphsafe_set_state(gen.clone_state())
    gc.collect()
    torch.cuda.empty_cache()


def host_ms_per_call(fn: Callable[[], object], reps: int, busy_cycles: int = 0) -> float:
    """Host (enqueue) time per call of ``fn``, in ms. busy_cycles > 0 first queues that much GPU sleep, so no launch
    waits for the device; with 0 the GPU idles and catches up as it goes."""
    fn()
    torch.cuda.synchronize()
    if busy_cycles:
        torch.cuda._sleep(busy_cycles)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / reps * 1e3


def peak_extra_mib(fn: Callable[[], object]) -> float:
    """Peak memory allocated while ``fn`` runs, above what was allocated before it, in MiB."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / MiB


_SPUN_UP = False


def _spin_up_once(fns: list[Callable[[], object]], seconds: float = 1.5) -> None:
    """Run the first case's providers in a loop for a while before anything is timed. Without it the first case of
    every script measured slow on the host-bound paths (H200, 2026-11-29: rope B4 T4096 D128 autograd step 0.50 and
    0.78 ms as the first case of two processes, 0.34 ms for the same bytes later in the run; the kernel-only path,
    GPU-bound, 0.179 ms both times), while do_bench's own 25 ms warm-up was not enough."""
    global _SPUN_UP
    if _SPUN_UP or not fns:
        return
    _SPUN_UP = True
    end = time.perf_counter() + seconds
    try:
        while time.perf_counter() < end:
            for fn in fns:
                fn()
            torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - a provider failing here (OOM) is recorded by its measured call
        torch.cuda.synchronize()


def run_case(case: str, providers: dict[str, Callable[[], object]], extra: dict | None = None,
             wanted: set[str] | frozenset = frozenset()) -> list[Result]:
    """Time and measure every provider (or only the ``wanted`` ones) on one case.

    Each provider runs once first, so JIT compilation and torch.compile stay out of both the peak memory and the
    time; a provider that fails (OOM, missing package) is recorded, not raised.
    """
    providers = {k: v for k, v in providers.items() if not wanted or k in wanted}
    working = []
    for fn in providers.values():
        try:
            fn()
            working.append(fn)
        except Exception:  # noqa: BLE001 - the measured call below records the failure
            pass
    _spin_up_once(working)
    results = []
    for name, fn in providers.items():
        try:
            peak = peak_extra_mib(fn)
            ms = median_ms(fn)
            results.append(Result(case, name, ms, peak, dict(extra or {})))
            if GPU_TIMING:
                results[-1].extra["gpu_ms"] = busy_gpu_ms(fn)
            if GRAPH_TIMING:
                results[-1].extra["graph_ms"], why = graph_ms(fn)
                if why:
                    results[-1].extra["graph_error"] = why
        except Exception as e:  # noqa: BLE001 - a failing peer must not stop the run
            results.append(Result(case, name, None, None, dict(extra or {}), error=f"{type(e).__name__}: {e}"[:300]))
        if PARTIAL:
            with open(PARTIAL, "a") as f:
                f.write(json.dumps(asdict(results[-1])) + "\n")
        gc.collect()
        torch.cuda.empty_cache()
    return results


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Measured device-to-device copy bandwidth (bytes read + written per second), in GB/s."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def matmul_tflops(n: int = 8192) -> float:
    """Measured bf16 n×n×n matmul rate on random data, in TFLOP/s."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def apply_tunables() -> dict:
    """Set kernel settings from LIGER_TUNE="module.field=value,..." (liger_models.kernels._tuning.set_tuning_from), so
    one benchmark run can compare schedules without editing code. Returns what it set (recorded with the results)."""
    from liger_models.kernels._tuning import set_tuning_from

    try:
        return set_tuning_from(os.environ.get("LIGER_TUNE", ""))
    except TypeError as exc:
        raise SystemExit(f"LIGER_TUNE: {exc}") from exc


def environment() -> dict:
    env = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    for pkg in ("liger_kernel", "cut_cross_entropy", "transformers"):
        try:
            from importlib.metadata import version

            env[pkg] = version(pkg.replace("_", "-"))
        except Exception:  # noqa: BLE001
            env[pkg] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def save(name: str, out: str, results: list[Result], meta: dict | None = None) -> None:
    os.makedirs(out, exist_ok=True)
    payload = {"env": environment(), "meta": meta or {}, "results": [asdict(r) for r in results]}
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(payload, f, indent=1)
    _plot(name, out, results)


def _plot(name: str, out: str, results: list[Result]) -> None:
    # The GPU machine returns at most 8 files per call: plots are drawn from the JSON afterwards
    # (`python benchmarks/harness.py plot <json>...`) when LIGER_BENCH_PLOTS=0 there.
    if os.environ.get("LIGER_BENCH_PLOTS", "1") == "0":
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    cases = list(dict.fromkeys(r.case for r in results))
    providers = list(dict.fromkeys(r.provider for r in results))
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.2 * len(cases)) * 2, 5))
    width = 0.8 / max(1, len(providers))
    for metric, ax, label in (("ms", axes[0], "time (ms, lower is better)"), ("peak_mib", axes[1], "peak extra memory (MiB)")):
        for i, p in enumerate(providers):
            vals = [next((getattr(r, metric) or 0 for r in results if r.case == c and r.provider == p), 0) for c in cases]
            ax.bar([x + i * width for x in range(len(cases))], vals, width, label=p)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cases))], cases, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    fig.suptitle(name)
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"{name}.png"), dpi=110)
    plt.close(fig)


def table(results: list[Result], floor_ms: dict[str, float] | None = None) -> str:
    """Markdown table: one row per case, one column per provider (ms / peak MiB), plus the floor if given."""
    cases = list(dict.fromkeys(r.case for r in results))
    providers = list(dict.fromkeys(r.provider for r in results))
    head = "| case | " + " | ".join(providers) + (" | floor ms |" if floor_ms else " |")
    lines = [head, "|" + "---|" * (len(providers) + 1 + bool(floor_ms))]
    for c in cases:
        cells = []
        for p in providers:
            r = next((r for r in results if r.case == c and r.provider == p), None)
            if r is None or r.ms is None:
                cells.append("fail" if r is not None else "—")
            else:
                cells.append(f"{r.ms:.3f} ms / {r.peak_mib:.0f} MiB")
        tail = f" | {floor_ms[c]:.3f} |" if floor_ms and c in floor_ms else (" | — |" if floor_ms else " |")
        lines.append(f"| {c} | " + " | ".join(cells) + tail)
    return "\n".join(lines)


def plot_saved(paths: list[str]) -> None:
    """Draw the plot for each saved benchmark JSON next to it."""
    for path in paths:
        with open(path) as f:
            payload = json.load(f)
        results = [Result(**r) for r in payload["results"]]
        _plot(os.path.splitext(os.path.basename(path))[0], os.path.dirname(path) or ".", results)


def _load(path: str) -> tuple[dict, list[Result]]:
    """A saved benchmark JSON, or a LIGER_BENCH_PARTIAL .jsonl (results only, of a run cut short)."""
    with open(path) as f:
        if path.endswith(".jsonl"):
            return {}, [Result(**json.loads(line)) for line in f if line.strip()]
        payload = json.load(f)
    return payload.get("meta", {}), [Result(**r) for r in payload["results"]]


def summary_table(path: str) -> str:
    """BENCHMARKS.md rows from a saved run: per case and provider the time, and where recorded the GPU-only time
    and the CUDA-graph replay time (host hidden), the fraction of copy bandwidth (streaming kernels) or of the
    matmul rate (linear-CE) and the peak extra memory."""
    meta, results = _load(path)
    floors = meta.get("floor_ms", {})
    lines = ["| case | provider | ms | GPU ms | graph ms | of copy BW / matmul rate | peak MiB | floor ms |",
             "|---|---|---|---|---|---|---|---|"]

    def cell(value: float | None) -> str:
        return "" if value is None else f"{value:.3f}"

    for r in results:
        if r.ms is None:
            lines.append(f"| {r.case} | {r.provider} | failed: {(r.error or '')[:60]} | | | | | |")
            continue
        frac = r.extra.get("frac_copy_bw", r.extra.get("frac_matmul"))
        floor = floors.get(r.case)
        lines.append(f"| {r.case} | {r.provider} | {r.ms:.3f} | {cell(r.extra.get('gpu_ms'))} | "
                     f"{cell(r.extra.get('graph_ms'))} | "
                     f"{'' if frac is None else f'{frac:.0%}'} | {r.peak_mib:.0f} | {cell(floor)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "plot":
        plot_saved(sys.argv[2:])
    elif len(sys.argv) > 2 and sys.argv[1] == "table":
        for path in sys.argv[2:]:
            print(f"{path}\n{summary_table(path)}\n")
    else:
        print("usage: python benchmarks/harness.py plot|table <bench.json | part.partial.jsonl>...")
