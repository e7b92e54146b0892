"""`python -m bench.overhead` and `python -m bench.overhead_counts` run as the README and issue
12 say, on a few requests.

Only that they run, check every response and count every target: timings and counts are the
benchmarks' business, not a test's.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_overhead_benchmark_runs_and_checks_every_response(tmp_path: Path) -> None:
    out = tmp_path / "overhead.md"
    command = [sys.executable, "-m", "bench.overhead", "--rounds", "1", "--c1", "20"]
    command += ["--c32", "64", "--stream", "10", "--transports", "http,grpc", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = out.read_text()
    assert "none: every response was checked and passed" in report
    targets = ["Triton direct", "aiohttp pass-through", "kvledger http /generate"]
    targets += ["kvledger grpc /generate", "kvledger http /v1/completions"]
    for target in targets:
        assert f"| {target} |" in report, report
    assert "floor: aiohttp pass-through (rounds that met each)" in report


@pytest.mark.skipif(
    not (shutil.which("valgrind") and shutil.which("strace")),
    reason="needs valgrind and strace (scripts/setup installs them as root)",
)
def test_overhead_counts_benchmark_counts_every_target(tmp_path: Path) -> None:
    out = tmp_path / "counts.md"
    command = [sys.executable, "-m", "bench.overhead_counts", "--requests", "20"]
    command += ["--concurrency", "2", "--warmup", "10", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = {}
    for line in out.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0].startswith(("aiohttp", "kvledger")):
            rows[cells[0]] = cells
    assert set(rows) == {
        "aiohttp pass-through",
        "kvledger's plumbing alone",
        "kvledger http /generate",
    }
    for cells in rows.values():
        instructions, calls = float(cells[1].rstrip("k").replace(",", "")), float(cells[3])
        assert instructions > 10 and calls > 1, cells  # counted, per request
