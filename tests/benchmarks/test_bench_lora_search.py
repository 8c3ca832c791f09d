"""bench_lora.py --longest's search: the longest length that fits, found from where it is told to start."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_lora  # noqa: E402


def _fits_below(limit: int, stop_after: int | None = None):
    probed = []

    def fits(seq: int):
        if stop_after is not None and len(probed) == stop_after:
            return None
        probed.append(seq)
        return seq <= limit
    return fits, probed


@pytest.mark.parametrize("lo, growth", [(4096, 2.0), (163840, 1.25), (1024, 1.001)])
def test_finds_the_longest_multiple_of_1024_that_fits(lo, growth):
    limit = int(torch.randint(300_000, 400_000, ()))  # the memory's limit, drawn per run (LIGER_TEST_SEED replays it)
    fits, probed = _fits_below(limit)
    best, bad, first_bad = bench_lora.search_longest(fits, lo, growth, 1 << 20)
    assert best == limit // 1024 * 1024 and bad == best + 1024
    assert first_bad == next(seq for seq in probed if seq > limit)
    growing = probed[:probed.index(first_bad) + 1]
    assert growing[0] == lo and all(b - a >= 1024 and b % 1024 == 0 for a, b in zip(growing, growing[1:]))
    assert all(b <= max(a * growth, a + 1024) for a, b in zip(growing, growing[1:]))


def test_a_stopped_search_keeps_what_it_found_and_a_first_failure_bisects_down():
    # 163840 fits, 204800 does not, 184320 does, then the budget ends the bisection
    fits, probed = _fits_below(200_000, stop_after=3)
    assert bench_lora.search_longest(fits, 163840, 1.25, 1 << 20) == (184320, 204800, 204800)
    assert probed == [163840, 204800, 184320]
    fits, probed = _fits_below(200_000, stop_after=1)  # stopped while growing: no failure found
    assert bench_lora.search_longest(fits, 163840, 1.25, 1 << 20) == (163840, None, None)
    fits, probed = _fits_below(3100)  # not even the first length: bisected below it
    assert bench_lora.search_longest(fits, 4096, 2.0, 1 << 20) == (3072, 4096, 4096)
    fits, probed = _fits_below(1 << 30)  # everything fits: stops at the cap
    assert bench_lora.search_longest(fits, 4096, 2.0, 65536) == (65536, None, None)
