"""The GPU check's smoke run on the CPU: one command writes every table (benchmarks/gpu_check.py).

The check itself needs a GPU (issue 24); this keeps the command, its stages and its tables from
rotting between the sessions that have one. ``--tests-k`` picks one test of the CUDA tests,
so the run takes seconds.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = [
    "logs.txt",
    "memory_cpu.json",
    "memory_cpu.md",
    "optimizer_step.json",
    "optimizer_step.md",
    "pytest.txt",
    "summary.md",
]


def test_gpu_check_smoke_run_writes_every_table(tmp_path):
    one_test = "world_size_one and DecentralizedAdamW and amsgrad and fp32"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu"]
    cmd += ["--out", str(tmp_path), "--tests-k", one_test]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    # flat and few: the device tool brings back at most 8 files from at most 2 folders down
    assert sorted(p.name for p in tmp_path.iterdir()) == FILES
    summary = (tmp_path / "summary.md").read_text()
    assert "pytest tests/test_cuda.py tests/test_cuda_rounds.py: **1 passed" in summary, summary
    steps = (tmp_path / "optimizer_step.md").read_text()
    for method in ("torch-fused", "decent-update", "decent-step", "decent-step-compiled"):
        assert f"| gpt-tiny | 28 | 0.1M | {method} |" in steps, steps
    assert "accum-step / decent-step <= 1.1" in steps and "device-to-device copy" in steps
    memory = (tmp_path / "memory_cpu.md").read_text()
    assert (
        "| DecentralizedAdamW, full step <= fused AdamW + 1 copies (3.00) | 3.00 | met |" in memory
    )
