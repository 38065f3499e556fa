"""bench/gpu_check.py, the device check, runs where no GPU is: a dry run on CPU tensors
goes through every section a GPU run does but the device's own tests (so the script works
the first time a GPU is lent), and asking for CUDA where there is none says so and exits 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"

pytestmark = pytest.mark.slow


def test_a_dry_run_on_cpu_passes_every_check() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for title in ("The device", "Codec on cpu", "Stream ordering", "Writer and reader processes"):
        assert f"### {title}" in out, out
    assert "| NO |" not in out and out.count("| yes |") >= 5, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_and_exits_2() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr and not done.stdout
