"""Building a model without holding it whole: parameters are materialised one at a time.

A sharded strategy that keeps only its rank's part of each parameter asks for a
model built by :func:`build_deferred` and reads each parameter's full initial value
with :func:`full_value`, slicing its shard before asking for the next one.

The build runs on the meta device (no memory) while two torch modes record how each
tensor gets its values: the factory call that made its storage (``torch.empty``,
``torch.zeros``, ``torch.tensor``), then every in-place operation on it or on a view of
it, in order (``normal_``, ``uniform_``, ``zero_``, ``fill_``, ``copy_`` from a real
tensor, a whole ``torch.nn.init`` function such as ``trunc_normal_``, which does nothing
on meta tensors). A view (``.data``, ``w[0]``, ``nn.Parameter(t)``) is found through the
storage it shares with its tensor and replayed as the same ``as_strided`` geometry. Before
an operation that draws random numbers the generator's state is saved, and the generator
is advanced as the real operation would advance it, by running it once on a scratch tensor
of that shape (freed at once). :func:`full_value` replays one tensor's operations from the
saved states: exactly the values a plain build with the same seed gives, and after the
build the generators are where a plain build leaves them.

An in-place operation that reads another recorded tensor (``w.copy_(torch.zeros(n))`` in a
``load_state_dict``) reads it as it was at that point, replayed as far. What cannot be
replayed (a tensor computed out of place from another tensor's values, ``x * 2``; an
operation that reads values on meta, ``.item()``) makes the build fall back to a plain one,
with one ``memory | ... builds whole: ...`` line.

This is the record-and-replay "deferred init" of torchdistx, written here because
torchdistx is unmaintained and has no build for torch 2.13.
"""

from __future__ import annotations

import functools
import logging
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from hetfair.errors import HetfairError

logger = logging.getLogger(__name__)

_CPU = torch.device("cpu")
_RECORD = "_hetfair_deferred"
"""The attribute of a deferred model's parameter or buffer holding its :class:`_View`."""

_FACTORIES_BEYOND_DISPATCH = {torch.tensor, torch.as_tensor, torch.asarray}
"""Factories that build their tensor on the CPU below the dispatcher and only then move it (a mode sees no aten op)."""

_INIT_NAMES = [name for name in dir(nn.init)
               if name.endswith("_") and not name.startswith("_") and callable(getattr(nn.init, name))]
_INIT_FUNCTIONS = {getattr(nn.init, name) for name in _INIT_NAMES}
"""``torch.nn.init``'s in-place initialisers, recorded as one operation each (some skip meta tensors altogether)."""

Geometry = tuple[tuple[int, ...], tuple[int, ...], int]
"""A view of a storage: size, stride, storage offset."""


class NotReplayable(Exception):
    """The build did something :func:`full_value` could not repeat; the model is built whole instead."""


@dataclass
class _Op:
    """One in-place operation on (a view of) a storage, with the generator state it started from."""

    func: Callable[..., Any]
    geometry: Geometry
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng_state: Optional[torch.Tensor] = None
    generator: Optional[torch.Generator] = None


@dataclass
class _Storage:
    """How one meta storage got its values: the factory call that made it, then its in-place operations."""

    factory: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    dtype: torch.dtype
    geometry: Geometry
    ops: list[_Op] = field(default_factory=list)
    rng_state: Optional[torch.Tensor] = None
    """The generator state a random factory (``torch.randn``) started from."""
    generator: Optional[torch.Generator] = None
    broken: Optional[str] = None
    """Why its values cannot be replayed (``None``: they can)."""

    def replay(self, ops: Optional[int] = None) -> torch.Tensor:
        """The storage's tensor as the build left it (or after its first ``ops`` operations), made on the CPU."""
        with torch.no_grad():
            tensor = _drawing(self.rng_state, self.generator,
                              lambda: self.factory(*self.args, **{**self.kwargs, "device": _CPU}))
            for op in self.ops[:ops]:
                target = tensor.as_strided(*op.geometry)
                args, kwargs = tree_map(_resolved, (op.args, op.kwargs))
                _drawing(op.rng_state, op.generator, lambda: op.func(target, *args, **kwargs))
        return tensor


@dataclass
class _Snapshot:
    """Another recorded tensor's value as an operation read it: its storage after that many of its operations."""

    storage: _Storage
    ops: int
    geometry: Geometry

    def value(self) -> torch.Tensor:
        return self.storage.replay(self.ops).as_strided(*self.geometry)


def _resolved(value: Any) -> Any:
    return value.value() if isinstance(value, _Snapshot) else value


def _drawing(state: Optional[torch.Tensor], generator: Optional[torch.Generator], run: Callable[[], Any]) -> Any:
    """``run()`` with the generator at ``state`` (``None``: as it is), then the generator put back."""
    if state is None:
        return run()
    generator = generator or torch.default_generator
    after = generator.get_state()
    generator.set_state(state)
    try:
        return run()
    finally:
        generator.set_state(after)


@dataclass
class _View:
    """A model tensor: a view of a recorded storage."""

    storage: _Storage
    geometry: Geometry


def _geometry(tensor: torch.Tensor) -> Geometry:
    return tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset()


def _is_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta


class _Recorder:
    """The storages seen so far, by their identity."""

    def __init__(self) -> None:
        self.storages: dict[StorageWeakRef, _Storage] = {}
        self.alive: list[torch.Tensor] = []
        """The recorded meta tensors, held for the build: a freed storage's address could come back as another's."""
        self.inside_init = 0  # > 0 while an nn.init function runs: its own aten ops are part of it
        self.scratch_memory = torch.UntypedStorage(0, device=_CPU)

    def scratch(self, storage: _Storage) -> torch.Tensor:
        """An uninitialised CPU tensor of ``storage``'s layout, for an operation to advance the generator on.
        One block of memory serves them all, grown to the largest: allocating and freeing one per operation
        would leave the small allocations in between in the freed holes, and the process's memory growing."""
        size, stride, _ = storage.geometry
        needed = torch.empty_strided(size, stride, dtype=storage.dtype, device="meta").untyped_storage().nbytes()
        if self.scratch_memory.nbytes() < needed:
            self.scratch_memory = torch.UntypedStorage(0, device=_CPU)  # the smaller block goes first
            self.scratch_memory = torch.UntypedStorage(needed, device=_CPU)
        return torch.empty(0, dtype=storage.dtype, device=_CPU).set_(self.scratch_memory, 0, size, stride)

    def add_storage(self, tensor: torch.Tensor, factory: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> None:
        kwargs = {name: value for name, value in kwargs.items() if name != "device"}
        self.alive.append(tensor)
        self.storages[StorageWeakRef(tensor.untyped_storage())] = _Storage(
            factory, args, kwargs, tensor.dtype, _geometry(tensor))

    def run_init(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the ``torch.nn.init`` function ``func``, recorded as one operation when it initialises a meta tensor."""
        if self.inside_init or not args or not _is_meta(args[0]):
            return func(*args, **kwargs)
        self.record(func, args[0], args[1:], kwargs, draws=None)
        self.inside_init += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.inside_init -= 1

    @contextmanager
    def seeing_inits(self) -> Iterator[None]:
        """``torch.nn.init``'s functions recorded while the build runs, also those without a torch-function hook
        (``trunc_normal_`` returns at once on a meta tensor, unseen by any mode): each module attribute is wrapped,
        and put back after."""
        originals = {name: getattr(nn.init, name) for name in _INIT_NAMES}

        def wrapped(func: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(func)
            def init(*args: Any, **kwargs: Any) -> Any:
                return self.run_init(func, args, kwargs)
            return init

        try:
            for name, func in originals.items():
                setattr(nn.init, name, wrapped(func))
            yield
        finally:
            for name, func in originals.items():
                setattr(nn.init, name, func)

    def snapshot(self, value: Any) -> Any:
        """A meta tensor an operation reads, as a :class:`_Snapshot` of its value at this point of the build."""
        if not _is_meta(value):
            return value
        storage = self.storage_of(value)
        assert storage is not None
        return _Snapshot(storage, len(storage.ops), _geometry(value))

    def storage_of(self, tensor: torch.Tensor) -> Optional[_Storage]:
        return self.storages.get(StorageWeakRef(tensor.untyped_storage()))

    def record(self, func: Callable[..., Any], target: torch.Tensor, args: tuple[Any, ...],
               kwargs: dict[str, Any], draws: Optional[bool]) -> None:
        """Record ``func(target, *args, **kwargs)``; ``draws``: whether it draws random numbers (``None``:
        find out by running it on a scratch tensor and watching the generator)."""
        storage = self.storage_of(target)
        if storage is None or storage.broken:
            return  # a tensor the build made some other way: refused if the model keeps it
        meta_inputs = [value for value in tree_flatten((args, kwargs))[0] if _is_meta(value)]
        if meta_inputs:
            if draws is not False:
                storage.broken = f"{_name(func)} draws random numbers from another meta tensor's values"
                return
            sources = [self.storage_of(value) for value in meta_inputs]
            if any(source is None or source.broken for source in sources):
                storage.broken = f"{_name(func)} reads a tensor computed from other tensors' values"
                return
            args, kwargs = tree_map(self.snapshot, (args, kwargs))
        if target.dtype != storage.dtype:
            storage.broken = f"{_name(func)} writes a view of another dtype"
            return
        op = _Op(func, _geometry(target), args, kwargs)
        if draws is not False:
            op.generator = kwargs.get("generator")
            generator = op.generator or torch.default_generator
            before = generator.get_state()
            with torch.no_grad():
                func(self.scratch(storage).as_strided(*op.geometry), *args, **kwargs)  # advances the generator
            drew = draws or not torch.equal(before, generator.get_state())
            if drew:
                op.rng_state = before
        storage.ops.append(op)


class _DispatchRecorder(TorchDispatchMode):
    """Sees every aten op: factories of meta tensors and in-place ops on them."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: Optional[dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.recorder.inside_init:
            return out
        inputs = tree_flatten((args, kwargs))[0]
        schema = func._schema
        if schema.is_mutable and args and _is_meta(args[0]) and _writes_first(schema):
            draws = torch.Tag.nondeterministic_seeded in func.tags
            self.recorder.record(func, args[0], args[1:], kwargs, draws)
        elif _is_meta(out) and not any(isinstance(value, torch.Tensor) for value in inputs):
            self.recorder.add_storage(out, func, args, kwargs)
            if torch.Tag.nondeterministic_seeded in func.tags:  # torch.randn and the like
                storage = self.recorder.storage_of(out)
                assert storage is not None
                storage.generator = kwargs.get("generator")
                storage.rng_state = (storage.generator or torch.default_generator).get_state()
                func(*args, **{**kwargs, "device": _CPU})  # advances the generator as the real factory would
        return out


class _FunctionRecorder(TorchFunctionMode):
    """Sees ``torch.nn.init`` functions (recorded whole) and the factories the dispatcher does not see."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: Optional[dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if func in _INIT_FUNCTIONS:
            return self.recorder.run_init(func, args, kwargs)
        out = func(*args, **kwargs)
        if func in _FACTORIES_BEYOND_DISPATCH and _is_meta(out) and not any(
                _is_meta(value) for value in tree_flatten((args, kwargs))[0]):
            data = tree_map(lambda value: value.clone() if isinstance(value, torch.Tensor) else value, args)
            self.recorder.add_storage(out, func, data, kwargs)
        return out


def _writes_first(schema: Any) -> bool:
    info = schema.arguments[0].alias_info if schema.arguments else None
    return info is not None and info.is_write


def _name(func: Any) -> str:
    return getattr(func, "__name__", str(func))


def build_deferred(build: Callable[[], nn.Module]) -> nn.Module:
    """The model ``build`` returns, its parameters and buffers on the meta device (read their values with
    :func:`full_value`); the random generators end where a plain build leaves them.

    A build that cannot be replayed runs again plainly (from the same generator state), after one
    ``memory | ... builds whole: ...`` line, so the model then holds real tensors.
    """
    rng_before = torch.random.get_rng_state()
    recorder = _Recorder()
    try:
        with warnings.catch_warnings(), recorder.seeing_inits(), torch.device("meta"), _DispatchRecorder(recorder), \
                _FunctionRecorder(recorder):
            # load_state_dict's copy into a meta parameter is recorded here, not the no-op torch warns of
            warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter")
            model = build()
        _attach(model, recorder)
        return model
    except HetfairError:
        raise
    except (NotReplayable, RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    finally:
        recorder.scratch_memory.resize_(0)  # freed now, whatever still refers to the recorder
    logger.info(f"memory | the model builds whole: {reason} (no deferred build; every rank holds the whole "
                f"model until it is sharded)")
    torch.random.set_rng_state(rng_before)
    return build()


def _attach(model: nn.Module, recorder: _Recorder) -> None:
    """Give each parameter and buffer of ``model`` its recorded storage; refuse what has none."""
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in tensors:
        if not tensor.is_meta:
            raise NotReplayable(f"{name} was built on the {tensor.device} device, outside the meta device")
        storage = recorder.storage_of(tensor)
        if storage is None:
            raise NotReplayable(f"{name} is computed from other tensors' values")
        if storage.broken:
            raise NotReplayable(f"{name}: {storage.broken}")
        if tensor.dtype != storage.dtype:
            raise NotReplayable(f"{name} is a view of another dtype")
    for _, tensor in tensors:
        storage = recorder.storage_of(tensor)
        setattr(tensor, _RECORD, _View(storage, _geometry(tensor)))  # type: ignore[arg-type]


@contextmanager
def real_tensors() -> Iterator[None]:
    """Inside a :func:`build_deferred` build, make tensors on the CPU as a plain build does: for reading what
    initialises the model (a Hugging Face directory that ``transformers`` loads), which must not land on the meta
    device; copying them into the model's parameters is then recorded. Outside a deferred build, a no-op."""
    with torch.device("cpu"):
        yield


def is_deferred(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a parameter or buffer of a :func:`build_deferred` model, not yet materialised."""
    return hasattr(tensor, _RECORD)


def full_value(param: torch.Tensor) -> torch.Tensor:
    """The full initial value of a parameter (or buffer) of a :func:`build_deferred` model, on the CPU: the same
    values a plain build with the same seed gives. Each call materialises it afresh (nothing is cached), so a
    caller that slices its shard and drops the rest holds one full tensor at a time. A tensor with values
    (a model built whole) is returned as it is."""
    view: Optional[_View] = getattr(param, _RECORD, None)
    if view is None:
        return param.detach()
    whole = view.storage.replay()
    if view.geometry == view.storage.geometry:
        return whole
    return whole.as_strided(*view.geometry).clone()
