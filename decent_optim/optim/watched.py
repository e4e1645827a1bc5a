"""Dicts that report writes: what ``opt.state`` is made of, so that no write goes unnoticed.

:class:`~decent_optim.optim.state.FlatState` keeps the state in flat buffers; these dicts tell
it when something was written through ``opt.state`` (a tensor replaced by hand, an entry
replaced, torch's ``load_state_dict``), so that it copies the new values in before the next
update instead of silently stepping the old ones. Both pickle as plain dicts, so checkpoints
keep torch.optim's format.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["ParamState", "StateDict"]


class ParamState(dict):  # type: ignore[type-arg]
    """``opt.state[p]``: a dict that reports every write (pickled as a plain dict)."""

    __slots__ = ("_notify",)

    def __init__(self, notify: Callable[[], None], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._notify = notify

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        self._notify()

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key)
        self._notify()

    def update(self, *args: Any, **kwargs: Any) -> None:
        super().update(*args, **kwargs)
        self._notify()

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self._notify()
        return super().setdefault(key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        self._notify()
        return super().pop(key, *default)

    def popitem(self) -> tuple[Any, Any]:
        self._notify()
        return super().popitem()

    def clear(self) -> None:
        super().clear()
        self._notify()

    def __ior__(self, other: Any) -> ParamState:  # type: ignore[override,misc]
        self.update(other)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (dict(self),))


class StateDict(defaultdict):  # type: ignore[type-arg]
    """``opt.state``: its entries are :class:`ParamState`; replacing or deleting one is reported."""

    def __init__(self, notify: Callable[[], None], entries: Iterable[tuple[Any, Any]] = ()) -> None:
        super().__init__(self._entry)
        self._notify = notify
        for key, value in entries:
            dict.__setitem__(self, key, ParamState(notify, value))

    def _entry(self) -> ParamState:
        return ParamState(self._notify)

    def __setitem__(self, key: Any, value: Any) -> None:
        if not isinstance(value, ParamState):
            value = ParamState(self._notify, value)
        super().__setitem__(key, value)
        self._notify()

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key)
        self._notify()

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            defaultdict,
            (dict,),
            None,
            None,
            iter({k: dict(v) for k, v in self.items()}.items()),
        )
