"""The regime R of ``python -m decent_optim.plan``: from its parts, and the setting named for it.

Expected values are worked out by hand in the comments from the payload sizes that
``decent_optim/runtime/wire.py``'s docstring specifies (chunks of 1024 elements; per chunk k
values packed to b bits, a float32 scale when quantized, k uint16 positions for top-k).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from decent_optim import plan
from decent_optim.runtime import regimes

ROOT = Path(__file__).resolve().parent.parent


# -- R from its parts ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "params, link, step_s, expected",
    [
        # 32 x 124e6 = 3.968e9 bits over 1e10 bit/s = 0.3968 s, / 0.055 s = 7.2145...
        (124e6, "10gbit", 0.055, 3.968e9 / 1e10 / 0.055),
        # GPT 124M with untied head (163M) at 1 Gbit/s: 5.216 s / 0.055 s = 94.84
        (163e6, "1gbit", 0.055, 94.836363636),
        # GPT 1.3B (1.42B) at 100 Gbit/s, batch 16: 0.4544 s / 0.313 s = 1.4518
        (1.42e9, "100gbit", 0.313, 1.451757188),
        # 1e9 parameters over 400 Mbit/s at 0.1 s: 3.2e10 / 4e8 = 80 s, / 0.1 = 800
        (1e9, "400mbit", 0.1, 800.0),
    ],
)
def test_r_from_params_link_and_step_time(params, link, step_s, expected):
    assert regimes.ratio(params, regimes.link_bits(link), step_s) == pytest.approx(expected)


@pytest.mark.parametrize(
    "text, bits",
    [("100mbit", 1e8), ("400mbit", 4e8), ("1gbit", 1e9), ("10GBit", 1e10), ("2.5gbit", 2.5e9),
     ("512kbit", 512e3), ("1tbit", 1e12), ("1e6bit", 1e6)],
)  # fmt: skip
def test_link_rates_are_bits_per_second(text, bits):
    assert regimes.link_bits(text) == pytest.approx(bits)


@pytest.mark.parametrize(
    "text, message",
    [
        ("10gbps", "in tc's units '10gbps' is bytes per second: for bits write e.g. '10gbit'"),
        ("1.25gbps", "is bytes per second"),
        ("fast", "the link must be a rate in bits per second such as '100mbit'"),
        ("10g", "got '10g'"),
        ("gbit", "got 'gbit'"),
        ("0gbit", "(finite, > 0), got '0gbit'"),
        ("-1gbit", "(finite, > 0), got '-1gbit'"),
        ("infgbit", "(finite, > 0)"),
        ("nanmbit", "(finite, > 0)"),
    ],
)
def test_a_bad_link_rate_says_how_to_write_one(text, message):
    with pytest.raises(ValueError) as info:
        regimes.link_bits(text)
    assert message in str(info.value)


def test_the_arithmetic_is_printed():
    text = regimes.ratio_text(124e6, 1e10, 0.055)
    assert text == (
        "R = 32 bit x 1.24e+08 parameters / 1e+10 bit/s = 0.3968 s per float32 copy, "
        "/ 0.055 s per step = 7.215"
    )


# -- the setting named for an R ------------------------------------------------------------------
# Bytes per element (b/e) of the candidates: bf16 2; int8 (4 + 1024) / 1024 = 1.0039;
# int4 (4 + 512) / 1024 = 0.5039; int2 (4 + 256) / 1024 = 0.2539; top10% keeps
# round(102.4) = 102 per chunk: +int8 (4 + 102 + 204) / 1024 = 0.3027, +int4 (4 + 51 + 204) / 1024
# = 0.2529; top1% keeps 10: +int8 (4 + 10 + 20) / 1024 = 0.0332, +int4 29 / 1024, +int2
# (4 + 3 + 20) / 1024 = 0.02637; rand1% sends no positions: +int4 (4 + 5) / 1024 = 0.008789,
# +int2 7 / 1024 = 0.006836; rand0.1% keeps max(1, round(1.024)) = 1: +int4 5 / 1024 = 0.004883.
# A round takes R x b/e / 4 steps (float32: R) and is hidden at local_steps H if that is <= H.
@pytest.mark.parametrize(
    "r, h, codec, steps, mild",
    [
        # float32 crosses in 0.3 <= 1 step: no compression, every step
        (0.3, 1, None, 0.3, (1, None, 0.3)),
        # R = 1 is the edge: float32 takes exactly 1 step
        (1.0, 1, None, 1.0, (1, None, 1.0)),
        # float32 3 > 1, bf16 1.5 > 1, int8 3 x 1.0039 / 4 = 0.753 <= 1
        (3.0, 1, "int8", 3 * 1028 / 1024 / 4, (1, "int8", 3 * 1028 / 1024 / 4)),
        # int8's scales push it over: 4 x 1.0039 / 4 = 1.0039 > 1; int4 0.504; the mild one
        # needs H = 2: float32 4 > 2, bf16 4 x 2 / 4 = 2 <= 2
        (4.0, 1, "int4", 516 / 1024, (2, "bf16", 2.0)),
        # 124M over 10 Gbit/s at 55 ms: int8 7.21 x 1.0039 / 4 = 1.81 > 1, int4 0.909; with H = 2
        # int8's 1.81 <= 2 (bf16 3.61 > 2)
        (7.2145, 1, "int4", 7.2145 * 516 / 4096, (2, "int8", 7.2145 * 1028 / 4096)),
        # at H = 1 the most bytes with R x b/e / 4 <= 1, i.e. b/e <= 0.1333: top1%+int8 0.249
        # steps (top10%+int4 1.90, int2 1.90 are over); the mild one: int8 7.53 <= 8 (not <= 4)
        (30.0, 1, "top1%+int8", 30 * 34 / 4096, (8, "int8", 30 * 1028 / 4096)),
        # b/e <= 0.01333: rand1%+int4 0.659 steps (top1%+int2 1.98 is over); int8 75 steps > 8
        (300.0, 1, "rand1%+int4", 300 * 9 / 4096, None),
        # H = 1: rand0.1%+int4 1.22 > 1, nothing; H = 2: rand1%+int2 1.71 <= 2, rand1%+int4 2.20 > 2
        (1000.0, 2, "rand1%+int2", 1000 * 7 / 4096, None),
        # rand0.1%+int4 6.10: over 4, under 8; rand1%+int2 8.54 > 8
        (5000.0, 8, "rand0.1%+int4", 5000 * 5 / 4096, None),
        # rand0.1%+int4 12.2 > 8: nothing is hidden
        (10000.0, None, None, None, None),
    ],
)
def test_the_setting_named_for_r(r, h, codec, steps, mild):
    rec = regimes.recommend(r)
    assert (rec.local_steps, rec.compression) == (h, codec)
    assert rec.steps == (None if steps is None else pytest.approx(steps))
    if mild is None:
        assert rec.mild is None
    else:
        assert rec.mild == (mild[0], mild[1], pytest.approx(mild[2]))
    assert rec.topology == "alternating-exp-ring"


@pytest.mark.parametrize(
    "r, regime",
    [(0.3, "R <= 1"), (1.0, "R <= 1"), (1.01, "1 < R <= 10"), (10.0, "1 < R <= 10"),
     (30.0, "10 < R <= 100"), (100.0, "10 < R <= 100"), (300.0, "R > 100")],
)  # fmt: skip
def test_the_regime_classes(r, regime):
    assert regimes.recommend(r).regime.startswith(regime + ":")


def test_the_codecs_tried_can_be_narrowed():
    # only int8 besides float32: at R = 30, float32 30 and int8 7.53 steps: hidden first at H = 8
    rec = regimes.recommend(30.0, ("int8",))
    assert (rec.local_steps, rec.compression) == (8, "int8")


def test_the_text_states_the_setting_its_costs_and_that_quality_is_not_predicted():
    text = regimes.recommend(30.0).text()
    assert "regime: 10 < R <= 100" in text
    assert "topology='alternating-exp-ring', local_steps=1, compression='top1%+int8'" in text
    assert "a round crosses in 0.249 steps" in text
    assert "local_steps=8, compression='int8' (7.53 steps per round)" in text
    assert "quality costs are not predicted" in text
    assert "docs/algorithms.rst, 'What they cost in training'" in text  # a sparse codec
    assert "docs/time_to_quality.rst" in text  # local steps (the mild setting's 8)
    fast = regimes.recommend(0.3).text()
    assert "compression=None (float32)" in fast and "All-Reduce (DDP) may be as fast" in fast
    assert "What they cost in training" not in fast and "local_steps > 1" not in fast
    none = regimes.recommend(1e4).text()
    assert "no round of the codecs tried is hidden with local_steps <= 8" in none
    assert "no round of float32, bf16 or int8 is hidden" in none


def test_r_must_be_positive():
    with pytest.raises(ValueError, match="R must be > 0"):
        regimes.recommend(0.0)


# -- the command line ----------------------------------------------------------------------------
def test_plan_without_torchrun_prints_r_from_its_parts_and_the_setting():
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("RANK", None)
    cmd = [sys.executable, "-m", "decent_optim.plan",
           "--params", "124e6", "--link", "10gbit", "--step-ms", "55"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "= 0.3968 s per float32 copy, / 0.055 s per step = 7.215" in out
    assert "local_steps=1: compression='int4' keeps a round hidden" in out  # the table
    assert "regime: 1 < R <= 10" in out
    assert "local_steps=1, compression='int4': a round crosses in 0.909 steps" in out
    assert "local_steps=2, compression='int8' (1.81 steps per round)" in out


def test_plan_with_r_prints_the_setting_too(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert plan.main(["--r", "300"]) == 0
    out = capsys.readouterr().out
    assert "regime: R > 100" in out and "compression='rand1%+int4'" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--r", "3", "--link", "1gbit"], "pick one: --r R, or --params N --link RATE --step-ms S"),
        (["--r", "3", "--step-ms", "50"], "pick one"),
        (["--params", "1e9", "--link", "1gbit"], "needs --params N --link RATE --step-ms S; add --step-ms"),
        (["--link", "1gbit", "--step-ms", "50"], "; add --params"),
        (["--step-ms", "50"], "; add --params --link"),
        (["--params", "1e9", "--link", "10gbps", "--step-ms", "5"], "argument --link: "),
        (["--params", "1e9", "--link", "1gbit", "--step-ms", "0"], "argument --step-ms: must be > 0"),
        (["--params", "1e300", "--link", "1bit", "--step-ms", "1e-300"], "out of range"),
    ],
)  # fmt: skip
def test_bad_regime_arguments_get_a_usage_error(argv, message, monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as info:
        plan.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_help_says_r_is_on_float32():
    text = plan._parser().format_help()
    assert "on float32 copies whatever --dtype and --compression say" in " ".join(text.split())


@pytest.mark.multiprocess
def test_plan_under_torchrun_prints_the_setting_after_the_table(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "decent_optim.plan", "--params", "20000", "--iters", "2", "--reps", "1",
        "--link", "1gbit", "--step-ms", "10", "--topologies", "ring",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    # 32 x 20000 / 1e9 = 6.4e-4 s, / 0.01 s = 0.064: float32 crosses in 0.064 steps
    assert "= 0.00064 s per float32 copy, / 0.01 s per step = 0.064" in out
    assert out.index("recommended:") < out.index("regime: R <= 1")
    assert "local_steps=1, compression=None (float32): a round crosses in 0.064 steps" in out
    # the line to write, for the layout measured: 2 ranks on one machine
    assert "for 1 node(s) x 2 worker(s):" in out
    assert "the line to write: keep torch.optim.AdamW under DistributedDataParallel" in out
