"""Run a function on ``n`` gloo ranks, in worker processes reused across tests.

Test files import it by its top-level name (``tests/conftest.py`` puts ``tests/`` on ``sys.path``)::

    from _harness import run_world

    def _sum_ranks(rank, world_size):          # module level, so it pickles by name
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        return t

    @pytest.mark.multiprocess
    def test_sum():
        assert all(t.item() == 3.0 for t in run_world(_sum_ranks, 3))

``run_world(fn, n, *args)`` calls ``fn(rank, n, *args)`` on every rank of a pool of ``n`` worker processes
and returns the results as a list indexed by rank. Each worker joined a gloo world group once, at start-up
(``file://`` rendezvous in a temporary directory, so no port races; a 30 s timeout, so a send without its
receive raises rather than hangs). Pools are created lazily, one per world size, and live until the end of
the session. ``run_world_fresh`` has the same contract in brand-new processes, torn down afterwards.
Workers are forked by a ``multiprocessing`` fork server that imported torch once (importing torch takes
seconds of CPU per process: eight ranks on two cores waited for it at every new pool); nothing else ran in
the server, so a worker starts as a spawned one would, with torch imported and unused. Not
``torch._dynamo`` (which decent_optim imports, another second or so): forked with it imported, a worker's
gloo connections behave differently (a peer's closed connection refuses a later receive at posting). It gets this
process's environment and standard output/error at the pool's start, as a spawned one inherits them.
``start_alone(fn, *args)`` runs ``fn(*args)`` in one new process outside any process group (a worker
that joins a running world), alongside; ``.result(timeout)`` returns its result.
``wait_for_the_other_ranks()``, called in a task, blocks until the task has returned on the other ranks: a
rank that must stay alive but silent until its peers gave up on it waits exactly that long, where a fixed
sleep would have to be long enough for a loaded machine in every run.

Every task starts from the same process state: ``torch.manual_seed(0)`` (and ``random``/``numpy``), the
environment, working directory, default dtype/device, grad mode and thread count of a fresh worker, and a
``dist.barrier()`` so all ranks start together. Process groups the task created are destroyed after it (once
every rank has returned), so a group handle cached at module level is dead in the next task. Not reset: other module-level state of imported
modules (caches, globals, threads a task left running). ``print`` output of a task is replayed, prefixed with
``[rank r]``, into the calling test's captured stdout; output written by C++ (gloo) is not captured.

Failure handling: if any rank raises, dies, or does not answer within ``timeout`` seconds, the pool is
killed (its process group may be out of step) and :class:`WorldError` is raised with every failing rank's
remote traceback, and for each rank that never answered the Python stacks of its threads (faulthandler);
the next call for that world size starts a new pool. Nothing here blocks without a deadline, and workers exit
on their own when the parent process goes away.

This module never imports ``decent_optim``, and imports torch only inside the workers.
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import io
import multiprocessing
import os
import pickle
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from multiprocessing import reduction
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = [
    "WorldError",
    "WorldTimeoutError",
    "pool_pids",
    "run_world",
    "run_world_fresh",
    "shutdown_pools",
    "start_alone",
    "wait_for_the_other_ranks",
]

#: Timeout given to ``init_process_group``: a collective or recv whose peer never comes raises after it.
PROCESS_GROUP_TIMEOUT_S = 30.0
#: Deadline for a new pool to start and rendezvous (eight ranks on two idle cores: ~12 s;
#: several times that when the machine is busy).
STARTUP_TIMEOUT_S = 180.0
#: Once one rank has failed, how long to wait for the others before killing them: they are usually
#: blocked in a collective with the failed rank and would otherwise sit out the process-group timeout.
ERROR_GRACE_S = 2.0
#: How workers start: "forkserver" (forked from a server that imported ``PRELOAD``) or "spawn" (a new
#: interpreter each, importing torch itself: seconds more per rank, for a comparison).
START_METHOD = "forkserver"
#: Imported once by the fork server that starts every worker: torch only, no state of a test.
PRELOAD = ["torch", "torch.distributed"]
#: Tail of each rank's captured stdout/stderr kept in error messages.
OUTPUT_TAIL_CHARS = 4000
#: After a task that built process groups, how long a rank waits for its peers to return before it
#: destroys them (a peer may still be connecting to a group this rank has finished building).
TEARDOWN_WAIT_S = 10.0
#: How long to wait for a silent rank to write its Python stacks (on SIGUSR1) before it is killed.
STACK_DUMP_WAIT_S = 2.0
#: How often :func:`wait_for_the_other_ranks` looks for the others' "returned" marks.
RETURNED_POLL_S = 0.05


class WorldError(RuntimeError):
    """One or more ranks raised, died, or did not answer; the message holds each failing rank's traceback.

    Attributes:
        failures: ``{rank: remote traceback or cause of death}`` for every rank that failed.
        missing: ranks that had not answered when the pool was killed.
        stacks: ``{rank: Python stacks of all its threads}`` for the missing ranks, taken just before the kill.
    """

    def __init__(
        self, message: str, failures: dict[int, str], missing: list[int], stacks: dict[int, str]
    ):
        super().__init__(message)
        self.failures = failures
        self.missing = missing
        self.stacks = stacks


class WorldTimeoutError(WorldError):
    """Some ranks gave no answer within the task's ``timeout``; ``missing`` names them."""


# --------------------------------------------------------------------------------------------------
# Worker side. Everything below runs in the worker processes; torch is imported only here.
# --------------------------------------------------------------------------------------------------


def _stack_file(workdir: str, rank: int) -> str:
    """Where rank ``rank`` of the pool in ``workdir`` writes its Python stacks on SIGUSR1."""
    return os.path.join(workdir, f"stacks-rank{rank}.txt")


def _exit_when_orphaned(parent_pid: int) -> None:
    # A daemon process is only reaped by a parent that exits cleanly; if pytest is SIGKILLed the workers
    # would idle forever. This thread runs even while the main thread sits in a task. A forked worker's
    # parent is the fork server, which outlives pytest while any worker holds its pipe: hence both checks.
    first_parent = os.getppid()
    while True:
        time.sleep(1.0)
        if os.getppid() != first_parent:
            os._exit(3)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(3)
        except PermissionError:  # a process of another user took the number
            os._exit(3)


#: In a worker: its pool's folder, its rank and world size, and the number of the task it runs now.
_TASK: dict[str, Any] = {}


def _returned_mark(workdir: str, task: int, rank: int) -> str:
    """The file that says that ``rank`` returned from task number ``task`` of the pool in ``workdir``."""
    return os.path.join(workdir, f"task{task}-rank{rank}.returned")


def wait_for_the_other_ranks(
    ranks: list[int] | None = None, timeout: float = 60.0, poll: float = RETURNED_POLL_S
) -> bool:
    """In a task: block until it has returned (or raised) on each of ``ranks`` (default: every other rank).

    For a rank that stays alive but silent while its peers wait for it until their timeout: it returns
    once they gave up, however long that took. A rank that died never returns: leave it out of ``ranks``.
    Returns False if ``timeout`` seconds passed first (the caller goes on, as after a sleep).
    """
    if not _TASK:
        raise RuntimeError(
            "wait_for_the_other_ranks() is for a task of run_world or run_world_fresh"
        )
    if ranks is None:
        ranks = [r for r in range(_TASK["world_size"]) if r != _TASK["rank"]]
    marks = [_returned_mark(_TASK["workdir"], _TASK["task"], r) for r in ranks]
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(mark) for mark in marks):
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


def _reply(
    conn: Connection, kind: str, payload: Any, output: str = "", healthy: bool = True
) -> None:
    conn.send_bytes(pickle.dumps((kind, payload, output, healthy)))


class _ProcessState:
    """The per-process settings a task may change and the next task must not see."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()

    def restore(self) -> None:
        import torch

        if dict(os.environ) != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        try:
            if os.getcwd() != self.cwd:
                os.chdir(self.cwd)
        except OSError:  # the task removed its own working directory
            os.chdir(self.cwd)
        torch.set_default_dtype(torch.float32)
        if hasattr(torch, "set_default_device"):
            torch.set_default_device(None)
        torch.set_grad_enabled(True)
        if torch.is_anomaly_enabled():
            torch.autograd.set_detect_anomaly(False)
        if (
            torch.are_deterministic_algorithms_enabled()
        ):  # only when set: the call itself costs seconds
            torch.use_deterministic_algorithms(False)
        torch.set_num_threads(1)
        torch.manual_seed(0)
        random.seed(0)
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed(0)


class _GroupRecorder:
    """Records the process groups a task creates with ``dist.new_group``, to destroy them after it.

    Only public API: ``new_group`` is wrapped for the duration of the task.
    """

    def __init__(self) -> None:
        self.created: list[Any] = []

    def __enter__(self) -> _GroupRecorder:
        import torch.distributed as dist

        self._original = dist.new_group

        def new_group(*args: Any, **kwargs: Any) -> Any:
            group = self._original(*args, **kwargs)
            self.created.append(group)
            return group

        dist.new_group = new_group
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        dist.new_group = self._original


def _run_task(rank: int, world_size: int, message: bytes, state: _ProcessState) -> tuple:
    import torch.distributed as dist

    output = io.StringIO()
    recorder = _GroupRecorder()
    try:
        with redirect_stdout(output), redirect_stderr(output), warnings.catch_warnings(), recorder:
            state.restore()
            # fn's module may live in a directory the parent put on sys.path after this worker started.
            parent_path, _TASK["task"], killed, task = pickle.loads(message)
            sys.path.extend(p for p in parent_path if p not in sys.path)
            fn, args = pickle.loads(task)
            dist.barrier()
            try:
                result = fn(rank, world_size, *args)
            finally:
                open(_returned_mark(_TASK["workdir"], _TASK["task"], rank), "w").close()
        try:
            payload = pickle.dumps(result)
        except Exception as exc:
            raise TypeError(
                f"the result of {getattr(fn, '__qualname__', fn)!r} on rank {rank} cannot be "
                f"pickled ({exc}); return tensors (detached), numbers, or dicts/lists of them"
            ) from exc
        kind = "ok"
    except BaseException:  # SystemExit and KeyboardInterrupt in a task are reported too
        kind, payload = "error", traceback.format_exc()
    healthy = dist.is_initialized()
    if healthy and recorder.created and kind == "ok":
        # A rank that has built a gloo group may return while a peer is still connecting to it;
        # destroying it then closes the peer's socket mid-connect ("connection closed by peer").
        # (After a failure the pool is discarded: no wait that would delay the traceback.)
        others = [r for r in range(world_size) if r != rank and r not in killed]
        wait_for_the_other_ranks(others, timeout=TEARDOWN_WAIT_S, poll=0.002)
    if healthy:
        # Subgroups outlive the task otherwise: each holds gloo threads and sockets, ~100 tests add up.
        # Every rank destroys the same groups, and destroying a subgroup is local, so ranks stay in step.
        for group in reversed(recorder.created):
            if group is None or group is dist.GroupMember.NON_GROUP_MEMBER:
                continue  # this rank is not in it: nothing of it lives here
            try:
                dist.destroy_process_group(group)
            except Exception:
                healthy = False
    return kind, payload, output.getvalue()[-OUTPUT_TAIL_CHARS:], healthy


def _worker_main(
    rank: int,
    world_size: int,
    workdir: str,
    conn: Connection,
    parent_pid: int,
    environ: dict[str, str],
    outputs: tuple[int, int],
) -> None:
    """Entry point of one pool process: join the world group, then run tasks until told to stop."""
    # What a spawned worker inherits, not what the fork server had when it started.
    os.environ.clear()
    os.environ.update(environ)
    for target, fd in zip((1, 2), outputs):
        os.dup2(fd, target)  # where C++ (gloo) writes: the output of the test that started the pool
        os.close(fd)
    # On a timeout the parent sends SIGUSR1 and puts the file in the error: where each thread was stuck.
    # faulthandler writes from the signal handler itself, so this works while blocked inside gloo.
    faulthandler.register(
        signal.SIGUSR1, file=open(_stack_file(workdir, rank), "w"), all_threads=True
    )
    # Ctrl-C reaches the whole process group; only the parent should react, and it kills us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        OMP_NUM_THREADS="1",
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        init_file = os.path.join(workdir, "rendezvous")
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
        )
        state = _ProcessState()
        _TASK.update(workdir=workdir, rank=rank, world_size=world_size)
    except BaseException:
        _reply(conn, "error", traceback.format_exc(), healthy=False)
        os._exit(1)
    _reply(conn, "ready", os.getpid())
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # parent closed the pipe or died
            os._exit(0)
        if not message:  # stop request
            os._exit(0)
        kind, payload, output, healthy = _run_task(rank, world_size, message, state)
        try:
            _reply(conn, kind, payload, output, healthy)
        except (EOFError, OSError):
            os._exit(0)
        if not healthy:  # e.g. the task destroyed the world group: nothing more can run here
            os._exit(2)


# --------------------------------------------------------------------------------------------------
# Parent side.
# --------------------------------------------------------------------------------------------------


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


class _InheritedFd:
    """A file descriptor of this process that a worker gets a copy of when it starts (a spawned
    process inherits fds 0-2; one forked by the server would have the server's)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup: Any) -> int:
    return dup.detach()


def _context() -> multiprocessing.context.BaseContext:
    """The context of ``START_METHOD``; a fork server imports ``PRELOAD`` once, at the first pool."""
    ctx = multiprocessing.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


class _Pool:
    """``world_size`` worker processes sharing one gloo world group; runs one task at a time."""

    def __init__(self, world_size: int, startup_timeout: float = STARTUP_TIMEOUT_S):
        self.world_size = world_size
        self._tmpdir = tempfile.mkdtemp(prefix=f"decent_optim_world{world_size}_")
        ctx = _context()
        outputs = (_InheritedFd(1), _InheritedFd(2))
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._tasks = 0  # numbered, for the marks of wait_for_the_other_ranks
        try:
            for rank in range(world_size):
                here, there = ctx.Pipe(duplex=True)
                # daemon: multiprocessing kills them at interpreter exit even if nobody calls close().
                proc = ctx.Process(
                    target=_worker_main,
                    name=f"decent_optim-world{world_size}-rank{rank}",
                    args=(
                        rank,
                        world_size,
                        self._tmpdir,
                        there,
                        os.getpid(),
                        dict(os.environ),
                        outputs,
                    ),
                    daemon=True,
                )
                proc.start()
                there.close()  # so that a dead worker shows up as EOF on our end
                self._procs.append(proc)
                self._conns.append(here)
            label = f"starting a pool of {world_size} gloo ranks"
            replies, missing = self._collect(time.monotonic() + startup_timeout)
            self._raise_on_failure(label, replies, missing, startup_timeout)
            self.pids = [replies[rank][1] for rank in range(world_size)]
        except BaseException:
            self.close(graceful=False)
            raise

    def run(
        self, fn: Callable, task: bytes, timeout: float, killed: frozenset[int] = frozenset()
    ) -> tuple[list[Any], bool]:
        """Run ``task`` (``fn`` and its args, pickled) on every rank.

        Returns ``(results by rank, whether the pool can take more tasks)``; a rank of ``killed``
        that died of SIGKILL gives None.
        """
        self._tasks += 1
        message = pickle.dumps((list(sys.path), self._tasks, sorted(killed), task))
        deadline = time.monotonic() + timeout
        for conn in self._conns:
            try:
                conn.send_bytes(message)
            except OSError:  # the worker is gone; _collect reports how it died
                pass
        replies, missing = self._collect(deadline, killed)
        label = f"run_world({getattr(fn, '__qualname__', repr(fn))}, world_size={self.world_size})"
        self._raise_on_failure(label, replies, missing, timeout)
        for rank in range(self.world_size):
            output = replies[rank][2]
            if output:  # shows up in pytest's captured stdout of the current test
                sys.stdout.write("".join(f"[rank {rank}] {line}\n" for line in output.splitlines()))
        return (
            [pickle.loads(replies[rank][1]) for rank in range(self.world_size)],
            all(replies[rank][3] for rank in range(self.world_size)),
        )

    def _collect(
        self, deadline: float, killed: frozenset[int] = frozenset()
    ) -> tuple[dict[int, tuple], list[int]]:
        """Wait for one reply per rank until ``deadline``; returns ``(replies, ranks that never answered)``.

        Never blocks past the deadline, and a worker that died counts as answered (kind ``"died"``).
        After the first failure the others get ``ERROR_GRACE_S`` more, not the whole deadline.
        A rank of ``killed`` that died of SIGKILL answered None (the fault a test injected).
        """
        pending, replies = set(range(self.world_size)), {}
        grace_end = None
        while pending:
            left = (deadline if grace_end is None else min(deadline, grace_end)) - time.monotonic()
            if left <= 0:
                break
            owner = {}
            for rank in pending:
                owner[self._conns[rank]] = rank
                owner[self._procs[rank].sentinel] = rank
            for ready in wait(list(owner), timeout=left):
                rank = owner[ready]
                if rank not in pending:  # both its pipe and its sentinel were ready
                    continue
                reply = self._read(rank)
                if reply is None:
                    continue
                if reply[0] == "died" and rank in killed and reply[1] == -signal.SIGKILL:
                    reply = ("ok", pickle.dumps(None), "", False)
                replies[rank] = reply
                pending.discard(rank)
                if reply[0] not in ("ok", "ready") and grace_end is None:
                    grace_end = time.monotonic() + ERROR_GRACE_S
        return replies, sorted(pending)

    def _read(self, rank: int) -> tuple | None:
        conn, proc = self._conns[rank], self._procs[rank]
        try:
            if conn.poll():
                return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            pass
        if proc.exitcode is None:
            proc.join(timeout=1.0)  # its pipe hit EOF: it is exiting
            if proc.exitcode is None:
                return None
        return ("died", proc.exitcode, "", False)

    def _raise_on_failure(
        self, label: str, replies: dict[int, tuple], missing: list[int], timeout: float
    ):
        failures, raised, died = {}, [], []
        for rank, (kind, payload, output, _) in sorted(replies.items()):
            if kind == "error":
                text = payload.rstrip()
                raised.append(rank)
            elif kind == "died":
                text = f"worker process died (exit code {payload}) without answering"
                died.append(rank)
            else:
                continue
            if output:
                text += f"\n[captured stdout/stderr of rank {rank}, last {OUTPUT_TAIL_CHARS} chars]\n{output.rstrip()}"
            failures[rank] = text
        if not failures and not missing:
            return
        if failures:
            parts = ([f"{_ranks(died)} died"] if died else []) + (
                [f"{_ranks(raised)} raised"] if raised else []
            )
            if missing:
                parts.append(
                    f"no answer from {_ranks(missing)} within {ERROR_GRACE_S:g} s of the first failure "
                    f"(probably blocked on a failed rank): killed"
                )
            summary = "; ".join(parts)
        else:
            summary = (
                f"no answer within {timeout:g} s from {_ranks(missing)} (a hang, e.g. a recv without its "
                f"send); all ranks were killed"
            )
        body = "".join(f"\n\n----- rank {rank} -----\n{text}" for rank, text in failures.items())
        stacks = self._dump_stacks(missing)
        body += "".join(
            f"\n\n----- rank {rank}: no answer; its threads when it was killed -----\n{text.rstrip()}"
            for rank, text in stacks.items()
        )
        error = WorldTimeoutError if not failures else WorldError
        raise error(f"{label}: {summary}{body}", failures, missing, stacks)

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask the silent ``ranks`` for their Python stacks (SIGUSR1, see ``_worker_main``) and read them."""
        for rank in ranks:
            try:
                os.kill(self._procs[rank].pid, signal.SIGUSR1)
            except (OSError, TypeError):
                pass
        stacks, deadline = {}, time.monotonic() + STACK_DUMP_WAIT_S
        for rank in ranks:
            text, size = "", -1
            while time.monotonic() < deadline:
                try:
                    text = open(_stack_file(self._tmpdir, rank)).read()
                except OSError:
                    text = ""
                if text and len(text) == size:  # written and no longer growing
                    break
                size = len(text)
                time.sleep(0.05)
            stacks[rank] = text or "(no stack dump: the worker did not respond to SIGUSR1)"
        return stacks

    def close(self, graceful: bool = True) -> None:
        """Stop the workers: ask politely (when ``graceful``), then kill whatever is left after a second."""
        if graceful:
            for conn in self._conns:
                try:
                    conn.send_bytes(b"")
                except OSError:
                    pass
            deadline = time.monotonic() + 1.0
            alive = [p for p in self._procs if p.exitcode is None]
            while alive and time.monotonic() < deadline:
                wait([p.sentinel for p in alive], timeout=deadline - time.monotonic())
                alive = [p for p in alive if p.exitcode is None]
        for proc in self._procs:
            if proc.exitcode is None:
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        shutil.rmtree(self._tmpdir, ignore_errors=True)


def _pickle_task(fn: Callable, args: tuple) -> bytes:
    try:
        return pickle.dumps((fn, args))
    except Exception as exc:
        raise TypeError(
            f"run_world needs a module-level fn and picklable args (the workers import fn by name), "
            f"got fn={fn!r}: {exc}"
        ) from exc


def _check(fn: Callable, world_size: int, timeout: float) -> None:
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")


_POOLS: dict[int, _Pool] = {}


def run_world(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on every rank of the shared pool; return the results by rank.

    Args:
        fn: a module-level function (workers import it by name); runs with gloo's world group initialised.
        world_size: number of ranks; the pool for this size is created on first use and then reused.
        args: extra picklable arguments, identical on every rank.
        timeout: seconds for all ranks to answer, not counting the start of a new pool.

    Raises:
        WorldError: a rank raised or died; the message holds every failing rank's traceback.
        WorldTimeoutError: some rank gave no answer within ``timeout``.
        TypeError: ``fn`` or ``args`` cannot be pickled (the pool is left untouched).
    """
    _check(fn, world_size, timeout)
    task = _pickle_task(fn, args)  # before any pool exists: a bad fn is no reason to kill one
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = _Pool(world_size)
    try:
        results, healthy = pool.run(fn, task, timeout)
    except BaseException:
        # Failed, hung or interrupted: the ranks may be mid-collective, so the group cannot be trusted.
        _POOLS.pop(world_size, None)
        pool.close(graceful=False)
        raise
    if not healthy:
        _POOLS.pop(world_size, None)
        pool.close()
    return results


def run_world_fresh(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    killed: tuple[int, ...] = (),
) -> list[Any]:
    """As :func:`run_world`, but in ``world_size`` new processes that are killed afterwards.

    For tasks that kill a rank, leave the process group unusable, or need a process nothing ran in before.
    ``killed``: ranks that may die of SIGKILL (a fault the task injects): such a death is no failure,
    does not cut the others' time short, and gives None as that rank's result.
    """
    _check(fn, world_size, timeout)
    task = _pickle_task(fn, args)
    pool = _Pool(world_size)
    try:
        return pool.run(fn, task, timeout, frozenset(killed))[0]
    finally:
        pool.close(graceful=False)


def _alone_main(conn: Connection, message: bytes, parent_pid: int) -> None:
    """Entry point of a process of :func:`start_alone`: no process group, one task."""
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        parent_path, task = pickle.loads(message)
        sys.path.extend(p for p in parent_path if p not in sys.path)
        import torch

        torch.set_num_threads(1)
        fn, args = pickle.loads(task)
        reply = ("ok", pickle.dumps(fn(*args)))
    except BaseException:
        reply = ("error", traceback.format_exc())
    conn.send_bytes(pickle.dumps(reply))


class Alone:
    """One process of :func:`start_alone`; :meth:`result` waits for its answer."""

    def __init__(self, fn: Callable, args: tuple) -> None:
        self.label = f"start_alone({getattr(fn, '__qualname__', repr(fn))})"
        here, there = multiprocessing.get_context("spawn").Pipe(duplex=False)
        message = pickle.dumps((list(sys.path), _pickle_task(fn, args)))
        self._proc = multiprocessing.get_context("spawn").Process(
            target=_alone_main, args=(there, message, os.getpid()), daemon=True
        )
        self._proc.start()
        there.close()
        self._conn = here

    def result(self, timeout: float = 120.0) -> Any:
        """``fn(*args)``; raises WorldError (its traceback) or WorldTimeoutError (it is killed)."""
        try:
            if not self._conn.poll(timeout):
                raise WorldTimeoutError(
                    f"{self.label}: no answer within {timeout:g} s", {}, [0], {}
                )
            kind, payload = pickle.loads(self._conn.recv_bytes())
        except EOFError:
            code = self._proc.exitcode
            raise WorldError(
                f"{self.label}: died (exit code {code})", {0: "died"}, [], {}
            ) from None
        finally:
            self.close()
        if kind != "ok":
            raise WorldError(f"{self.label} raised:\n{payload}", {0: payload}, [], {})
        return pickle.loads(payload)

    def close(self) -> None:
        if self._proc.exitcode is None:
            self._proc.join(timeout=5.0)
        if self._proc.exitcode is None:
            self._proc.kill()
            self._proc.join(timeout=5.0)
        self._conn.close()


def start_alone(fn: Callable, *args: Any) -> Alone:
    """Start ``fn(*args)`` now in one new process outside any process group (e.g. a worker that
    joins a running world later); ``.result(timeout)`` waits for its picklable result."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    return Alone(fn, args)


def pool_pids(world_size: int) -> list[int] | None:
    """Process ids of the live pool for ``world_size`` (index = rank), or ``None`` if there is none."""
    pool = _POOLS.get(world_size)
    return None if pool is None else list(pool.pids)


def shutdown_pools() -> None:
    """Stop every pool; the next :func:`run_world` starts new ones. Called at session end and at exit."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close()


atexit.register(shutdown_pools)
