"""Declared-fields batches: a set of tensors whose names, per-step shapes and dtypes are declared once.

A ``Field`` says what one tensor of a batch is: its name, its trailing shape and dtype per step (either fixed, or
a function of the run's ``dims``: the observation layout, the action shape, the number of mask columns, the
recurrent state's shape), and whether it is optional (absent, ``None``, in a run that has no use for it). A
``Schema`` is an ordered, extensible set of fields; a ``TensorBatch`` subclass names its schema and holds one
tensor per present field as a plain attribute (``buffer.logp``, ``batch.logp_old``: no lookup beyond Python's own
on the hot paths), with a dict-like view beside it (``keys``, ``items``, ``batch["obs"]``).

A field's value is a tensor or a tree of them: a dict (a Dict/Tuple observation, one tensor per key) or a tuple (a
recurrent state such as an LSTM's ``(h, c)``). Every leaf of a per-step field carries the batch's leading axes
(``[T, N]`` for a rollout, ``[B]`` for a flat batch, ``[L, M]`` for a sequence minibatch) before its declared
shape; a per-row field (``per_step=False``, e.g. the state at each chunk's first step) carries only the row axis.

The row operations are generic: ``index(idx)`` (rows along the batch's ``row_dim``), ``flatten_steps`` (``[T, N,
...] -> [B, ...]`` of the selected steps) and ``chunk_steps`` / ``chunk_starts`` (each env's ``T`` steps cut into
contiguous chunks of ``L``, the last one padded with zeros).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar, Iterator, Mapping

import torch
from torch import Tensor

__all__ = ["Field", "Schema", "TensorBatch", "tree_map", "tree_leaves", "tree_copy_", "allocate", "flatten_steps",
           "chunk_steps", "chunk_starts", "unchunk_steps", "num_chunks"]

# A layout is a leaf ``(shape, dtype)`` (the per-step trailing shape) or a dict / tuple of layouts.
Layout = Any


def tree_map(fn: Callable[[Tensor], Any], x: Any) -> Any:
    """``fn`` applied to every tensor of ``x`` (a tensor, or a dict / tuple / list of them), structure kept."""
    if isinstance(x, Tensor):
        return fn(x)
    if isinstance(x, dict):
        return {k: tree_map(fn, v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(tree_map(fn, v) for v in x)
    raise TypeError(f"a batch field holds tensors, or dicts / tuples of them; got {type(x).__name__}")


def tree_leaves(x: Any) -> list[Tensor]:
    """The tensors of ``x`` in order (dict values in key order)."""
    if isinstance(x, Tensor):
        return [x]
    parts = x.values() if isinstance(x, dict) else x
    return [leaf for part in parts for leaf in tree_leaves(part)]


def tree_copy_(dest: Any, src: Any) -> None:
    """Copy every tensor of ``src`` into the same place of ``dest`` (same structure), in place."""
    for d, s in zip(tree_leaves(dest), tree_leaves(src), strict=True):
        d.copy_(s)


def _is_leaf(layout: Layout) -> bool:
    return isinstance(layout, tuple) and len(layout) == 2 and isinstance(layout[1], torch.dtype)


def allocate(layout: Layout, lead: tuple[int, ...], device: torch.device | str) -> Any:
    """Zeroed storage ``[*lead, *shape]`` for every leaf ``(shape, dtype)`` of ``layout``."""
    if _is_leaf(layout):
        shape, dtype = layout
        return torch.zeros((*lead, *shape), dtype=dtype, device=device)
    if isinstance(layout, dict):
        return {k: allocate(v, lead, device) for k, v in layout.items()}
    if isinstance(layout, (tuple, list)):
        return tuple(allocate(v, lead, device) for v in layout)
    raise TypeError(f"a layout is (shape, dtype) or a dict / tuple of layouts; got {layout!r}")


@dataclass(frozen=True)
class Field:
    """One declared tensor (or tree of tensors) of a batch.

    ``shape``: the per-step trailing shape, or ``dims -> shape`` for one that depends on the run; it may also
    return a whole layout (``(shape, dtype)`` leaves in a dict / tuple) when ``dtype`` is None, and None for an
    optional field the run does not have. ``dtype``: a dtype, ``dims -> dtype``, or None (the layout says).
    ``batch``: the name the field takes in the update's minibatches (None: kept in the rollout only).
    ``per_step``: False for a field with one entry per row and no time axis (a chunk's initial state).
    """

    name: str
    shape: Any = ()
    dtype: Any = torch.float32
    optional: bool = False
    batch: str | None = None
    per_step: bool = True
    doc: str = ""

    def layout(self, dims: Mapping[str, Any]) -> Layout | None:
        """This field's layout in a run of ``dims``; None when it is optional and the run has none."""
        shape = self.shape(dims) if callable(self.shape) else self.shape
        if shape is None:
            if not self.optional:
                raise ValueError(f"batch field {self.name!r} is required, but the run gives it no shape")
            return None
        if self.dtype is None:
            return shape
        dtype = self.dtype(dims) if callable(self.dtype) else self.dtype
        return tuple(shape), dtype

    def renamed(self, name: str) -> "Field":
        """The same declaration under another name (the name a rollout field takes in a minibatch)."""
        return replace(self, name=name, batch=None)


class Schema:
    """An ordered set of declared fields; ``base``'s fields come first (and its later declarations are seen).

    ``declare`` adds one for good (a module that writes a new field declares it at import); ``declared`` adds some
    for the duration of a ``with`` block (tests).
    """

    def __init__(self, *fields: Field, base: "Schema | None" = None):
        self.base = base
        self._own: dict[str, Field] = {}
        for field in fields:
            self.declare(field)

    def fields(self) -> list[Field]:
        return [*(self.base.fields() if self.base is not None else ()), *self._own.values()]

    def names(self) -> list[str]:
        return [f.name for f in self.fields()]

    def __contains__(self, name: object) -> bool:
        return name in self._own or (self.base is not None and name in self.base)

    def __getitem__(self, name: str) -> Field:
        if name in self._own:
            return self._own[name]
        if self.base is not None:
            return self.base[name]
        raise KeyError(name)

    def declare(self, field: Field) -> Field:
        """Add ``field``; a name already declared (here or in the base) is refused."""
        if not isinstance(field, Field) or not field.name.isidentifier():
            raise ValueError(f"a batch field needs an identifier name, got {field!r}")
        if field.name in self:
            raise ValueError(f"batch field {field.name!r} is already declared")
        self._own[field.name] = field
        return field

    def undeclare(self, name: str) -> None:
        del self._own[name]

    @contextmanager
    def declared(self, *fields: Field) -> Iterator[None]:
        """``fields`` declared inside the block only."""
        done = []
        try:
            for field in fields:
                done.append(self.declare(field).name)
            yield
        finally:
            for name in done:
                self.undeclare(name)

    def allocate(self, lead: tuple[int, ...], dims: Mapping[str, Any], device: torch.device | str) -> dict[str, Any]:
        """Zeroed storage of every field for a run of ``dims``: ``[*lead, ...]`` per step (only ``lead[1:]``, the
        rows, for a per-row field); None for an absent optional field."""
        out = {}
        for field in self.fields():
            layout = field.layout(dims)
            out[field.name] = None if layout is None else allocate(layout, lead if field.per_step else lead[1:],
                                                                   device)
        return out


class TensorBatch:
    """A set of tensors with declared names (``schema``), each an attribute; absent optional fields are None.

    Built like a dataclass (positional arguments in the schema's order, or keywords). ``row_dim`` is the axis of
    the rows ``index`` selects and ``len`` counts (per-step fields; per-row fields always on axis 0).
    """

    schema: ClassVar[Schema]
    row_dim: ClassVar[int] = 0

    def __init__(self, *args: Any, **kwargs: Any):
        fields = self.schema.fields()
        if len(args) > len(fields):
            raise TypeError(f"{type(self).__name__} takes {len(fields)} fields, got {len(args)} positional values")
        values = {f.name: v for f, v in zip(fields, args)}
        for name, value in kwargs.items():
            if name in values:
                raise TypeError(f"{type(self).__name__}: field {name!r} given twice")
            values[name] = value
        for name in values:
            if name not in self.schema:
                raise TypeError(f"{type(self).__name__}: no declared field {name!r} (declared: "
                                f"{', '.join(self.schema.names())})")
        for field in fields:
            if values.get(field.name) is None and not field.optional:
                raise TypeError(f"{type(self).__name__}: required field {field.name!r} is missing")
        for name, value in values.items():
            setattr(self, name, value)
        for field in fields:
            if field.name not in values:
                object.__setattr__(self, field.name, None)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self.schema and not name.startswith("_"):
            raise AttributeError(f"{type(self).__name__} has no declared field {name!r} (declared: "
                                 f"{', '.join(self.schema.names())})")
        object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ the dict view
    def keys(self) -> list[str]:
        """The present fields' names, in the schema's order."""
        return [name for name in self.schema.names() if self.__dict__.get(name) is not None]

    def items(self) -> list[tuple[str, Any]]:
        return [(name, self.__dict__[name]) for name in self.keys()]

    def __getitem__(self, name: str) -> Any:
        if name not in self.schema:
            raise KeyError(name)
        return self.__dict__[name]

    def __contains__(self, name: object) -> bool:
        return name in self.schema and self.__dict__.get(name) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        for field in self.schema.fields():
            value = self.__dict__.get(field.name)
            if value is not None and field.per_step:
                return tree_leaves(value)[0].shape[self.row_dim]
        return 0

    def __repr__(self) -> str:
        shapes = {k: tree_map(lambda t: tuple(t.shape), v) for k, v in self.items()}
        return f"{type(self).__name__}({shapes})"

    # ------------------------------------------------------------------ row operations
    def map(self, fn: Callable[[Tensor], Tensor], per_row: Callable[[Tensor], Tensor] | None = None) -> Any:
        """A batch of the same type with ``fn`` applied to every tensor of the per-step fields (``per_row``, by
        default ``fn``, to those of the per-row fields)."""
        rows = {f.name for f in self.schema.fields() if not f.per_step} if per_row is not None else ()
        # Built without __init__'s checks: the fields are this batch's, already checked (index runs once per
        # minibatch; the checks cost as much as the indexing of a small batch).
        out = object.__new__(type(self))
        fields = out.__dict__
        for name, value in self.__dict__.items():
            if not name.startswith("_"):
                fields[name] = None if value is None else tree_map(per_row if name in rows else fn, value)
        return out

    def replace(self, **fields: Any) -> Any:
        """A batch of the same type with ``fields`` replaced (declared names only) and the others shared."""
        out = self.map(lambda t: t)
        for name, value in fields.items():
            setattr(out, name, value)  # __setattr__ refuses an undeclared name
        return out

    def index(self, idx: Tensor) -> Any:
        """The rows ``idx`` (along ``row_dim``) of every field, every part of a tree."""
        if self.row_dim == 0:
            return self.map(lambda t: t[idx])
        dim = self.row_dim
        return self.map(lambda t: t.index_select(dim, idx), per_row=lambda t: t[idx])

    def to(self, device: torch.device | str) -> Any:
        return self.map(lambda t: t.to(device, non_blocking=True))


def flatten_steps(x: Any, keep: Tensor | None = None) -> Any:
    """``[T, N, ...] -> [T*N, ...]`` (time-major: row ``t*N + n``), then only the rows ``keep`` (indices) if
    given; every tensor of a tree."""
    def flat(t: Tensor) -> Tensor:
        t = t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])
        return t if keep is None else t[keep]
    return tree_map(flat, x)


def num_chunks(num_steps: int, seq_len: int) -> int:
    """How many chunks of ``seq_len`` steps cover ``num_steps`` (the last one may be shorter)."""
    return -(-num_steps // seq_len)


def chunk_steps(x: Any, seq_len: int) -> Any:
    """``[T, N, ...] -> [L, K*N, ...]`` with ``L = seq_len``, ``K = ceil(T / L)``: column ``k*N + n`` is env ``n``'s
    steps ``k*L .. k*L + L - 1`` in order, zeros past step ``T - 1``."""
    def chunk(t: Tensor) -> Tensor:
        T, N, rest = t.shape[0], t.shape[1], t.shape[2:]
        K = num_chunks(T, seq_len)
        if K * seq_len > T:
            t = torch.cat([t, t.new_zeros((K * seq_len - T, N, *rest))])
        return t.reshape(K, seq_len, N, *rest).transpose(0, 1).reshape(seq_len, K * N, *rest)
    return tree_map(chunk, x)


def unchunk_steps(x: Tensor, num_steps: int) -> Tensor:
    """``chunk_steps``' inverse: ``[L, K*N, ...] -> [T, N, ...]`` with ``T = num_steps`` (the padding dropped)."""
    L, KN, rest = x.shape[0], x.shape[1], x.shape[2:]
    K = num_chunks(num_steps, L)
    return x.reshape(L, K, KN // K, *rest).transpose(0, 1).reshape(K * L, KN // K, *rest)[:num_steps]


def chunk_starts(x: Any, seq_len: int) -> Any:
    """``[T, N, ...] -> [K*N, ...]``: each chunk's (``chunk_steps``' column order) entry at its first step."""
    return tree_map(lambda t: t[::seq_len].reshape(-1, *t.shape[2:]), x)
