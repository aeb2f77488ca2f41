"""Callbacks of the Python API: ``train(config, callbacks=[...])`` runs user code after every update and checkpoint.

What SB3 users bring their evaluation and early-stopping logic in (SB3's ``BaseCallback._on_step`` returning
False stops ``learn``); here the hooks are per update, where PPO's diagnostics exist:

* ``on_update(info: UpdateInfo) -> bool | None``: after each update's metrics are logged (``info.metrics``, the
  ``metrics.csv`` row) and before its checkpoint decision. Returning ``False`` (exactly False; ``None`` and any
  other value continue) stops the run after this update: a checkpoint of it is written, the run ends as a
  finished run does (plots, summary, exit status 0), the ``Run`` says ``stopped_by_callback`` and
  ``alerts.jsonl`` records an ``info`` entry ``stopped_by_callback`` naming the callback;
* ``on_checkpoint(path: Path)``: after each checkpoint write (the file is complete; a copy made here is a
  consistent snapshot).

A callback is any object with either method, or a plain function, which is taken as ``on_update``. Callbacks run
in list order; all of them see every update, even after one asked to stop. An exception raised by a callback ends
the run as any crash does (the last checkpoint stands).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

__all__ = ["Callback", "UpdateInfo", "CallbackList", "callback_name"]


@dataclass
class UpdateInfo:
    """What ``on_update`` sees: the update just finished and the trainer that ran it."""

    update: int  # updates done so far (1 after the first)
    global_step: int  # env steps so far
    metrics: dict[str, float]  # this update's row of metrics.csv (schema names, e.g. charts/episodic_return)
    run_dir: Path
    trainer: Any  # the ppokit.training.trainer.Trainer (policy, optimizer, normalizers, config); read it, do not replace it


class Callback(Protocol):
    """Either method may be left out."""

    def on_update(self, info: UpdateInfo) -> bool | None: ...

    def on_checkpoint(self, path: Path) -> None: ...


def callback_name(cb: Any) -> str:
    """A readable name: a function's qualified name, else the object's class name."""
    return getattr(cb, "__qualname__", None) or type(cb).__name__


class CallbackList:
    """The run's callbacks, checked once when the run is built: each must have ``on_update`` or
    ``on_checkpoint``, or be callable."""

    def __init__(self, callbacks: Iterable[Any] | None):
        if callbacks is not None and (isinstance(callbacks, (str, bytes)) or not hasattr(callbacks, "__iter__")):
            callbacks = [callbacks]  # a single callback passed without a list
        self.items = list(callbacks or [])
        self._updates: list[tuple[str, Callable]] = []
        self._checkpoints: list[Callable] = []
        for i, cb in enumerate(self.items):
            on_update, on_checkpoint = getattr(cb, "on_update", None), getattr(cb, "on_checkpoint", None)
            if on_update is None and on_checkpoint is None:
                if not callable(cb):
                    raise TypeError(f"callbacks[{i}] ({type(cb).__name__}) has neither on_update nor on_checkpoint "
                                    "and is not callable")
                on_update = cb
            if on_update is not None:
                self._updates.append((callback_name(cb), on_update))
            if on_checkpoint is not None:
                self._checkpoints.append(on_checkpoint)

    def __bool__(self) -> bool:
        return bool(self.items)

    def on_update(self, info: UpdateInfo) -> str | None:
        """Run every ``on_update``; the name of the first callback that returned False, else None."""
        stop = None
        for name, fn in self._updates:
            if fn(info) is False and stop is None:
                stop = name
        return stop

    def on_checkpoint(self, path: Path) -> None:
        for fn in self._checkpoints:
            fn(path)
