"""Start-up of a decentralized optimizer: the workers, the topology, the buckets, equal start values.

A collective: every rank builds its optimizer at the same point of the program. In order:

1. find the process group and its size, and build the topology for it; refuse a torchrun
   set-up whose restarts would fail (:mod:`decent_optim.gossip.elastic`);
2. check that no two parameters share memory, and that the ranks agree
   (:func:`~decent_optim.optim.agreement.agree`: one all-gather of a fixed-size digest) on
   everything they must share -- the optimizer class and number (its place in the order this
   process built optimizers on the group), the topology (its rounds' weights),
   ``local_world_size``, ``global_avg_every``, ``bucket_cap_mb``, and, in order, every
   parameter's name (when given), shape, strides, dtype, ``requires_grad`` and param group,
   which fix the buckets -- and that none of them failed on its own, before anything changes.
   A difference raises the same error on every rank, naming the first setting or parameter
   that differs and the ranks on each side;
3. pack the trainable parameters into buckets (:class:`~decent_optim.flat.FlatParams`);
4. broadcast rank 0's values, so that every rank starts from the same :math:`x^{(0)}`.

Optimizers sharing a process group get a *slot* each (the lowest free on every rank, agreed in
step 2): slot 0 exchanges over the group, later ones over a group of their own and with their
own message tags (:func:`~decent_optim.gossip.collectives.channel`), so two optimizers never
exchange each other's buffers. A parameter belongs to one optimizer
(:mod:`decent_optim.optim.param_owner`).

Step 4 overwrites a rank's own values. When they differed from rank 0's -- a resume that loaded
each rank's weights into the model before building the optimizer -- they are kept aside
(:class:`Stash`) until ``load_state_dict`` puts them back, if the checkpoint was saved with
exactly those weights; otherwise, or at the first step, they are dropped, and every rank starts
from rank 0's values, as with DDP.
"""

from __future__ import annotations

import datetime
import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from decent_optim import sharded, topologies
from decent_optim._validation import resolve_local_world_size
from decent_optim.flat import FlatParams
from decent_optim.flat_checks import check_disjoint, check_flattenable
from decent_optim.gossip import (
    Gossiper,
    LocalGossiper,
    broadcast_,
    channel,
    check_devices,
    check_restarts,
    comm_device,
    group_ranks,
    resolve_group,
)
from decent_optim.optim.agreement import Account, agree
from decent_optim.optim.param_owner import ParamOwner
from decent_optim.topologies import Topology

if TYPE_CHECKING:
    from decent_optim.gossip.codec_base import Codec

__all__ = [
    "Connected",
    "Stash",
    "connect",
    "describe",
    "fingerprint",
    "topology_key",
]

_HINTS = {
    "optimizer": "Build the same optimizer class at the same point of the program on every rank",
    "optimizer number": "Build the same decentralized optimizers, in the same order, on every "
    "rank (counted per process group)",
    "topology": "Pass the same topology on every rank",
    "local_world_size": "Every node must run the same number of workers (LOCAL_WORLD_SIZE, set "
    "by torchrun); or pass the same local_world_size= on every rank",
    "global_avg_every": "Pass the same global_avg_every on every rank",
    "bucket_cap_mb": "Pass the same bucket_cap_mb on every rank: the buckets are the messages",
    "compression": "Pass the same compression= on every rank: peers decode what they receive",
    "param groups": "Pass the same param groups on every rank",
    "local_steps": "Pass the same local_steps= and outer= on every rank: the rounds must match",
}
_ITEM_HINT = (
    "Every rank must build the same model and give the optimizer its parameters in the same "
    "order, with the same requires_grad, param groups and memory format (channels_last on every "
    "rank or on none). Iterating a Python set of names gives another order in every process: "
    "sort them. Passing model.named_parameters() puts the names in this message"
)


def fingerprint(buffers: list[Tensor]) -> list[tuple[float, float]]:
    """Cheap summary of the values (sum and 2-norm in float64), to recognise them."""
    return [
        (float(b.sum(dtype=torch.float64)), float(torch.linalg.vector_norm(b, dtype=torch.float64)))
        for b in buffers
    ]


def _same(a: list[tuple[float, float]], b: list[Any]) -> bool:
    """Whether two fingerprints describe the same values, up to the order of summation (a
    checkpoint saved on another device)."""
    return len(a) == len(b) and all(
        math.isclose(x, float(y), rel_tol=1e-6, abs_tol=1e-6 * norm)
        for (total, norm), saved in zip(a, b)
        for x, y in zip((total, norm), saved)
    )


class Stash:
    """This rank's own start values, which the start-up broadcast overwrote."""

    def __init__(self, own: list[Tensor], broadcast: list[Tensor]) -> None:
        self._own = own
        self._print = fingerprint(broadcast)

    def restore(self, buffers: list[Tensor], saved: list[Any] | None) -> None:
        """Put the rank's values back if the buffers still hold the broadcast values and the
        checkpoint was saved with the rank's values (``saved``: their fingerprint)."""
        if saved is None or not _same(fingerprint(self._own), saved):
            return  # an optimizer-only load: the weights are not the checkpoint's, keep rank 0's
        if fingerprint(buffers) == self._print:
            with torch.no_grad():
                for buf, own in zip(buffers, self._own):
                    buf.copy_(own)


def topology_key(topo: Topology) -> str:
    """The topology's name, period and a hash of its rounds' weights, as one string."""
    rounds = []
    for r in range(topo.period):
        groups = topo.groups(r)
        rows = (
            groups if groups is not None else [topo.weights(i, r) for i in range(topo.world_size)]
        )
        rounds.append(repr(rows))
    weights = hashlib.blake2b("\n".join(rounds).encode(), digest_size=6).hexdigest()
    return f"{topo!r} (period {topo.period}, weights {weights})"


@dataclass
class Connected:
    """What start-up hands the engine."""

    gossip: Gossiper | LocalGossiper
    topology: Topology
    flat: FlatParams
    frozen: list[Tensor]
    stash: Stash | None
    member: ParamOwner
    #: where load_state_dict's cross-check runs: the group (None: one rank) and its device
    group: Any
    device: torch.device | None
    #: a newcomer of live membership (optim.joining): the round at which gossip resumes
    resume: int | None = None


def connect(
    groups: list[list[Tensor]],
    names: list[list[str] | None],
    *,
    name: str,
    failure: Exception | None,
    topology: str | Topology,
    process_group: Any,
    bucket_cap_mb: float,
    local_world_size: int | None,
    timeout: datetime.timedelta | None,
    global_avg_every: int | None,
    compression: str | Codec | None = None,
    local_steps: str = "1, outer None",
    deferred: bool = False,
) -> Connected:
    """Steps 1-4 of the module docstring for the parameters of each param group in ``groups``.

    ``failure`` is an error the caller hit before (its arguments), reported to every rank.
    ``deferred=True`` is for ranks that must not wait for one another at a round's launch
    (``uneven=True``): groups that span nodes still average by node, one copy per direction
    on the slow link, but their rounds are the Gossiper's ``deferred`` ones.
    """
    try:
        group, world_size = resolve_group(sharded.gossip_group(process_group))
    except Exception:
        if failure is not None:
            raise failure from None
        raise
    every = [p for params in groups for p in params]
    account, topo, number = Account(), None, ParamOwner.number(group)
    try:
        if failure is not None:
            raise failure
        for p in every:
            check_flattenable(p)
        if group is not None:
            check_devices(group, every)
            check_restarts()  # torchrun's restarts would fail or hang: say so now, on every rank
        ranks, me = group_ranks(group) if group is not None else (None, 0)
        sharded.check_params(every, ranks, me)
        if local_world_size is None and ranks and any(map(sharded.is_sharded, every)):
            # replicas per node: torchrun's LOCAL_WORLD_SIZE counts ranks, shards included
            local_world_size = sharded.replicas_per_node(ranks, me)
        topo = topologies.get(topology, world_size, resolve_local_world_size(local_world_size))
        account = describe(groups, names, name, topo, global_avg_every, bucket_cap_mb, compression)
        account.settings.insert(-1, ("local_steps", local_steps))
        account.settings.insert(1, ("optimizer number", str(number)))
        check_disjoint(every, [label for label, _ in account.items])
        own = None
    except Exception as err:
        account.error, own = (type(err).__name__, str(err)), err
    device = comm_device(group) if group is not None else None
    rows = agree(
        account,
        group,
        device,
        f"building {name}",
        own=own,
        extra=[ParamOwner.slots_taken(group)],
        hints=_HINTS,
        item_hint=_ITEM_HINT,
        timeout=timeout,
    )
    assert topo is not None  # agree() raised otherwise
    taken = 0
    for row in rows:
        taken |= row[-1]
    member = ParamOwner(name, group, slot=(~taken & (taken + 1)).bit_length() - 1)
    member.claim(every, [label for label, _ in account.items])
    frozen = [p for p in every if not p.requires_grad]
    flat = FlatParams([[p for p in params if p.requires_grad] for params in groups], bucket_cap_mb)
    if world_size == 1:
        return Connected(LocalGossiper(topo), topo, flat, frozen, None, member, None, None)
    own_values = [b.clone() for b in flat.buffers]
    broadcast_(flat.buffers, group, timeout)
    flat.publish()
    broadcast_([p.detach() for p in frozen], group, timeout)
    differs = any(not torch.equal(a, b) for a, b in zip(own_values, flat.buffers))
    stash = Stash(own_values, flat.buffers) if differs else None
    gossip = Gossiper(
        topo,
        channel(group, member.slot),
        timeout=timeout,
        slot=member.slot,
        compression=compression,
        deferred=deferred,
    )
    gossip.prime(flat.buffers)  # the broadcast values: sparse codecs need no exact first round
    return Connected(gossip, topo, flat, frozen, stash, member, group, device)


def describe(
    groups: list[list[Tensor]],
    names: list[list[str] | None],
    name: str,
    topo: Topology,
    global_avg_every: int | None,
    bucket_cap_mb: float,
    compression: str | Codec | None = None,
) -> Account:
    """What this rank builds, as the ranks compare it (step 2 of the module docstring)."""
    settings = [
        ("optimizer", name),
        ("local_world_size", str(topo.local_world_size)),  # before the topology it shapes
        ("topology", topology_key(topo)),
        ("global_avg_every", repr(global_avg_every)),
        ("bucket_cap_mb", repr(float(bucket_cap_mb))),
        ("compression", repr(compression)),
        ("param groups", str(len(groups))),
    ]
    items = [
        (label, _describe(p, gi))
        for gi, (params, labels) in enumerate(zip(groups, names))
        for p, label in zip(params, labels or _unnamed(params))
    ]
    return Account(None, settings, items)


def _unnamed(params: list[Tensor]) -> list[str | None]:
    return [None] * len(params)


def _describe(p: Tensor, group_index: int) -> str:
    dtype = str(p.dtype).removeprefix("torch.")
    return (
        f"shape {tuple(p.shape)}, strides {p.stride()}, {dtype} on {p.device.type}, "
        f"requires_grad={p.requires_grad}, param group {group_index}{sharded.describe(p)}"
    )
