"""The GPU check of issue 24 in one command: the CUDA tests and the GPU benchmarks, one folder.

    benchmarks/gpu_check.sh                      # on a GPU machine: about 5-9 minutes on an H100
    benchmarks/gpu_check.sh --device cpu         # smoke run: tiny sizes, seconds to a minute

Runs, each in its own process with a deadline so that the whole stays under ``--budget-s``:

1. ``pytest tests/test_cuda.py tests/test_cuda_rounds.py`` with ``DECENT_OPTIM_TEST_DEVICE=<device>`` -> ``pytest.txt``;
2. ``optimizer_step.py`` (AdamW, AccumAdamW and SGD methods, the one-pass candidate) on the
   GPT-style shape sets -> ``optimizer_step.{md,json}``;
3. ``memory.py --device`` (peak memory beyond parameters and gradients) -> ``memory_<kind>.{md,json}``;

then ``summary.md``: the machine, each stage's status and time, pytest's summary line and the
tables. Benchmark output goes to ``logs.txt``. Everything lands in ``--out`` (default ``$OUT``
if set, else ``./gpu_check_out``): seven files, no subfolders, so the device tool brings all
back. The exit status is 0 only if every stage succeeded and every test passed or skipped.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"

#: per device kind: shape sets of the two benchmarks, timed steps, warm-up steps, compile backend
SIZES = {
    "cuda": dict(steps=["gpt-125m", "gpt-1.3b"], memory=["gpt-1.3b"], iters=50, warmup=5,
                 backend="inductor"),
    "cpu": dict(steps=["gpt-tiny"], memory=["gpt-tiny"], iters=3, warmup=1, backend="aot_eager"),
}  # fmt: skip
METHODS = [
    "torch-fused", "decent-update", "decent-step", "decent-step-compiled", "accum-update",
    "accum-step", "torch-sgd-fused", "dsgd-update", "dsgd-step",
]  # fmt: skip
#: the CUDA tests: the optimizers' paths (issue 24), and the rounds, codecs and schedules after it
TEST_FILES = ["tests/test_cuda.py", "tests/test_cuda_rounds.py"]
#: the most seconds each stage may take (less when the budget left is smaller)
STAGE_CAP_S = {"tests": 300, "optimizer_step": 200, "memory": 100}


def _default_out() -> Path:
    return Path(os.environ.get("OUT") or "gpu_check_out")


def _machine(device: str) -> list[str]:
    lines = [f"- host: {platform.node()}, Python {platform.python_version()}"]
    try:
        import torch

        lines.append(f"- torch {torch.__version__}, CUDA {torch.version.cuda}")
        if device.startswith("cuda") and torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            lines.append(
                f"- device: {props.name}, {props.total_memory / 2**30:.0f} GiB, "
                f"{props.multi_processor_count} SMs"
            )
        elif device.startswith("cuda"):
            lines.append("- device: **torch.cuda.is_available() is False**")
    except Exception as err:  # the summary must still be written
        lines.append(f"- torch: not importable ({err})")
    try:
        import triton

        lines.append(f"- triton {triton.__version__}")
    except Exception:
        lines.append("- triton: not installed")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    lines.append(f"- commit: {commit.stdout.strip() or 'unknown (no git here)'}")
    return lines


class Stages:
    """Runs commands under one overall deadline and keeps what each did."""

    def __init__(self, out: Path, budget_s: float, env: dict[str, str]) -> None:
        self.out, self.env = out, env
        self.deadline = time.monotonic() + budget_s
        self.report: list[tuple[str, str, float]] = []  # (stage, status, seconds)
        self.log = open(out / "logs.txt", "w")

    def run(self, name: str, cmd: list[str], output: Path | None = None) -> tuple[bool, str]:
        limit = min(STAGE_CAP_S[name], self.deadline - time.monotonic())
        if limit < 10:
            self.report.append((name, "not run: the budget was spent", 0.0))
            return False, ""
        print(f"[gpu_check] {name}: {' '.join(cmd)} (up to {limit:.0f} s)", flush=True)
        start = time.monotonic()
        # its own process group, so that a timeout ends its children too (pytest's rank
        # workers, inductor's compile workers), which would otherwise hold the output pipe open
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )  # fmt: skip
        try:
            text, _ = proc.communicate(timeout=limit)
            status, ok = f"exit status {proc.returncode}", proc.returncode == 0
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
            status, ok = f"**timed out** after {limit:.0f} s", False
        seconds = time.monotonic() - start
        self.report.append((name, status, seconds))
        target = open(output, "w") if output is not None else self.log
        target.write(f"===== {name}: {' '.join(cmd)}\n{text}\n===== {status}, {seconds:.0f} s\n")
        target.flush()
        print(f"[gpu_check] {name}: {status}, {seconds:.0f} s", flush=True)
        return ok, text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (tiny smoke run)")
    p.add_argument("--out", type=Path, default=None, help="default: $OUT, else ./gpu_check_out")
    p.add_argument("--budget-s", type=float, default=570, help="for all stages together")
    p.add_argument("--tests-k", default=None, help="pytest -k expression for the CUDA tests")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--shapes", nargs="+", default=None, help="optimizer_step shape sets")
    args = p.parse_args(argv)
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    sizes = SIZES[kind]
    out = (args.out or _default_out()).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DECENT_OPTIM_TEST_DEVICE=args.device, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    # one inductor cache for every stage: a kernel compiled by the tests serves the benchmarks
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/decent_optim_gpu_check_inductor")
    stages = Stages(out, args.budget_s, env)
    py = sys.executable

    pytest_line, tests_ok = "not run", True
    if not args.skip_tests:
        cmd = [py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *TEST_FILES]
        if args.tests_k:
            cmd += ["-k", args.tests_k]
        tests_ok, text = stages.run("tests", cmd, out / "pytest.txt")
        found = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|error).*?)\s*=*$", text, re.M)
        pytest_line = found[-1] if found else "no summary line (see pytest.txt)"
    stages.run(
        "optimizer_step",
        [py, str(BENCH / "optimizer_step.py"), "--device", args.device, "--out", str(out),
         "--shapes", *(args.shapes or sizes["steps"]), "--methods", *METHODS,
         "--iters", str(sizes["iters"]), "--warmup", str(sizes["warmup"]),
         "--compile-backend", sizes["backend"]],
    )  # fmt: skip
    stages.run(
        "memory",
        [py, str(BENCH / "memory.py"), "--device", args.device, "--out", str(out),
         "--shapes", *sizes["memory"]],
    )  # fmt: skip
    stages.log.close()

    lines = [f"# GPU check ({args.device}), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"]
    lines += [
        "",
        *_machine(args.device),
        "",
        f"pytest {' '.join(TEST_FILES)}: **{pytest_line}**",
        "",
    ]
    lines += ["| stage | status | seconds |", "|---|---|---:|"]
    lines += [f"| {name} | {status} | {sec:.0f} |" for name, status, sec in stages.report]
    for table in ("optimizer_step.md", f"memory_{kind}.md"):
        path = out / table
        lines += ["", f"## {table}", "", path.read_text() if path.exists() else "(not written)"]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print((out / "summary.md").read_text())
    failed = [name for name, status, _ in stages.report if status != "exit status 0"]
    return 0 if tests_ok and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
