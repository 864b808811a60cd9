"""The benchmark's --quick mode runs end to end (so the bench never rots); it asserts correctness of the
run, not speed: every tool ran, modelfs loaded byte-exact tensors, and the report was written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.seaweedfs


def test_quick_bench_runs_every_tool(tmp_path: Path) -> None:
    out = tmp_path / "quick.json"
    res = subprocess.run([sys.executable, str(REPO / "bench/run.py"), "--quick", "--out", str(out)],
                         capture_output=True, text=True, timeout=900, cwd=REPO)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = doc["summary"]
    tools = {r["tool"] for r in rows}
    assert {"curl", "get-floor", "fuse-floor", "modelfs", "boto3-download"} <= tools
    floors = [r for r in rows if r["tool"] in ("get-floor", "fuse-floor")]
    assert all(r["status"] == "ok" and r["reader_cpu_s"] > 0 for r in floors), floors
    modelfs = [r for r in rows if r["tool"] == "modelfs"]
    assert modelfs and all(r["status"] == "ok" for r in modelfs), modelfs
    # issue #5's access patterns, each checked against the source tensors (status "wrong-data" otherwise)
    assert {"load_file", "safe_open", "safe_open_reverse", "natural_threads", "quarters",
            "load_file_threads"} <= {r["scenario"] for r in modelfs}
    assert (tmp_path / "quick.md").read_text().count("| modelfs |") == len(modelfs)
    assert all(r["daemon_cpu_s"] > 0 for r in modelfs), [r.get("daemon_cpu_s") for r in modelfs]
    # the host's state: what a fresh page cost before each round (--quick runs one), and the header says it
    probes = doc["fresh_memory_cpu_s_per_gb"]
    assert len(probes) == doc["rounds"] == 1 and 0 < probes[0] < 100, probes
    assert f"fresh memory {probes[0]:.2f} CPU-s/GB" in (tmp_path / "quick.md").read_text()
    returned = doc["memory_returned_to_host_gb"]  # GB handed back to the host, where the kernel counts it
    assert len(returned) == 1 and (returned[0] is None or returned[0] >= 0), returned
