"""The chaos harness, short: ``bench/chaos.py``, one round of faults, one every 4 s — two
masters on one Redis, four nodes, clients with ``replicas=2`` checking every byte they
read — must finish with 0 wrong bytes, every fault kind injected once (the network ones
where namespaces are permitted; ``--rounds 1`` waits out a slow restart on a loaded machine
instead of dropping the last kinds), reads served throughout, and nothing left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def test_short_chaos_run_reads_only_the_bytes_written(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "chaos.py"), "--rounds", "1", "--every", "4",
         "--duration", "150", "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["wrong_bytes"] == 0 and result["checked_bytes"] > 0
    assert result["crashed_tasks"] == []
    injected = {f["kind"] for f in result["faults"]}
    assert injected == set(result["fault_kinds"]), result["faults"]
    assert len(result["faults"]) == len(result["fault_kinds"])  # one round, then the end
    expected = {"kill-node", "stop-node", "kill-master"}
    if result["netns"] == "on":
        expected |= {"cut-node", "slow-node"}
    assert injected == expected
    gets = result["by_kind"]["get"]
    assert gets["ok"] > 0.5 * gets["ops"], gets  # reads were served through the faults
    assert "wrong bytes: **0**" in run.stdout
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    assert "kvc" not in left.stdout  # the namespaces are gone
