"""``decent_optim.recommend``: the README's table is its output, and its rules hold.

The README's table (between its ``recommend: begin`` / ``end`` markers) gives, per situation,
the flags of ``python -m decent_optim.plan`` and the line to write; each row must be what
``recommend`` returns and ``plan`` prints for those flags, so the two cannot drift apart.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

import decent_optim
from decent_optim import _advice_rules as rules
from decent_optim import plan
from decent_optim._plan_args import parse

README = Path(__file__).resolve().parent.parent / "README.md"
SITUATIONS = (
    "One machine with several GPUs",
    "Several nodes on a fast fabric",
    "Slow links between nodes",
    "Uneven hardware",
    "Nodes that fail",
)


def _table() -> list[tuple[str, list[str], str]]:
    text = README.read_text()
    body = text.split("<!-- recommend: begin -->")[1].split("<!-- recommend: end -->")[0]
    rows = []
    for line in body.strip().splitlines()[2:]:  # after the header and its rule
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 3, line
        flags, wanted = (re.fullmatch(r"`(.*)`", c) for c in cells[1:])
        assert flags and wanted, line
        rows.append((cells[0], shlex.split(flags.group(1)), wanted.group(1)))
    return rows


def _advice(argv: list[str]) -> decent_optim.Advice:
    args = parse(argv)  # the plan's own parsing, R from --params --link --step-ms
    return decent_optim.recommend(
        r=args.r,
        nodes=args.nodes,
        workers_per_node=args.workers_per_node or 1,
        speeds=args.speeds,
        failures=args.failures,
        steps=args.steps,
    )


def test_the_readme_has_the_five_situations():
    assert [row[0].split(" (")[0] for row in _table()] == list(SITUATIONS)


@pytest.mark.parametrize("situation, argv, line", _table(), ids=[s[:20] for s in SITUATIONS])
def test_each_readme_line_is_what_recommend_returns_and_plan_prints(
    situation, argv, line, monkeypatch, capsys
):
    assert _advice(argv).line == line
    monkeypatch.delenv("RANK", raising=False)
    assert plan.main(argv) == 0
    assert f"the line to write: {line}\n" in capsys.readouterr().out


def test_the_readme_states_the_one_learning_rate_rule():
    text = README.read_text()
    assert rules.LR_RULE.startswith(f"lr = {rules.LR_SCALE:g} x the learning rate you tuned")
    head = rules.LR_RULE.split(" (")[0]  # the rule without its evidence
    assert head in " ".join(text.split())
    for _, _argv, line in _table():
        if line.startswith("DecentralizedAdamW"):
            assert f"lr={rules.LR_SCALE:g} * ddp_lr" in line


@pytest.mark.parametrize("per_node", [2, 3, 4, 8])
@pytest.mark.parametrize("speeds", [None, "uneven"])
@pytest.mark.parametrize("failures", [False, True])
def test_one_machine_never_gets_a_cross_node_setting(per_node, speeds, failures):
    spread = None if speeds is None else [1.0] * (per_node - 1) + [0.5]
    advice = decent_optim.recommend(
        nodes=1, workers_per_node=per_node, speeds=spread, failures=failures
    )
    assert advice.kwargs["topology"] != "alternating-exp-ring"
    assert "compression" not in advice.kwargs  # it compresses between nodes only
    assert advice.use_ddp == (speeds is None and not failures)
    # what it names builds on that machine's world size
    decent_optim.topologies.get(advice.kwargs["topology"], per_node, per_node)


def test_a_link_as_fast_as_one_machine_says_ddp(monkeypatch, capsys):
    # the found bug: 124M over 7200 Gbit/s at 150 ms (R = 0.0037) named alternating-exp-ring
    argv = ["--params", "124e6", "--link", "7200gbit", "--step-ms", "150"]
    assert _advice(argv).use_ddp
    monkeypatch.delenv("RANK", raising=False)
    assert plan.main(argv) == 0
    out = capsys.readouterr().out
    assert "the line to write: keep torch.optim.AdamW under DistributedDataParallel" in out


def test_speeds_change_the_answer_where_measured(monkeypatch, capsys):
    base = ["--nodes", "2", "--workers-per-node", "2", "--r", "3"]
    monkeypatch.delenv("RANK", raising=False)
    outputs = []
    for extra in ([], ["--speeds", "1", "1", "1", "1"], ["--speeds", "1", "1", "1", "0.5"]):
        assert plan.main(base + extra) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]  # even speeds: the same line
    assert "uneven=True" in outputs[2] and "uneven=True" not in outputs[0]
    # one machine: uneven GPUs make ours the choice, with the uneven page's local_steps=2
    advice = decent_optim.recommend(nodes=1, workers_per_node=4, speeds=[1, 1, 1, 0.5])
    assert not advice.use_ddp and advice.kwargs["local_steps"] == rules.UNEVEN_LOCAL_STEPS


@pytest.mark.parametrize(
    "r, expected",
    [
        (0.05, "ddp"),
        (0.3, {"topology": "alternating-exp-ring", "compression": "int8"}),
        (3.0, {"topology": "alternating-exp-ring", "compression": "int8"}),
        (30.0, {"compression": "int4", "local_steps": 8}),
    ],
)
def test_the_regime_decides_between_nodes(r, expected):
    advice = decent_optim.recommend(r=r, nodes=2, workers_per_node=2)
    if expected == "ddp":
        assert advice.use_ddp
        return
    assert not advice.use_ddp
    assert expected.items() <= advice.kwargs.items()
    assert ("outer" in advice.kwargs) == (r > rules.INT8_HIDDEN_R)


def test_a_short_schedule_at_slow_links_takes_every_step_int8():
    advice = decent_optim.recommend(r=30, nodes=2, workers_per_node=2, steps=480)
    assert advice.kwargs == {"topology": "alternating-exp-ring", "compression": "int8"}


def test_many_workers_follow_their_one_rule(monkeypatch):
    advice = decent_optim.recommend(r=0.5, nodes=8, workers_per_node=2)
    assert advice.sharded and advice.verdict == "ties"
    assert advice.kwargs == rules.MANY_WORKERS_SETTING
    # issue 61's result is one change of that constant
    monkeypatch.setattr(rules, "MANY_WORKERS_SETTING", {"topology": "ring"})
    assert decent_optim.recommend(r=0.5, nodes=8, workers_per_node=2).kwargs == {"topology": "ring"}
    monkeypatch.undo()
    odd = decent_optim.recommend(r=0.5, nodes=6, workers_per_node=8)  # 6 replicas: no one-peer-exp
    assert odd.kwargs["topology"] == "ring"
    decent_optim.topologies.get("ring", 6, 1)
    few = decent_optim.recommend(r=0.5, nodes=4, workers_per_node=2)  # 8 workers
    assert not few.sharded and few.kwargs["topology"] == "alternating-exp-ring"


def test_failures_add_membership_and_keep_the_outer_step():
    """Live membership takes every schedule (issue 62): the line for failures is the line
    without them, plus membership=."""
    plain = decent_optim.recommend(r=30, nodes=4, workers_per_node=1)
    advice = decent_optim.recommend(r=30, nodes=4, workers_per_node=1, failures=True)
    assert "outer" in plain.kwargs
    assert advice.membership and advice.kwargs == plain.kwargs
    assert "membership=Membership(store, timeout=5)" in advice.line
    assert "outer=LocalOuterSGD(" in advice.line


def test_the_keyword_arguments_build_the_optimizer():
    model = torch.nn.Linear(3, 2)
    for _, argv, _line in _table():
        advice = _advice(argv)
        opt = decent_optim.DecentralizedAdamW(
            model.parameters(), lr=advice.lr_scale * 1e-3, **advice.kwargs
        )
        assert isinstance(opt, decent_optim.DecentralizedAdamW)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"nodes": 1}, ValueError, "one worker in all"),
        ({"nodes": 0, "r": 3}, ValueError, "nodes must be finite and > 0"),
        ({"nodes": 2.5, "r": 3}, TypeError, "nodes must be an int"),
        ({"nodes": True, "r": 3}, TypeError, "nodes must be an int"),
        ({"nodes": 2}, ValueError, "several nodes: give params=, link= and step_ms="),
        ({"nodes": 2, "params": 1e9, "link": "1gbit"}, ValueError, "add step_ms"),
        ({"nodes": 2, "r": 3, "params": 1e9}, ValueError, "give r= or params="),
        ({"nodes": 2, "r": -1}, ValueError, "r must be finite and > 0"),
        ({"nodes": 2, "r": float("nan")}, ValueError, "r must be finite"),
        ({"nodes": 2, "params": 1e9, "link": "10gbps", "step_ms": 5}, ValueError, "bytes per"),
        ({"nodes": 2, "r": 3, "speeds": [1, 1, 1]}, ValueError, "one factor per worker"),
        ({"nodes": 2, "r": 3, "speeds": "1 1"}, TypeError, "speeds must be a list"),
        ({"nodes": 2, "r": 3, "speeds": [1, 0]}, ValueError, "every speed must be finite"),
        ({"nodes": 2, "r": 3, "failures": "yes"}, TypeError, "failures must be True or False"),
        ({"nodes": 2, "r": 3, "steps": 0}, ValueError, "steps must be finite and > 0"),
    ],
)
def test_bad_input_gets_a_clear_error(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        decent_optim.recommend(**kwargs)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nodes", "2", "--workers-per-node", "2", "--speeds", "1", "1", "0.5"],
         "--speeds needs one factor per worker: 4 workers"),
        (["--nodes", "2"], "give --params, --link and --step-ms (or --r)"),
        (["--speeds", "1", "0.5"], "give --params, --link and --step-ms (or --r)"),
    ],
)  # fmt: skip
def test_plan_turns_bad_input_into_a_usage_error(argv, message, monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as info:
        plan.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("nodes", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("per_node", [1, 2, 8])
def test_every_named_topology_fits_its_layout(nodes, per_node):
    if nodes * per_node == 1:
        return
    for r in (0.1, 0.5, 3.0, 30.0):
        for speeds in (None, [1.0] * (nodes * per_node - 1) + [0.5]):
            for failures in (False, True):
                advice = decent_optim.recommend(
                    r=r, nodes=nodes, workers_per_node=per_node, speeds=speeds, failures=failures
                )
                world, local = (nodes, 1) if advice.sharded else (nodes * per_node, per_node)
                decent_optim.topologies.get(advice.kwargs["topology"], world, local)  # no error
