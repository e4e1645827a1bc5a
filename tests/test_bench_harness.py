"""The time-to-quality harness without training: its spec parser, its runner's plan, its report.

The report reads results written here by hand, whose times to each loss and ratios are worked out
below from the curves; the runner's plan (the emulate-cluster commands for each link x seed x
hardware) is read from the commands it would run, with ``subprocess.run`` replaced.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the harness's modules import each other by their names
import methods  # noqa: E402
import report  # noqa: E402
import time_to_quality  # noqa: E402


# -- the spec parser ------------------------------------------------------------------------------
def test_a_spec_parses_to_its_parts() -> None:
    m = methods.parse(
        "decent:alternating-exp-ring+top1%+int2:H2:uneven:cap2:slow32:olr1:om0.3:g0.1"
    )
    assert (m["topology"], m["compression"], m["H"], m["uneven"]) == (
        "alternating-exp-ring", "top1%+int2", 2, True)  # fmt: skip
    assert (m["cap"], m["slow"], m["olr"], m["om"], m["gamma"]) == (2.0, 32, 1.0, 0.3, 0.1)
    s = methods.parse("sdiloco:H8:F2:tau1:alpha0.5:q4")
    assert (s["H"], s["F"], s["tau"], s["alpha"], s["bits"]) == (8, 2, 1, 0.5, 4)
    assert methods.parse("diloco:H4:avg")["avg"] and methods.parse("ddp")["H"] == 1
    assert methods.parse("decent:one-peer-exp+int8:x3:node")["node"]
    assert not methods.parse("decent:one-peer-exp")["node"]


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("adam", "unknown method 'adam': the families are ddp, decent"),
        ("decent:ring:H", "'H' needs a number (H2)"),
        ("decent:ring:outer2", "'outer2' takes no number"),
        ("decent:ring:Hx", "unknown part 'Hx'"),
        ("diloco:H4:uneven", "unknown part 'uneven' (parts of diloco: H, avg, hetero, x, olr, om)"),
        ("sdiloco:H4:hetero", "unknown part 'hetero'"),  # ours streaming: one H for all
        ("diloco:H4:node", "unknown part 'node'"),  # only gossip shards a replica per node
        ("ddp:H2", "unknown part 'H2' (parts of ddp: none)"),
        ("sdiloco:H4:q2", "the exchange is q4 or q8"),
        ("decent:ring:H2:fixed", "fixed/cap<c> need :uneven"),
        ("decent:ring:olr0.5", "olr/om need diloco or :slow<every>"),
        ("decent:ring+int8:g0.1", "g<gamma> needs a sparse or 4-/2-bit codec"),
        ("sdiloco:H4:F1.5", "'F1.5' needs an integer"),
    ],
)
def test_a_bad_spec_says_what_is_wrong(spec: str, says: str) -> None:
    with pytest.raises(SystemExit) as caught:
        methods.parse(spec)
    assert says in str(caught.value)


def test_hetero_gives_each_rank_h_times_its_speed() -> None:
    def hs(spec: str, speeds: str, n: int = 4) -> list[int]:
        return methods.local_steps(methods.parse(spec), speeds, n)

    assert hs("diloco:H16:hetero", "1,1,1,0.5") == [16, 16, 16, 8]
    assert hs("torchft-diloco:H32:hetero", "1,0.25,1,0.75") == [32, 8, 32, 24]
    assert hs("torchft-sdiloco:H32:F4:tau1:hetero", "1,1,0.5,0.25") == [32, 32, 16, 8]
    assert hs("diloco:H6:hetero", "1,0.3", 2) == [6, 2]  # round(1.8)
    assert hs("diloco:H16:hetero", "") == [16] * 4  # no --speeds: all at speed 1, H each
    assert hs("diloco:H16", "1,1,1,0.5") == [16] * 4  # without :hetero the speeds are not read


@pytest.mark.parametrize(
    ("spec", "speeds", "says"),
    [
        ("diloco:H4:hetero", "1,0.1", "rank 1's H round(4 x 0.1) = 0; every rank's must be >= 1"),
        ("torchft-sdiloco:H8:F4:hetero", "1,0.75", "round(8 x 0.75) = 6; every rank's must be >= 1, a multiple of F (4)"),
        ("torchft-sdiloco:H8:F2:tau2:hetero", "1,0.5", "= 4; every rank's must be >= 1, a multiple of F (2) and more than F x tau (4)"),
        ("diloco:H4:hetero", "1,0.5,1", "--speeds needs 2 positive factors"),
    ],
)  # fmt: skip
def test_a_hetero_h_the_speeds_cannot_give_says_what_to_do(spec, speeds, says) -> None:
    with pytest.raises(SystemExit) as caught:
        methods.local_steps(methods.parse(spec), speeds, 2)
    assert says in str(caught.value)


# -- the runner's plan ----------------------------------------------------------------------------
def _plan(monkeypatch, *argv: str, status: int = 0) -> list[list[str]]:
    """The commands the runner would run for ``argv`` (none of them run; each "exits" ``status``)."""
    ran: list[list[str]] = []

    def record(cmd, *args, **kwargs):
        ran.append(list(cmd))
        return type("Done", (), {"returncode": status})()

    monkeypatch.setattr(time_to_quality.subprocess, "run", record)
    monkeypatch.setattr(sys, "argv", ["time_to_quality.py", *argv])
    monkeypatch.delenv("NNODES", raising=False)
    time_to_quality.main()
    return ran


def _after(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_the_runner_runs_each_link_seed_and_hardware_under_the_emulator(monkeypatch) -> None:
    ran = _plan(monkeypatch, "--shape", "2x2", "--rate", "1gbit", "100mbit", "--seeds", "0", "1",
                "--hardware", "even", "half", "--device-ms", "80", "--emulate", "/x/emulate",
                "--tag", "{link}_u_{shape}_{hardware}_s{seed}", "--ddp-from", "d_{hardware}.json",
                "--methods", "ddp", "diloco:H4")  # fmt: skip
    assert len(ran) == 8
    first = ran[0]
    assert first[:9] == ["flock", "/tmp/emulate.lock", "/x/emulate", "--nodes", "2", "--rate",
                         "1gbit", "--timeout", "3600"]  # fmt: skip
    inner = first[first.index("--") + 1 :]
    assert "--inner" in inner and _after(inner, "--tag") == "1gbit_u_2x2_even_s0"
    assert (_after(inner, "--speeds"), _after(inner, "--seed")) == ("", "0")
    assert inner[inner.index("--methods") + 1 :][:2] == ["ddp", "diloco:H4"]
    half = ran[1][ran[1].index("--") + 1 :]
    assert _after(half, "--tag") == "1gbit_u_2x2_half_s0"
    assert _after(half, "--speeds") == "1,1,1,0.5" and _after(half, "--hardware") == "half"
    assert _after(half, "--ddp-from") == "d_half.json"
    assert [_after(c, "--tag") for c in ran[2:4]] == ["1gbit_u_2x2_even_s1", "1gbit_u_2x2_half_s1"]
    assert _after(ran[4], "--rate") == "100mbit"


def test_a_failed_run_fails_the_runner_after_the_others_ran(monkeypatch) -> None:
    with pytest.raises(SystemExit) as caught:
        _plan(monkeypatch, "--rate", "1gbit", "20mbit", "--methods", "ddp", status=124)
    assert "failed (emulate-cluster's exit status; 124: --timeout)" in str(caught.value)
    assert "1gbit: flock" in str(caught.value) and "20mbit: flock" in str(caught.value)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--methods", "ddp", "diloco:Hx"], "unknown part 'Hx'"),
        (["--shape", "2x2"], "--shape 2x2 has 2 nodes: give --rate or --regime"),
        (["--hardware", "half"], "--hardware needs --device-ms"),
        (["--snapshot-rounds", "0"], "--snapshot-rounds 0: give 1 (every round) or more"),
        (["--rate", "1gbit", "--seeds", "0", "1", "--tag", "r"], "names several runs alike"),
        (["--shape", "2by2", "--rate", "1gbit"], "nodes x ranks, e.g. 2x2"),
        (["--one-launch", "--rate", "1gbit"], "--one-launch runs on this machine only"),
        (["--print-rate"], "--print-rate needs one --regime R"),
        (["--speeds", "1,0.2", "--methods", "ddp", "diloco:H2:hetero"], "pick H (or --speeds)"),
    ],
)
def test_the_runner_refuses_a_bad_plan_before_it_runs(monkeypatch, argv, says) -> None:
    with pytest.raises(SystemExit) as caught:
        _plan(monkeypatch, *argv)
    assert says in str(caught.value)


# -- the report -----------------------------------------------------------------------------------
def _row(method: str, curve: list[tuple[int, float, float]], target, sent=None) -> dict:
    steps, train_s, final = curve[-1]
    return {"method": method, "world_size": 4, "local_world_size": 2, "steps": steps,
            "train_s": train_s, "final_loss": final, "ms_per_step": train_s / steps * 1e3,
            "target": target, "bytes_per_step": sent,
            "curve": [{"step": s, "train_s": t, "val_loss": v} for s, t, v in curve]}  # fmt: skip


def _write(folder: Path, tag: str, rows: list[dict], **record) -> None:
    meta = {"tag": tag, "argv": [], "loadavg": [1.5, 1.0, 1.0], "rows": rows, "notes": [], **record}
    (folder / f"ttq_{tag}.json").write_text(json.dumps(meta))


@pytest.fixture
def results(tmp_path: Path) -> Path:
    run = {"link": "1gbit", "shape": "2x2", "seed": 0}
    _write(tmp_path, "1gbit_a_even", hardware="even", **run, rows=[
        _row("ddp", [(50, 25.0, 0.7), (100, 50.0, 0.5)], None, 800.0),
        _row("diloco:H4", [(50, 20.0, 0.6), (100, 40.0, 0.5)], 0.5, 100.0),
        _row("decent:ring:H2", [(50, 10.0, 0.55), (100, 20.0, 0.45)], 0.5, 50.0),
    ])  # fmt: skip
    _write(tmp_path, "1gbit_a_half", hardware="half", **run, rows=[
        _row("ddp", [(50, 50.0, 0.7), (100, 100.0, 0.5)], None, 800.0),
        _row("diloco:H4", [(50, 40.0, 0.6), (100, 80.0, 0.52)], 0.5, 100.0),
        _row("decent:ring:H2", [(50, 12.0, 0.55), (100, 30.0, 0.48)], 0.5, 50.0),
        _row("decent:ring:H2:fixed", [(50, 15.0, 0.55), (100, 40.0, 0.5)], 0.5),
    ])  # fmt: skip
    # a second tag on even hardware: its DDP row is not taken (the first tag's is), its variant is
    _write(tmp_path, "1gbit_b_even", hardware="even", **run, rows=[
        _row("ddp", [(100, 99.0, 0.9)], None),
        _row("decent:ring:H2:x2", [(50, 5.0, 0.6), (100, 16.0, 0.5)], 0.5),
    ])  # fmt: skip
    return tmp_path


def _cells(text: str) -> dict[tuple[str, str], list[str]]:
    """The rows of the printed tables: (method, hardware) -> cells, the later table's last."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] not in ("method",):
            rows[(cells[0], cells[1])] = cells[2:]
    return rows


def test_a_method_sending_more_than_ddp_shows_how_many_times(tmp_path: Path, capsys) -> None:
    _write(tmp_path, "local", hardware="even", link=None, shape="1x4", seed=0, rows=[
        _row("ddp", [(100, 50.0, 0.5)], None, 800.0),
        _row("decent:complete", [(100, 60.0, 0.5)], 0.5, 2000.0),
    ])  # fmt: skip
    report.main(["local", "--results", str(tmp_path)])
    assert _cells(capsys.readouterr().out)[("decent:complete", "even")][-1] == "2.5x"


def test_the_report_gives_the_times_and_ratios_worked_out_by_hand(results: Path, capsys) -> None:
    report.main(["1gbit_a_*", "1gbit_b_even", "--results", str(results), "--versus", "diloco:H4"])
    out = capsys.readouterr().out
    assert "1gbit, 2x2, seed 0 (load average at the end: even 1.5, half 1.5); V = diloco:H4" in out
    rows = _cells(out)
    # time to DDP's loss | vs V | vs even | steps | ms / step | final | vs DDP | bytes vs DDP
    assert rows[("ddp", "even")] == ["50.0 s", "1.25x", "-", "100", "500.0", "0.5000",
                                     "+0.00%", "-"]  # fmt: skip
    assert rows[("ddp", "half")][:3] == ["100.0 s", "-", "2.00x"]  # DiLoCo did not reach it
    assert rows[("diloco:H4", "half")][:3] == ["not reached (80 s)", "-", "-"]
    assert rows[("decent:ring:H2", "even")] == ["20.0 s", "0.50x", "-", "100", "200.0",
                                                "0.4500", "-10.00%", "1/16"]  # fmt: skip
    assert rows[("decent:ring:H2", "half")][:3] == ["30.0 s", "-", "1.50x"]
    assert rows[("diloco:H4", "even")][-1] == "1/8"
    # no even run of its own: against decent:ring:H2's (the periods differ only with the speeds)
    assert rows[("decent:ring:H2:fixed", "half")][:3] == ["40.0 s", "-", "2.00x"]
    assert rows[("decent:ring:H2:x2", "even")][:3] == ["16.0 s", "0.40x", "-"]


def test_one_hardware_has_no_column_against_even_hardware(results: Path, capsys) -> None:
    report.main(["1gbit_b_even", "--results", str(results)])
    out = capsys.readouterr().out
    assert "| method | hardware | time to DDP's loss | steps |" in out
    assert _cells(out)[("decent:ring:H2:x2", "even")][:2] == ["16.0 s", "100"]


def test_the_report_gives_the_time_to_each_loss(results: Path, capsys) -> None:
    report.main(["1gbit_a_*", "--results", str(results), "--versus", "diloco:H4",
                 "--losses", "0.6,0.45"])  # fmt: skip
    rows = _cells(capsys.readouterr().out.split("| to 0.6 |")[1])
    assert rows[("ddp", "even")] == ["50.0 s (2.50x V)", "-", "0.5000"]
    assert rows[("ddp", "half")][0] == "100.0 s (2.50x V, 2.00x even)"
    assert rows[("diloco:H4", "half")] == ["40.0 s (2.00x even)", "-", "0.5200"]
    assert rows[("decent:ring:H2", "even")] == ["10.0 s (0.50x V)", "20.0 s (- V)", "0.4500"]
    assert rows[("decent:ring:H2", "half")] == ["12.0 s (0.30x V, 1.20x even)", "-", "0.4800"]


def test_the_report_reads_older_runs_from_their_arguments(tmp_path: Path) -> None:
    rows = [_row("ddp", [(10, 1.0, 0.5)], None)]
    _write(tmp_path, "100mbit_old", rows=rows, argv=["--seed", "1", "--speeds", "1,1,1,0.25"])
    _write(tmp_path, "100mbit_jit", rows=rows, argv=["--jitter-cv", "0.3"])
    groups = report.load(["100mbit_*"], tmp_path)
    assert {k: list(g) for k, g in groups.items()} == {
        ("100mbit", "2x2", 1): ["quarter"], ("100mbit", "2x2", 0): ["jitter"]}  # fmt: skip
    with pytest.raises(SystemExit, match="no results"):
        report.load(["nothing"], tmp_path)


def test_the_report_plots_one_png_per_link_and_shape(results: Path) -> None:
    written = report.plot(report.load(["1gbit_a_*"], results), results / "plots")
    assert written == [results / "plots" / "ttq_1gbit_2x2.png"]
    assert written[0].read_bytes()[:4] == b"\x89PNG"


# -- composed time to quality: a quality run's steps x a timing run's seconds per step -------------
ALIKE = ["--steps", "100", "--warmup", "10", "--global-batch", "32", "--seed", "0"]


def _timing(method: str, s_per_step: float) -> dict:
    row = _row(method, [(4, 1.0, 0.0), (12, 1.0 + 8 * s_per_step, 0.0)], None)  # clock readings
    return {**row, "kind": "timing", "timed_from": 4, "s_per_step": s_per_step}


def _composed(text: str) -> dict[str, list[str]]:
    """The composed table's rows: method -> cells (the tables of time to each loss left out)."""
    lines = text.split("| to ")[0].splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line[:2] == "| "]
    return {c[0]: c[1:] for c in cells}


@pytest.fixture
def composed(tmp_path: Path) -> Path:
    q = {"link": "local", "shape": "2x2", "seed": 0, "argv": ALIKE}
    _write(tmp_path, "q", **q, rows=[
        _row("ddp", [(50, 9.0, 0.7), (100, 9.0, 0.5)], None),
        _row("diloco:H4", [(25, 9.0, 0.8), (50, 9.0, 0.6), (75, 9.0, 0.5), (100, 9.0, 0.45)], 0.5),
        _row("decent:ring:H2", [(50, 9.0, 0.55), (100, 9.0, 0.52)], 0.5),  # not reached
        _row("decent:ring:H2:uneven", [(50, 9.0, 0.4)], 0.5),
        _row("diloco:H4:hetero", [(50, 9.0, 0.4)], 0.5),
        _row("decent:ring:H8", [(50, 9.0, 0.4)], 0.5),
    ])  # fmt: skip
    t = {"kind": "timing", "link": "R3", "shape": "2x2", "seed": 0, "hardware": "even"}
    _write(tmp_path, "t", **t, argv=[*ALIKE, "--timing-steps", "12"], rows=[
        _timing("ddp", 0.4), _timing("diloco:H4", 0.1), _timing("decent:ring:H2", 0.05),
        _timing("none", 0.01),
    ])  # fmt: skip
    return tmp_path


def test_the_composed_time_is_the_steps_to_the_loss_times_the_seconds_per_step(
    composed: Path, capsys
) -> None:
    report.main(["--compose", "q", "t", "--results", str(composed), "--losses", "0.6,0.45"])
    out = capsys.readouterr().out
    assert "composed: steps from q x seconds per step from t" in out
    assert "| method | steps to DDP's loss | s / step | composed time | measured | error |" in out
    rows = _composed(out)
    assert rows["ddp"][:3] == ["100", "0.4000", "40.0 s"]  # DDP: its steps, the target its loss
    assert rows["diloco:H4"][:3] == ["75", "0.1000", "7.5 s"]  # the first evaluation at 0.5
    assert rows["decent:ring:H2"][:3] == ["not reached in 100", "0.0500", "-"]
    # the time to each loss: the first evaluation at or below it, at the timing run's pace
    losses = _cells(out.split("| to 0.6 |")[1])
    assert losses[("ddp", "even")] == ["40.0 s", "-", "0.5000"]
    assert losses[("diloco:H4", "even")] == ["5.0 s", "10.0 s", "0.4500"]
    assert losses[("decent:ring:H2", "even")] == ["2.5 s", "-", "0.5200"]
    # listed, not dropped: uneven refused, the others missing from one side
    assert "decent:ring:H2:uneven: refused, not step-locked (arrivals decide the mixing)" in out
    assert "diloco:H4:hetero: refused, not step-locked (each rank's H follows its speed)" in out
    assert "decent:ring:H8: missing from the timing run" in out
    assert "none: missing from the quality run" in out


def test_the_composed_curves_are_plotted(composed: Path) -> None:
    report.main(["--compose", "q", "t", "--results", str(composed), "--plot", str(composed)])
    assert (composed / "ttq_R3-composed_2x2.png").read_bytes()[:4] == b"\x89PNG"


def test_a_full_run_as_the_timing_side_checks_the_composition(tmp_path: Path, capsys) -> None:
    # a full run under a link: s / step from the first evaluation past the period (diloco:H4:
    # step 4; ddp: the first) to the last, or to --timing-window; measured: the run's own time
    _write(tmp_path, "full", link="1gbit", shape="2x2", seed=0, argv=ALIKE, rows=[
        _row("ddp", [(2, 3.0, 0.9), (10, 7.0, 0.6), (20, 12.0, 0.5)], None),
        _row("diloco:H4", [(2, 5.0, 0.9), (4, 6.0, 0.8), (8, 7.0, 0.6), (16, 11.0, 0.45)], 0.5),
    ])  # fmt: skip
    report.main(["--compose", "full", "full", "--results", str(tmp_path)])
    rows = _composed(capsys.readouterr().out)
    assert rows["ddp"] == ["20", "0.5000", "10.0 s", "12.0 s", "-16.7%"]
    assert rows["diloco:H4"] == ["16", "0.4167", "6.7 s", "11.0 s", "-39.4%"]
    report.main(["--compose", "full", "full", "--results", str(tmp_path), "--timing-window", "8"])
    rows = _composed(capsys.readouterr().out)
    assert rows["ddp"][:3] == ["20", "0.5000", "10.0 s"]  # steps 2 to 10: 4 s / 8
    assert rows["diloco:H4"][:3] == ["16", "0.2500", "4.0 s"]  # steps 4 to 8: 1 s / 4


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--steps", "200"], "--steps differs (100.0 vs 200.0)"),
        (["--seed", "1"], "--seed differs (0 vs 1)"),
        (["--global-batch", "64"], "--global-batch differs"),
        (["--warmup", "20"], "--warmup differs"),
        (["--device-ms", "80"], "--device-ms differs (0.0 vs 80.0)"),  # DDP's all-reduce follows it
        (["--workload", "shakespeare"], "--workload differs (char vs shakespeare)"),
    ],
)
def test_compose_refuses_runs_that_train_differently(composed: Path, argv, says) -> None:
    meta = json.loads((composed / "ttq_t.json").read_text())
    meta["argv"] = [
        *(
            a
            for pair in {**dict(zip(ALIKE[::2], ALIKE[1::2])), argv[0]: argv[1]}.items()
            for a in pair
        )
    ]
    meta.pop("seed")  # older runs: the seed from the arguments
    (composed / "ttq_t2.json").write_text(json.dumps(meta))
    with pytest.raises(SystemExit) as caught:
        report.main(["--compose", "q", "t2", "--results", str(composed)])
    assert says in str(caught.value) and "must train the same workload" in str(caught.value)


@pytest.mark.parametrize("flag", ["device-ms", "--device-ms"])
def test_compose_pairs_runs_of_another_device_time_or_seed_when_told(
    composed: Path, capsys, flag: str
) -> None:
    # the quality run at 500 ms a step, the timing run at 2000 and seed 1: the steps to a loss
    # do not depend on the device time, nor a step-locked method's seconds per step on the seed
    meta = json.loads((composed / "ttq_t.json").read_text())
    argv = dict(zip(ALIKE[::2], ALIKE[1::2]), **{"--device-ms": "2000", "--seed": "1"})
    (composed / "ttq_t3.json").write_text(
        json.dumps({**meta, "seed": 1, "argv": [a for pair in argv.items() for a in pair]})
    )
    with pytest.raises(SystemExit, match="--device-ms differs"):
        report.main(["--compose", "q", "t3", "--results", str(composed), "--may-differ", "seed"])
    report.main(["--compose", "q", "t3", "--results", str(composed), f"--may-differ={flag},seed",
                 "--plot", str(composed)])  # fmt: skip
    rows = _composed(capsys.readouterr().out)
    assert rows["ddp"][:3] == ["100", "0.4000", "40.0 s"]
    assert rows["diloco:H4"][:3] == ["75", "0.1000", "7.5 s"]
    assert (composed / "ttq_R3-composed_2x2.png").exists()  # and plotted
    with pytest.raises(SystemExit, match="--may-differ --steps: only --device-ms, --seed may"):
        report.main(["--compose", "q", "t3", "--results", str(composed), "--may-differ", "steps"])


def test_a_side_of_compose_may_pool_runs_that_train_alike(composed: Path, capsys) -> None:
    # DDP timed in a run of its own (its step is long), diloco in another: one table
    meta = json.loads((composed / "ttq_t.json").read_text())
    rows = {r["method"]: r for r in meta["rows"]}
    (composed / "ttq_td.json").write_text(json.dumps({**meta, "rows": [rows["ddp"]]}))
    slower = {**rows["diloco:H4"], "s_per_step": 0.2, "curve": _timing("x", 0.2)["curve"]}
    (composed / "ttq_tp.json").write_text(json.dumps({**meta, "rows": [rows["diloco:H4"]]}))
    (composed / "ttq_tp2.json").write_text(json.dumps({**meta, "rows": [slower]}))
    report.main(["--compose", "q", "tp+td+tp2", "--results", str(composed)])
    out = capsys.readouterr().out
    assert "seconds per step from tp+td+tp2" in out
    got = _composed(out)
    assert got["ddp"][:3] == ["100", "0.4000", "40.0 s"]
    assert got["diloco:H4"][:3] == ["75", "0.1000", "7.5 s"]  # the first run's row, not tp2's
    assert "decent:ring:H2: missing from the timing run" in out
    meta["argv"] = [*ALIKE[:-1], "1"]  # seed 1: not alike
    meta.pop("seed")
    (composed / "ttq_ts1.json").write_text(json.dumps({**meta, "rows": [rows["ddp"]]}))
    with pytest.raises(SystemExit, match=r"tp\+ts1: ts1 trains otherwise \(\['--seed'\]\)"):
        report.main(["--compose", "q", "tp+ts1", "--results", str(composed)])


def test_a_pooled_run_with_other_ranks_per_node_gives_only_the_methods_that_do_not_mix_by_node(
    composed: Path, capsys
) -> None:
    # 4 nodes x 1: ours's quality run of its own; DDP and DiLoCo from the 2x2 run (q), which
    # average exactly on any shape; q's gossip row (2 ranks per node) must not stand in for 4x1
    one = ["--local-world-size", "1"]
    _write(composed, "q41", link="local", shape="4x1", seed=0, argv=[*ALIKE, *one], rows=[
        _row("decent:ring:H8", [(50, 9.0, 0.6), (100, 9.0, 0.5)], 0.5),
    ])  # fmt: skip
    t = json.loads((composed / "ttq_t.json").read_text())
    (composed / "ttq_t41.json").write_text(json.dumps({**t, "argv": [*t["argv"], *one]}))
    report.main(["--compose", "q41+q", "t41", "--results", str(composed)])
    out = capsys.readouterr().out
    got = _composed(out)
    assert got["ddp"][:3] == ["100", "0.4000", "40.0 s"]
    assert got["diloco:H4"][:3] == ["75", "0.1000", "7.5 s"]
    assert "decent:ring:H2: missing from the quality run" in out  # q's, 2 ranks per node
    assert "decent:ring:H8: missing from the timing run" in out  # q41's own row is kept
    with pytest.raises(SystemExit, match=r"--local-world-size differs \(1\.0 vs 2\)"):
        report.main(["--compose", "q41+q", "t", "--results", str(composed)])  # a 2x2 timing


def test_compose_refuses_other_ranks_and_odd_tags(composed: Path) -> None:
    meta = json.loads((composed / "ttq_t.json").read_text())
    for r in meta["rows"]:
        r["world_size"] = 16
    (composed / "ttq_t16.json").write_text(json.dumps(meta))
    with pytest.raises(SystemExit, match="ranks differs"):
        report.main(["--compose", "q", "t16", "--results", str(composed)])
    with pytest.raises(SystemExit, match="pairs of tags"):
        report.main(["--compose", "q", "t", "q", "--results", str(composed)])


def test_a_timing_run_runs_k_steps_of_each_method_without_a_target(monkeypatch, tmp_path) -> None:
    ran = _plan(monkeypatch, "--shape", "2x2", "--regime", "3", "--device-ms", "80", "--out",
                str(tmp_path), "--emulate", "/x/emulate", "--timing-steps", "64", "--methods",
                "ddp", "diloco:H16", "decent:ring:H4:slow32")  # fmt: skip
    inner = ran[0][ran[0].index("--") + 1 :]
    assert _after(inner, "--timing-steps") == "64" and _after(inner, "--tag") == "R3"
    # the emulated node's run: one torchrun per method, each with --timing-steps and no target
    launched: list[list[str]] = []

    def torchrun(cmd, *args, **kwargs):  # each method's part, as its rank 0 would write it
        launched.append(cmd)
        row = _timing(_after(cmd, "--method"), 0.25)
        Path(_after(cmd, "--part")).write_text(json.dumps({**row, "steps": 64}))
        return type("Done", (), {"returncode": 0, "stdout": ""})()

    monkeypatch.setattr(time_to_quality.subprocess, "run", torchrun)
    monkeypatch.setattr(sys, "argv", inner[1:])
    time_to_quality.main()
    assert [_after(c, "--method") for c in launched] == ["ddp", "diloco:H16",
                                                         "decent:ring:H4:slow32"]  # fmt: skip
    for cmd in launched:
        assert "--worker" in cmd and _after(cmd, "--timing-steps") == "64"
        assert "--target-from" not in cmd  # a timing run has no target
    meta = json.loads((tmp_path / "ttq_R3.json").read_text())
    assert meta["kind"] == "timing" and meta["link"] == "R3"
    md = (tmp_path / "ttq_R3.md").read_text()
    assert "a timing run (no evaluation)" in md and "* ddp: 0.2500 s / step (steps 4 to 64)" in md


def test_one_launch_with_ddp_from_targets_ddps_loss_and_keeps_its_row(
    monkeypatch, tmp_path
) -> None:
    ddp = _row("ddp", [(8, 2.0, 0.5)], None)
    (tmp_path / "d.json").write_text(json.dumps({"rows": [ddp]}))
    launched: list[list[str]] = []

    def torchrun(cmd, *args, **kwargs):  # the one launch: each method's part, as rank 0 writes it
        launched.append(cmd)
        for method, part in zip(
            _after(cmd, "--method").split(","), _after(cmd, "--part").split(",")
        ):
            Path(part).write_text(json.dumps(_row(method, [(8, 1.0, 0.6)], 0.5)))
        return type("Done", (), {"returncode": 0, "stdout": ""})()

    monkeypatch.setattr(time_to_quality.subprocess, "run", torchrun)
    monkeypatch.setattr(sys, "argv", ["time_to_quality.py", "--one-launch", "--nproc", "2", "--out",
                                      str(tmp_path), "--tag", "q", "--ddp-from", str(tmp_path / "d.json"),
                                      "--methods", "ddp", "diloco:H4", "diloco:H8"])  # fmt: skip
    time_to_quality.main()
    (cmd,) = launched
    assert _after(cmd, "--method") == "diloco:H4,diloco:H8"
    assert _after(cmd, "--target-from").endswith("/.ttq_parts_q/0.json")  # DDP's part, for both
    meta = json.loads((tmp_path / "ttq_q.json").read_text())
    assert [r["method"] for r in meta["rows"]] == ["ddp", "diloco:H4", "diloco:H8"]
    # in the launched processes: DDP has no target, every other method DDP's part
    seen: list[tuple[str, str | None]] = []
    monkeypatch.setitem(sys.modules, "_worker", type(sys)("_worker"))
    sys.modules["_worker"].worker = lambda a: seen.append((a.method, a.target_from))  # type: ignore[attr-defined]
    monkeypatch.setattr("torch.distributed.destroy_process_group", lambda: None)
    monkeypatch.setattr(sys, "argv", ["time_to_quality.py", "--worker", "--method", "ddp,diloco:H4,diloco:H8",
                                      "--part", "a,b,c", "--target-from", "a"])  # fmt: skip
    time_to_quality.main()
    assert seen == [("ddp", None), ("diloco:H4", "a"), ("diloco:H8", "a")]


def test_a_timing_run_may_leave_ddp_out_and_a_full_run_may_not(monkeypatch) -> None:
    ran = _plan(monkeypatch, "--shape", "2x2", "--regime", "30", "--device-ms", "80", "--emulate",
                "/x/emulate", "--timing-steps", "64", "--methods", "diloco:H16")  # fmt: skip
    assert len(ran) == 1 and "diloco:H16" in ran[0]
    with pytest.raises(SystemExit, match="the first method must be ddp"):
        _plan(monkeypatch, "--one-launch", "--nproc", "2", "--methods", "diloco:H16")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--timing-steps", "60", "--methods", "ddp", "diloco:H32"],
         "--timing-steps 60: diloco:H32 needs at least 64 (two periods; the first is not timed)"),
        (["--timing-steps", "40", "--methods", "ddp", "decent:ring:H2:slow32"], "at least 64"),
        (["--timing-steps", "8", "--methods", "ddp", "sdiloco:H4:F2:tau1"], "at least 10"),
        (["--timing-steps", "64", "--methods", "ddp", "decent:ring:H2:uneven"],
         "decent:ring:H2:uneven is not step-locked (arrivals decide the mixing): its time to "
         "quality needs a full run"),
        (["--timing-steps", "64", "--methods", "ddp", "torchft-diloco:H4:hetero"],
         "torchft-diloco:H4:hetero is not step-locked (each rank's H follows its speed)"),
        (["--timing-steps", "64", "--ddp-from", "d.json"], "times DDP too: leave out --ddp-from"),
    ],
)  # fmt: skip
def test_the_runner_refuses_a_bad_timing_run(monkeypatch, argv, says) -> None:
    with pytest.raises(SystemExit) as caught:
        _plan(monkeypatch, "--rate", "1gbit", *argv)
    assert says in str(caught.value)
