"""Live membership as users launch it (issue 64): misuse refused clearly, failures bounded and named.

In this process (no group): ``Membership``'s arguments, the store a worker hosts, an uneven
checkpoint of an impossible world size. On gloo ranks (``_harness``): a second optimizer with
``membership=`` in one process, a world of one, a hung worker without the optimizer's
``timeout=`` (left out after the membership's timeout, and the change logged on every
survivor), and the membership store lost mid-run (training goes on; a later loss names the
store). Every wait is bounded: the harness's timeouts, and each wait of the runs' own.
"""

from __future__ import annotations

import copy
import datetime
import math
import os
import signal
import socket
import time
import warnings

import _live
import pytest
import torch
import torch.distributed as dist
from _harness import run_world, run_world_fresh, start_alone

from decent_optim.gossip.membership import Membership, MembershipError

TIMEOUT = 2.0  # seconds: the membership's timeout in the runs below
WAIT = 30.0  # the runs' own waits for a file, a key or a signal


def _newcomer(**kwargs):
    """A Membership built outside any group (``join=True``): the checks need no job."""
    return Membership(dist.HashStore(), join=True, **kwargs)


def test_timeout_takes_seconds_or_a_timedelta():
    assert _newcomer(timeout=datetime.timedelta(seconds=5)).timeout == 5.0
    assert _newcomer(timeout=3).timeout == 3.0
    assert _newcomer(timeout=torch.tensor(4.0).item(), poll=0.01).poll == 0.01


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(timeout=None), TypeError, r"takes seconds .*got None .*pass the optimizer's"),
        (dict(timeout="5"), TypeError, r"timeout takes seconds \(a float or a datetime"),
        (dict(timeout=True), TypeError, r"timeout takes seconds .*got True"),
        (dict(timeout=math.inf), ValueError, r"timeout must be finite and at least 0.1 seconds"),
        (dict(timeout=1e-9), ValueError, r"at least 0.1 seconds, got 1e-09"),
        (dict(timeout=0), ValueError, r"at least 0.1 seconds, got 0"),
        (dict(timeout=datetime.timedelta(0)), ValueError, r"at least 0.1 seconds"),
        (dict(poll=0), ValueError, r"poll .* must be > 0 and below the timeout \(60 s\), got 0"),
        (dict(poll=-1.0), ValueError, r"poll .* must be > 0"),
        (dict(timeout=1, poll=2), ValueError, r"below the timeout \(1 s\), got 2"),
        (dict(poll=math.nan), ValueError, r"poll .* must be > 0"),
        (dict(poll="fast"), TypeError, r"poll takes seconds"),
        (dict(join="yes"), TypeError, r"join must be True or False, got 'yes'"),
        (dict(join=1), TypeError, r"join must be True or False, got 1"),
        (dict(prefix=""), TypeError, r"prefix must be a non-empty str"),
        (dict(prefix=7), TypeError, r"prefix must be a non-empty str"),
        (dict(backend=None), TypeError, r"backend must be a name such as 'gloo'"),
    ],
)
def test_bad_arguments_are_refused_saying_what_to_pass(kwargs, error, match):
    kwargs = {"join": True, **kwargs}
    with pytest.raises(error, match=match):
        Membership(dist.HashStore(), **kwargs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(port, stop_key):
    """A store in a process that trains nothing, until a client sets ``stop_key``."""
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    store.wait([stop_key], datetime.timedelta(seconds=120))
    return True


def _client(port):
    return dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=WAIT)
    )


def test_a_store_this_process_hosts_is_warned_about():
    port = _free_port()
    hosted = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    with pytest.warns(UserWarning, match=rf"hosts the membership store \(TCPStore .*:{port}\)"):
        Membership(hosted, join=True)
    with pytest.warns(UserWarning, match=r"python -m decent_optim.store --port PORT"):
        Membership(dist.PrefixStore("job", hosted), join=True)
    # a store served by another process: no warning
    port = _free_port()
    server = start_alone(_serve, port, "stop")
    try:
        client = _client(port)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            Membership(client, join=True)
        client.set("stop", "1")
    finally:
        assert server.result(timeout=WAIT)


@pytest.mark.parametrize("world", [-2, 0, True, 2.5, "2"])
def test_an_uneven_checkpoint_of_an_impossible_world_size_is_refused(world):
    from _uneven import build, train_step
    from test_optim_multiprocess import _model

    model = _model()
    opt = build(model, 2)
    for t in range(5):
        train_step(model, opt, 0, t)
    saved = copy.deepcopy(opt.state_dict())
    saved["decent_optim"]["local_steps"]["uneven"]["world_size"] = world
    other = build(_model(), 2)
    with pytest.raises(ValueError, match=r"\['world_size'\] must be the number of workers"):
        other.load_state_dict(saved)
    assert other.progress == 0  # nothing was loaded


def _store(path):
    return dist.FileStore(os.path.join(path, "store"), -1)


def _two_optimizers(rank, world_size, path):
    import gc

    from decent_optim import DSGD

    live = Membership(_store(path), prefix="two", timeout=TIMEOUT)
    first = DSGD(_live.model().parameters(), lr=0.1, membership=live)
    said = {}
    for name, membership in (("same", live), ("another", Membership(_store(path), prefix="b"))):
        try:
            DSGD(_live.model().parameters(), lr=0.1, membership=membership)
        except RuntimeError as err:
            said[name] = str(err)
    del first
    gc.collect()
    # the first one deleted, a new one may take live membership
    DSGD(_live.model().parameters(), lr=0.1, membership=live)
    return said


@pytest.mark.multiprocess
def test_a_second_optimizer_with_membership_in_one_process_is_refused(tmp_path):
    for said in run_world(_two_optimizers, 2, str(tmp_path), timeout=60):
        assert set(said) == {"same", "another"}, said
        for text in said.values():
            assert "this process has an optimizer with live membership already (DSGD)" in text
            assert "one decentralized optimizer with membership= per process" in text
            assert "`del opt`" in text


def _alone(rank, world_size, path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Membership(_store(path), prefix="alone", timeout=TIMEOUT)
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.multiprocess
def test_a_world_of_one_is_told_it_has_no_live_membership(tmp_path):
    (said,) = run_world(_alone, 1, str(tmp_path))
    assert len(said) == 1 and "Membership in a world of one" in said[0], said
    assert "no newcomer can join" in said[0] and "two or more workers" in said[0]


class _Records:
    """The messages of the membership's logger on this rank (a handler on the logger)."""

    def __init__(self):
        import logging

        self.messages = []
        handler = logging.Handler()
        handler.emit = lambda record: self.messages.append((record.levelname, record.getMessage()))
        logging.getLogger("decent_optim.gossip.membership").addHandler(handler)


HUNG_AT, STEPS = 4, 10


def _hung_without_timeout(rank, world_size, path):
    from decent_optim import DSGD

    logs = _Records()
    live = Membership(_store(path), prefix="hung", timeout=TIMEOUT)
    model = _live.model()
    opt = DSGD(model.parameters(), lr=0.05, topology="ring", membership=live)  # no timeout=
    out = {}
    for t in range(STEPS):
        if t == HUNG_AT and rank == 2:
            live.store.set("stopped", f"{os.getpid()} {time.time()}")
            os.kill(os.getpid(), signal.SIGSTOP)  # hung: rank 0 kills it at the end
        _live.loss(model, rank, t).backward()
        generation = opt.membership.generation
        opt.step()
        opt.zero_grad()
        if opt.membership.generation != generation:
            out["changed"] = time.time()
    out["view"], out["logs"] = tuple(opt.membership), logs.messages
    pid, stopped = live.store.get("stopped").decode().split()
    out["stopped"] = float(stopped)
    if rank == 0:
        os.kill(int(pid), signal.SIGKILL)
    return out


@pytest.mark.multiprocess
def test_a_hung_worker_is_left_out_after_the_membership_timeout_and_logged(tmp_path):
    # without the membership's bound the survivors wait the harness's process-group timeout
    # (30 s) for the hung rank; with it, TIMEOUT for its round plus the agreement
    results = run_world_fresh(_hung_without_timeout, 4, str(tmp_path), timeout=90, killed=(2,))
    assert results[2] is None
    for new_rank, old in enumerate((0, 1, 3)):
        out = results[old]
        assert out["view"] == (1, (0, 1, 3), new_rank, (2,)), out["view"]
        assert out["changed"] - out["stopped"] < 5 * TIMEOUT, out
        lost = [m for level, m in out["logs"] if level == "WARNING" and "lost id(s) [2]" in m]
        assert len(lost) == 1 and "generation 1" in lost[0] and "3 member(s)" in lost[0], out


LOST_AT, KILL_AT = 3, 8  # rank 0's step at which the store goes, rank 1's at which it dies


def _stop_store(port):
    """Ask the store's process to exit, and wait (at most WAIT) until it no longer answers."""
    control = _client(port)
    control.set("stop", "1")
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        try:
            control.check(["stop"])
        except dist.DistNetworkError:
            return
        time.sleep(0.05)


def _store_lost(rank, world_size, port):
    from decent_optim import DSGD

    live = Membership(_client(port), prefix="lost", timeout=TIMEOUT)
    model = _live.model()
    opt = DSGD(model.parameters(), lr=0.05, topology="ring", timeout=WAIT, membership=live)
    out = {"steps": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(STEPS):
            if t == LOST_AT and rank == 0:
                _stop_store(port)
            if t == KILL_AT and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            _live.loss(model, rank, t).backward()
            try:
                opt.step()
            except MembershipError as err:
                out["error"] = str(err)
                break
            opt.zero_grad()
            out["steps"] += 1
    out["warnings"] = [str(w.message) for w in caught if "membership store" in str(w.message)]
    return out


@pytest.mark.multiprocess
def test_a_lost_store_pauses_membership_and_a_later_loss_names_it(tmp_path):
    port = _free_port()
    server = start_alone(_serve, port, "stop")
    try:
        results = run_world_fresh(_store_lost, 2, port, timeout=90, killed=(1,))
    finally:
        assert server.result(timeout=WAIT)
    out = results[0]
    # training went on after the store was lost, until the peer died (at rank 0's step 8 or 9:
    # the round rank 1 launched at the end of its step 7 may still arrive)
    assert KILL_AT <= out["steps"] <= KILL_AT + 1, out
    assert len(out["warnings"]) == 1, out["warnings"]
    assert "training goes on, but live membership is paused" in out["warnings"][0]
    said = out["error"]
    assert f"a change of membership needs the membership store (TCPStore 127.0.0.1:{port})" in said
    assert (
        "Restart the job from its last checkpoint" in said
        and "python -m decent_optim.store" in said
    )
