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


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("adam", "unknown method 'adam': the families are ddp, decent"),
        ("decent:ring:H", "'H' needs a number (H2)"),
        ("decent:ring:outer2", "'outer2' takes no number"),
        ("decent:ring:Hx", "unknown part 'Hx'"),
        ("diloco:H4:uneven", "unknown part 'uneven' (parts of diloco: H, avg, x, olr, om)"),
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
        (["--rate", "1gbit", "--seeds", "0", "1", "--tag", "r"], "names several runs alike"),
        (["--shape", "2by2", "--rate", "1gbit"], "nodes x ranks, e.g. 2x2"),
        (["--one-launch", "--rate", "1gbit"], "--one-launch runs on this machine only"),
        (["--print-rate"], "--print-rate needs one --regime R"),
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
