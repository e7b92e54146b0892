"""`python -m bench.overhead` runs as the README and issue 12 say, on a few requests.

Only that it runs and checks every response: timings are the benchmark's business, not a test's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_overhead_benchmark_runs_and_checks_every_response(tmp_path: Path) -> None:
    out = tmp_path / "overhead.md"
    command = [sys.executable, "-m", "bench.overhead", "--rounds", "1", "--c1", "20"]
    command += ["--c32", "64", "--stream", "10", "--transports", "http,grpc", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = out.read_text()
    assert "none: every response was checked and passed" in report
    targets = ["aiohttp pass-through", "aiohttp pass-through, tokens collected"]
    targets += ["kvledger http /generate", "kvledger grpc /generate"]
    for target in targets:
        assert f"| {target} |" in report, report
    assert "floor: aiohttp pass-through, tokens collected" in report
    assert "kvledger http /v1/completions" in report
