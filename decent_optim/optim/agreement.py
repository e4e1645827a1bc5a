"""What the ranks must agree on, and the one error that says where they do not.

Every rank describes its side of a collective step -- building an optimizer, loading a
checkpoint -- as an :class:`Account`: an error it hit on its own (or None), named settings, and
one line per item (per parameter). :func:`digest` reduces an account to a few integers, so one
all-gather of a fixed size compares every rank's account; only when the digests differ do the
ranks exchange the full accounts, and :func:`explain` then writes the same message on every
rank, naming the first thing that differs and the ranks on each side (:func:`agree` does all
of it). The collectives themselves live in :mod:`decent_optim.gossip.collectives`.

The digests hash descriptions (shapes, strides, names), never values, so the cost grows with the
number of parameters, not with their size.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from decent_optim.gossip import gather_ints, gather_objects

__all__ = ["Account", "AgreementError", "agree", "digest", "explain", "raise_if_failed"]

#: the number of integers :func:`digest` returns
DIGEST_SIZE = 4


class AgreementError(ValueError):
    """The ranks disagree on something they must share (a message from :func:`explain`)."""


@dataclass
class Account:
    """One rank's side of a collective step.

    Attributes:
        error: ``(exception type name, message)`` of a failure of this rank alone, or None.
        settings: ``(name, value)`` pairs every rank must have equal, in the order checked.
        items: per item (parameter), ``(its name or None, its description)``; compared position
            by position after the settings.
    """

    error: tuple[str, str] | None = None
    settings: list[tuple[str, str]] = field(default_factory=list)
    items: list[tuple[str | None, str]] = field(default_factory=list)


def _hash(text: str) -> int:
    return int.from_bytes(
        hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True
    )


def digest(account: Account) -> list[int]:
    """:data:`DIGEST_SIZE` integers that differ between two accounts that differ (but for hash
    collisions, 2**-64)."""
    return [
        _hash(repr(account.error)),
        _hash(repr(account.settings)),
        len(account.items),
        _hash("\n".join(f"{name!r} {desc}" for name, desc in account.items)),
    ]


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _sides(values: dict[int, str]) -> str:
    """``"ranks 0, 2: a; rank 1: b"``: the ranks grouped by value, in order of first appearance."""
    by_value: dict[str, list[int]] = {}
    for rank, value in values.items():
        by_value.setdefault(value, []).append(rank)
    return "; ".join(f"{_ranks(r)}: {v}" for v, r in by_value.items())


def explain(
    accounts: list[Account],
    what: str,
    *,
    hints: dict[str, str] | None = None,
    item: str = "parameter",
    item_hint: str = "",
) -> str | None:
    """The message for ``accounts`` (index = rank), or None when they agree.

    Args:
        accounts: every rank's account.
        what: the collective step, for the message (``"building DSGD"``).
        hints: per setting name, what to do when it differs.
        item: what an item is called.
        item_hint: what to do when items differ.
    """
    failed = [r for r, a in enumerate(accounts) if a.error is not None]
    if failed:
        errors = [f"{a.error[0]}: {a.error[1]}" if a.error else "no error" for a in accounts]
        if len(failed) == len(accounts) and len(set(errors)) == 1:
            return errors[0]
        detail = errors[failed[0]] if len(failed) == 1 else _sides({r: errors[r] for r in failed})
        return (
            f"{what} failed on {_ranks(failed)} (every rank must succeed, the others would wait "
            f"for it): {detail}"
        )
    for k, (name, _) in enumerate(accounts[0].settings):
        values = {
            r: a.settings[k][1] if k < len(a.settings) else "(none)" for r, a in enumerate(accounts)
        }
        if len(set(values.values())) > 1:
            hint = (hints or {}).get(name, "")
            return f"{what}: the ranks disagree on {name}: {_sides(values)}" + (
                f". {hint}" if hint else ""
            )
    counts = [len(a.items) for a in accounts]
    for k in range(max(counts, default=0)):
        entries = [a.items[k] if k < len(a.items) else None for a in accounts]
        shown = {
            r: f"none (it has {counts[r]} {item}s)" if e is None else _item(e)
            for r, e in enumerate(entries)
        }
        if len(set(shown.values())) > 1:
            return (
                f"{what}: the ranks disagree on {item} {k} (counting from 0 in param_groups "
                f"order; {item}s in all: {_sides(dict(enumerate(map(str, counts))))}): "
                f"{_sides(shown)}" + (f". {item_hint}" if item_hint else "")
            )
    return None


def _item(entry: tuple[str | None, str]) -> str:
    name, desc = entry
    return desc if name is None else f"{name!r}, {desc}"


_TYPES: dict[str, type[Exception]] = {"ValueError": ValueError, "TypeError": TypeError}


def raise_if_failed(
    message: str | None, own: BaseException | None, accounts: list[Account]
) -> None:
    """Raise ``message`` (from :func:`explain`) on this rank; nothing when it is None.

    When every rank failed with the same error, this rank's own exception is raised unchanged.
    A failure of some ranks is raised with the type of the first failing rank's error
    (ValueError, TypeError, else RuntimeError); a disagreement as :class:`AgreementError`.
    """
    if message is None:
        return
    failed = [a.error for a in accounts if a.error is not None]
    if not failed:
        raise AgreementError(message)
    if own is not None and len(failed) == len(accounts) and len({repr(e) for e in failed}) == 1:
        raise own
    kind = _TYPES.get(failed[0][0], RuntimeError)
    raise kind(message) from own


def agree(
    account: Account,
    group: Any,
    device: torch.device | None,
    what: str,
    *,
    own: BaseException | None = None,
    extra: Sequence[int] = (),
    timeout: datetime.timedelta | None = None,
    wait_hint: str | None = None,
    **explain_kw: Any,
) -> list[list[int]]:
    """Compare ``account`` across the ranks of ``group``; raise the same error on every rank.

    One all-gather of the digest (plus ``extra`` integers, returned by rank for the caller); a
    second, of the accounts, only when the digests differ. ``group`` None is a world of one.
    ``own`` is this rank's exception behind ``account.error``; ``explain_kw`` go to
    :func:`explain`. The all-gather waits at most ``timeout`` (a ``GossipError`` naming ``what``,
    with ``wait_hint`` in place of the start-up one when given).
    """
    mine = digest(account) + list(extra)
    if group is None:
        rows = [mine]
    else:
        hint = {} if wait_hint is None else {"hint": wait_hint}
        rows = gather_ints(mine, group, device, timeout, what, **hint)  # type: ignore[arg-type]
    if all(row[:DIGEST_SIZE] == rows[0][:DIGEST_SIZE] for row in rows):
        if own is not None:  # every rank failed alike
            raise own
        return rows
    accounts = gather_objects(account, group, timeout, what, wait_hint)
    raise_if_failed(explain(accounts, what, **explain_kw), own, accounts)
    return rows  # not reached: differing digests come from differing accounts
