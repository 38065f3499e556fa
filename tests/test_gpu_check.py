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


_ONE_SECTION_FAILS = """
import sys
sys.path.insert(0, sys.argv[1])
sys.argv[1:] = ["--device", "cpu", "--quick"]
import gpu_check

def broken(*args, **kwargs):
    raise RuntimeError("a planted failure")

gpu_check.codec_table = broken
sys.exit(gpu_check.main())
"""


def test_a_section_that_fails_is_reported_and_the_others_still_run() -> None:
    """Each table is printed as its section ends, and one section's exception (on a new
    machine: a missing program, a driver's refusal) loses none of the others."""
    done = subprocess.run([sys.executable, "-c", _ONE_SECTION_FAILS, str(SCRIPT.parent)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    out = done.stdout
    assert done.returncode == 1, done.stderr[-3000:]
    assert "### Codec\n\nfailed: RuntimeError: a planted failure" in out, out
    for title in ("The device", "Stream ordering", "Writer and reader processes"):
        assert f"### {title}" in out, out
    assert "gpu_check: Codec: RuntimeError: a planted failure" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_and_exits_2() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr and not done.stdout
