"""TensorResident: a value whose declared tensor fields move between devices together.

Also the two ready-made residents (one tensor, named tensors) and the measurement helpers
the residency manager uses for alias rejection and pinning checks.
"""

from __future__ import annotations

import abc
import copy
import itertools
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Self

import torch
from torch.autograd import forward_ad as _forward_ad

__all__ = ["TensorResident", "ResidentTensor", "TensorBundle", "TensorSequence", "as_resident"]

_CPU = torch.device("cpu")
_new_object = object.__new__
# Whether torch says if a forward-mode AD dual level is open: only then can a tensor
# carry a tangent. It keeps the innermost open level in `forward_ad._current_level`
# (-1: none); without it, every copy is detached (`TensorResident.to`).
_DUAL_LEVELS_KNOWN = hasattr(_forward_ad, "_current_level")
_STRIDED = torch.strided
# The tensor types `to` copies whole with one `to(copy=True)`.
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)

_PINNED_UNAVAILABLE = (
    "pinned host storage is unavailable in this PyTorch runtime; use pageable CPU storage "
    "or an accelerator-enabled PyTorch build"
)


class TensorResident(abc.ABC):
    """The abstract base of every managed value: tensor fields that always share one device.

    Subclasses implement ``_resident_tensors`` (the direct tensor fields, in a fixed order) and
    ``_with_resident_tensors(tensors)`` (a new value of the same kind around replacement
    tensors); everything else (device, byte measurements, movement and pinning) is derived
    from those two. `ResidentTensor`, `TensorBundle` and `TensorSequence` are the provided
    kinds. See docs/concepts/values.md#tensorresident.
    """

    __slots__ = ()

    @property
    @abc.abstractmethod
    def _resident_tensors(self) -> tuple[torch.Tensor, ...]:
        """The value's direct tensor fields, in a fixed order."""

    @abc.abstractmethod
    def _with_resident_tensors(self, tensors: tuple[torch.Tensor, ...]) -> Self:
        """A new value of the same kind around ``tensors``, keeping all other metadata.

        The metadata is not re-validated: the tensors are replacements for the current
        fields, in the same order.
        """

    @property
    def device(self) -> torch.device:
        """The device shared by every tensor field.

        Raises:
            RuntimeError: The value has no tensor fields, or they are on different devices.
        """
        tensors = self._resident_tensors
        if not tensors:
            raise RuntimeError(f"{type(self).__name__} has no tensor fields, so no device")
        device = tensors[0].device
        for tensor in tensors[1:]:
            if tensor.device != device:
                raise RuntimeError(
                    f"{type(self).__name__} spans several devices ({device} and "
                    f"{tensor.device}); every tensor field must share one device"
                )
        return device

    @property
    def nbytes(self) -> int:
        """Logical payload bytes, ``sum(numel * element_size)``; shared storage counts in full."""
        return sum(tensor.numel() * tensor.element_size() for tensor in self._resident_tensors)

    @property
    def storage_nbytes(self) -> int:
        """Bytes of unique backing storage, counting each whole allocation once.

        Storages are keyed by ``(device, data_ptr)`` and empty ones skipped. The figure can exceed
        `nbytes` (a view into a larger allocation) or be less (shared storage).

        Raises:
            RuntimeError: The same storage key appears with two different sizes.
        """
        sizes: dict[tuple[torch.device, int], int] = {}
        for tensor in self._resident_tensors:
            storage = tensor.untyped_storage()
            size = storage.nbytes()
            if size == 0:
                continue
            key = (tensor.device, storage.data_ptr())
            known = sizes.setdefault(key, size)
            if known != size:
                raise RuntimeError(
                    f"{type(self).__name__} has two tensors on {key[0]} at storage address "
                    f"{key[1]:#x} reporting different storage sizes ({known} and {size})"
                )
        return sum(sizes.values())

    @property
    def is_cpu(self) -> bool:
        """Whether the value lives in host memory (pageable or pinned)."""
        return self.device.type == "cpu"

    @property
    def is_cuda(self) -> bool:
        """Whether the value lives on a CUDA device."""
        return self.device.type == "cuda"

    @property
    def is_pinned(self) -> bool:
        """True only for a CPU value whose tensors with storage are all in page-locked
        memory (and that has at least one such tensor).

        A tensor without storage bytes has no memory to pin: torch's pinned allocator
        returns no storage for zero bytes, so it reports such a tensor as not pinned.
        It neither makes nor breaks the value's pinning.
        """
        if self.device.type != "cpu":
            return False
        pinning = [
            tensor.is_pinned()
            for tensor in self._resident_tensors
            if tensor.untyped_storage().nbytes() > 0
        ]
        return bool(pinning) and all(pinning)

    def to(
        self, device: torch.device | str | int, *, non_blocking: bool = False, copy: bool = False
    ) -> Self:
        """Move every tensor to ``device``; returns ``self`` when nothing had to change.

        A copy keeps the value's storage layout: each unique backing storage is copied
        once, whole, and every field is rebuilt over its copy with its dtype, storage
        offset, size and stride, so fields that shared a storage still share one and a
        view stays a view (docs/concepts/values.md#copies-keep-the-storage-layout). The
        copy's `storage_nbytes` is the source's. Copies are made without autograd: each
        new field is a leaf with its source's ``requires_grad``. Host copies are pageable.

        Args:
            device: The target device, anything ``torch.device`` accepts.
            non_blocking: Passed to the storage copies: asynchronous where torch allows it.
            copy: Always copy, even when the tensors already are on ``device``.

        Returns:
            A value of the same kind on ``device``, or ``self``.

        Raises:
            RuntimeError: A device that does not exist or is unavailable (from torch), or
                two fields at one storage address reporting different storage sizes.
            TypeError: A ``device`` that ``torch.device`` cannot convert.
        """
        target = device if type(device) is torch.device else torch.device(device)
        # `_indexed`'s first case inline: an indexed device, or the CPU (most copies).
        on_host = False
        if target.index is None:
            on_host = target == _CPU
            if not on_host:
                target = _indexed(target)
        # A `ResidentTensor`'s field by slot (no property frame): most values are one.
        tensors = (
            (self._tensor,)  # type: ignore[attr-defined]
            if type(self) is ResidentTensor
            else self._resident_tensors
        )
        if not copy and all(tensor.device == target for tensor in tensors):
            return self
        if len(tensors) == 1 and (
            # One plain contiguous tensor (or parameter) spanning its whole, non-empty
            # storage from offset 0, without lazy conjugate or negative bits: one copy
            # of it with ``to(copy=True)`` keeps the layout `layout_copy` would rebuild.
            type(tensor := tensors[0]) in _PLAIN_TENSORS
            and tensor.layout == _STRIDED
            and not tensor.is_quantized
            and tensor.storage_offset() == 0
            and tensor.is_contiguous()
            and 0 < tensor.nbytes == tensor.untyped_storage().nbytes()
            and not tensor.is_conj()
            and not tensor.is_neg()
        ):
            # Copied without autograd, a leaf with its source's requires_grad: detached
            # first where autograd could see the copy (a source that requires grad, or
            # a forward-mode dual level open, under which a tensor may carry a tangent
            # that the copy would inherit); otherwise the copy is already such a leaf.
            requires_grad = tensor.requires_grad
            source = (
                tensor.detach()
                if requires_grad or not _DUAL_LEVELS_KNOWN or _forward_ad._current_level >= 0
                else tensor
            )
            # On its own device, `clone` is the same copy with less dispatch (a tensor
            # is on the host device when `is_cpu`, which is quicker to read).
            field = (
                source.clone()
                if (tensor.is_cpu if on_host else tensor.device == target)
                else source.to(target, non_blocking=non_blocking, copy=True)
            )
            if requires_grad:
                field.requires_grad_(True)
            if type(self) is ResidentTensor:
                # `ResidentTensor._with_resident_tensors`, inline: one slot to fill.
                plain = _new_object(ResidentTensor)
                plain._tensor = field
                return plain  # type: ignore[return-value]
            return self._with_resident_tensors((field,))

        def allocate(nbytes: int) -> torch.Tensor:
            return torch.empty(nbytes, dtype=torch.uint8, device=target)

        def fallback(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(target, non_blocking=non_blocking, copy=True)

        keep = None if copy else frozenset(i for i, t in enumerate(tensors) if t.device == target)
        moved = layout_copy(
            tensors, target, allocate, fallback, non_blocking=non_blocking, keep=keep
        )
        return self._with_resident_tensors(moved)

    def cpu(self, *, copy: bool = False) -> Self:
        """The value in pageable host memory; a pinned value is always copied out.

        Same as ``to("cpu", copy=copy or self.is_pinned)``, so the result is never pinned.

        Args:
            copy: Always copy, even when the value already is in pageable memory.

        Returns:
            A value of the same kind in pageable host memory, or ``self``.

        Raises:
            RuntimeError: A copy from the device fails (from torch).
        """
        return self.to("cpu", copy=copy or self.is_pinned)

    def pin_memory(self, *, copy: bool = False) -> Self:
        """The value in new pinned host storage, or ``self`` if already pinned and no copy is asked.

        Otherwise the value is copied into new pinned host storage, synchronously and without
        autograd, keeping its storage layout as `to` does: each unique storage is copied once and
        every field is rebuilt over it (same dtype, storage offset, size, stride and
        ``requires_grad``). Fields without storage bytes are copied as (pageable) empty tensors.

        Args:
            copy: Always clone, even when the value already is fully pinned.

        Returns:
            A pinned value of the same kind, or ``self``.

        Raises:
            RuntimeError: This PyTorch runtime cannot allocate pinned memory (the message
                suggests pageable storage or an accelerator-enabled build).
        """
        if not copy and self.is_pinned:
            return self
        pinned = layout_copy(self._resident_tensors, _CPU, _empty_pinned, _pinned_clone)
        return self._with_resident_tensors(pinned)


def host_copy(
    value: TensorResident,
) -> tuple[TensorResident, torch.UntypedStorage, torch.UntypedStorage, int] | None:
    """``value.to("cpu", copy=True)`` for a plain `ResidentTensor` on the host, with what a
    caller that registers the copy's storage needs: ``(copy, its storage, the source's
    storage, their bytes)``; ``None`` where `to`'s one-tensor fast path does not apply
    (the caller then calls `to`).

    The same checks and the same copy as that fast path: a plain tensor (or parameter)
    on the host, strided, not quantized, contiguous from offset 0 over its whole,
    non-empty storage, without lazy conjugate or negative bits, cloned without autograd
    into a leaf with its ``requires_grad``. The copy's storage bytes, and its tensor's,
    are the source tensor's ``nbytes``. A `ResidentTensor` subclass is left to `to`.
    """
    if type(value) is not ResidentTensor:
        return None
    tensor = value._tensor
    if (
        type(tensor) not in _PLAIN_TENSORS
        or tensor.layout != _STRIDED
        or tensor.is_quantized
        or not tensor.is_cpu
        or tensor.storage_offset()
        or not tensor.is_contiguous()
    ):
        return None
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    if not 0 < tensor.nbytes == nbytes or tensor.is_conj() or tensor.is_neg():
        return None
    # As `to`: detached first where autograd could see the copy.
    requires_grad = tensor.requires_grad
    field = (
        tensor.detach()
        if requires_grad or not _DUAL_LEVELS_KNOWN or _forward_ad._current_level >= 0
        else tensor
    ).clone()
    if requires_grad:
        field.requires_grad_(True)
    plain = _new_object(ResidentTensor)
    plain._tensor = field
    return plain, field.untyped_storage(), storage, nbytes


def _indexed(device: torch.device) -> torch.device:
    """``device`` with the index torch gives an unindexed accelerator device (``"cuda"``
    names the current CUDA device), so it compares equal to the devices of its tensors."""
    # The CPU by equality first: reading `device.type` builds a string each time.
    if device.index is not None or device == _CPU or device.type == "meta":
        return device
    return torch.empty(0, device=device).device


def _empty_pinned(nbytes: int) -> torch.Tensor:
    """A new flat ``uint8`` buffer in pinned host memory (`RuntimeError` without pinning)."""
    try:
        pinned = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)
    except RuntimeError as exc:
        raise RuntimeError(_PINNED_UNAVAILABLE) from exc
    # A build without a pinned allocator may silently hand back pageable memory.
    if pinned.device.type != "cpu" or not pinned.is_pinned():
        raise RuntimeError(_PINNED_UNAVAILABLE)
    return pinned


def layout_copy(
    tensors: tuple[torch.Tensor, ...],
    device: torch.device,
    allocate: Callable[[int], torch.Tensor],
    fallback: Callable[[torch.Tensor], torch.Tensor],
    *,
    non_blocking: bool = False,
    keep: frozenset[int] | None = None,
) -> tuple[torch.Tensor, ...]:
    """New tensors on ``device`` with the storage layout of ``tensors``.

    Each unique non-empty storage, by ``(device, address)``, is copied once, whole,
    into ``allocate(nbytes)`` (a new flat ``uint8`` tensor on ``device``); each field
    is rebuilt over its storage's copy with ``set_`` (dtype, storage offset, size and
    stride), so fields sharing a storage still share one, across dtypes too, and the
    copy's storage bytes are the source's. A field without storage bytes becomes a new
    empty tensor of its size, stride and dtype; a field that is not a plain strided
    tensor (sparse, quantized) goes through ``fallback``. Fields whose positions are
    in ``keep`` are returned as they are. Without autograd: each new field is a leaf
    with its source's ``requires_grad`` (docs/concepts/values.md#copies-keep-the-storage-layout).

    Raises:
        RuntimeError: Two fields at one storage address with different storage sizes,
            or what ``allocate``, ``fallback`` or the copy raise.
    """
    if torch.is_grad_enabled():
        with torch.no_grad():
            return _layout_copy(tensors, device, allocate, fallback, non_blocking, keep)
    # Already without autograd (an inference under `torch.no_grad()`): no context to enter.
    return _layout_copy(tensors, device, allocate, fallback, non_blocking, keep)


def _layout_copy(
    tensors: tuple[torch.Tensor, ...],
    device: torch.device,
    allocate: Callable[[int], torch.Tensor],
    fallback: Callable[[torch.Tensor], torch.Tensor],
    non_blocking: bool,
    keep: frozenset[int] | None,
) -> tuple[torch.Tensor, ...]:
    """`layout_copy`'s copy, autograd off."""
    copies: dict[tuple[torch.device, int], tuple[int, torch.UntypedStorage]] = {}
    result: list[torch.Tensor] = []
    for position, tensor in enumerate(tensors):
        if keep is not None and position in keep:
            result.append(tensor)
            continue
        if tensor.layout != torch.strided or tensor.is_quantized:
            result.append(fallback(tensor))
            continue
        storage = tensor.untyped_storage()
        size = storage.nbytes()
        if size == 0:
            field = torch.empty_strided(
                tensor.size(), tensor.stride(), dtype=tensor.dtype, device=device
            )
        else:
            key = (tensor.device, storage.data_ptr())
            known = copies.get(key)
            if known is None:
                # The whole storage, storage to storage (one torch call).
                buffer = allocate(size).untyped_storage()
                buffer.copy_(storage, non_blocking=non_blocking)
                known = copies[key] = (size, buffer)
            elif known[0] != size:
                raise RuntimeError(
                    f"two tensors on {key[0]} at storage address {key[1]:#x} report "
                    f"different storage sizes ({known[0]} and {size})"
                )
            field = torch.empty(0, dtype=tensor.dtype, device=device).set_(
                known[1], tensor.storage_offset(), tensor.size(), tensor.stride()
            )
            # The lazy conjugate and negative bits are part of the view, not the bytes.
            if tensor.is_conj():
                field = field.conj()
            if tensor.is_neg():
                field = field._neg_view()
        if tensor.requires_grad:  # a new tensor does not require grad
            field.requires_grad_(True)
        result.append(field)
    return tuple(result)


def _pinned_clone(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned clone of one field that is not a plain strided tensor."""
    try:
        pinned = tensor.to("cpu", copy=True).pin_memory()
    except RuntimeError as exc:
        raise RuntimeError(_PINNED_UNAVAILABLE) from exc
    pinned.requires_grad_(tensor.requires_grad)
    return pinned


def storage_keys(value: TensorResident) -> frozenset[tuple[torch.device, int]]:
    """The ``(device, storage address)`` of every non-empty backing storage of ``value``.

    Two values whose key sets intersect alias each other's memory.
    """
    keys: set[tuple[torch.device, int]] = set()
    for tensor in value._resident_tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() > 0:
            keys.add((tensor.device, storage.data_ptr()))
    return frozenset(keys)


def cpu_pinning_is_uniform(value: TensorResident) -> bool:
    """False only for a host value that mixes pinned and pageable tensors (tensors
    without storage bytes are neither)."""
    pinning = {
        tensor.is_pinned()
        for tensor in value._resident_tensors
        if tensor.device.type == "cpu" and tensor.untyped_storage().nbytes() > 0
    }
    return len(pinning) <= 1


def _describe(tensor: torch.Tensor) -> str:
    return f"shape={tuple(tensor.shape)}, dtype={tensor.dtype}, device={tensor.device}"


class ResidentTensor(TensorResident):
    """A single tensor managed as a residency value.

    Args:
        tensor: The tensor; the value keeps this very object.

    Raises:
        TypeError: ``tensor`` is not a ``torch.Tensor``.

    Example:
        ```python
        import torch
        from fhelium.values import ResidentTensor

        value = ResidentTensor(torch.zeros(2, 3))
        assert value.tensor.shape == (2, 3) and value.nbytes == 24
        ```
    """

    __slots__ = ("_tensor",)

    _tensor: torch.Tensor

    def __init__(self, tensor: torch.Tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        self._tensor = tensor

    @property
    def tensor(self) -> torch.Tensor:
        """The wrapped tensor."""
        return self._tensor

    @property
    def _resident_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self._tensor,)

    def _with_resident_tensors(self, tensors: tuple[torch.Tensor, ...]) -> Self:
        (tensor,) = tensors
        if type(self) is ResidentTensor:
            # Its one slot is the tensor: nothing else to copy (and no `__setattr__` of
            # a subclass to go around).
            plain = _new_object(ResidentTensor)
            plain._tensor = tensor
            return plain  # type: ignore[return-value]
        # A shallow copy rather than a constructor call: subclasses keep their own
        # metadata and constructor signature, and nothing is re-validated.
        clone = copy.copy(self)
        object.__setattr__(clone, "_tensor", tensor)
        return clone

    def __repr__(self) -> str:
        return f"{type(self).__name__}({_describe(self._tensor)})"


class TensorBundle(TensorResident):
    """Named tensors, in insertion order, that move between devices together.

    Build it from a mapping, from keywords, or both (a name may appear only once). Indexing by
    name, ``in``, iteration over the names and ``len`` work as for a mapping.

    Args:
        tensors: A mapping of names to tensors (a ``state_dict``, say), or ``None``.
        **named: More tensors, by keyword.

    Raises:
        TypeError: ``tensors`` is not a mapping, a name is not a string, or a value is not a
            tensor.
        ValueError: An empty name, a name given twice, or no tensor at all.

    Example:
        ```python
        import torch
        from fhelium.values import TensorBundle

        bundle = TensorBundle({"weight": torch.zeros(4, 4)}, bias=torch.zeros(4))
        assert bundle.names == ("weight", "bias")
        assert bundle["bias"].shape == (4,)
        ```
    """

    __slots__ = ("_index", "_names", "_tensors")

    _index: dict[str, int]
    _names: tuple[str, ...]
    _tensors: tuple[torch.Tensor, ...]

    def __init__(
        self, tensors: Mapping[str, torch.Tensor] | None = None, /, **named: torch.Tensor
    ) -> None:
        if tensors is not None and not isinstance(tensors, Mapping):
            raise TypeError(
                f"tensors must be a Mapping of names to tensors, got {type(tensors).__name__}"
            )
        index: dict[str, int] = {}
        fields: list[torch.Tensor] = []
        items = (
            named.items() if tensors is None else itertools.chain(tensors.items(), named.items())
        )
        for name, tensor in items:
            if not isinstance(name, str):
                raise TypeError(f"tensor names must be str, got {type(name).__name__}")
            if not name or name.isspace():
                raise ValueError(f"tensor names must be non-empty, got {name!r}")
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"tensor {name!r} must be a torch.Tensor, got {type(tensor).__name__}"
                )
            if name in index:
                raise ValueError(f"tensor name {name!r} is given more than once")
            index[name] = len(fields)
            fields.append(tensor)
        if not fields:
            raise ValueError("TensorBundle needs at least one tensor")
        self._index = index
        self._names = tuple(index)
        self._tensors = tuple(fields)

    @property
    def names(self) -> tuple[str, ...]:
        """The tensor names, in order."""
        return self._names

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """A new dict of name to tensor, in order."""
        return dict(zip(self._names, self._tensors, strict=True))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[self._index[name]]

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._tensors)

    # A property over a C getter: no Python frame.
    _resident_tensors = property(operator.attrgetter("_tensors"))

    def _with_resident_tensors(self, tensors: tuple[torch.Tensor, ...]) -> Self:
        if len(tensors) != len(self._tensors):
            raise ValueError(
                f"{type(self).__name__} has {len(self._tensors)} tensors, "
                f"got {len(tensors)} replacements"
            )
        # The shallow copy shares the never-mutated names and index with the original.
        clone = copy.copy(self)
        object.__setattr__(clone, "_tensors", tuple(tensors))
        return clone

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{name}=<{_describe(tensor)}>"
            for name, tensor in zip(self._names, self._tensors, strict=True)
        )
        return f"{type(self).__name__}({fields})"


class TensorSequence(TensorResident):
    """An ordered list or tuple of tensors managed as one value.

    Indexing by position, ``len`` and iteration work as for a tuple.

    Args:
        tensors: A non-empty list or tuple of tensors.

    Raises:
        TypeError: ``tensors`` is not a list or tuple (a string is refused), or an element is
            not a tensor.
        ValueError: ``tensors`` is empty.

    Example:
        ```python
        import torch
        from fhelium.values import TensorSequence

        value = TensorSequence([torch.zeros(2), torch.ones(3)])
        assert len(value) == 2 and value[1].shape == (3,)
        ```
    """

    __slots__ = ("_tensors",)

    _tensors: tuple[torch.Tensor, ...]

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        if isinstance(tensors, str | bytes) or not isinstance(tensors, Sequence):
            raise TypeError(
                f"tensors must be a list or tuple of tensors, got {type(tensors).__name__}"
            )
        if not tensors:
            raise ValueError("TensorSequence needs at least one tensor")
        for position, tensor in enumerate(tensors):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"tensors[{position}] must be a torch.Tensor, got {type(tensor).__name__}"
                )
        self._tensors = tuple(tensors)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors, in order."""
        return self._tensors

    def __getitem__(self, position: int) -> torch.Tensor:
        return self._tensors[position]

    def __len__(self) -> int:
        return len(self._tensors)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._tensors)

    # A property over a C getter: no Python frame.
    _resident_tensors = property(operator.attrgetter("_tensors"))

    def _with_resident_tensors(self, tensors: tuple[torch.Tensor, ...]) -> Self:
        if len(tensors) != len(self._tensors):
            raise ValueError(
                f"{type(self).__name__} has {len(self._tensors)} tensors, "
                f"got {len(tensors)} replacements"
            )
        clone = copy.copy(self)
        object.__setattr__(clone, "_tensors", tuple(tensors))
        return clone

    def __repr__(self) -> str:
        inner = ", ".join(f"<{_describe(tensor)}>" for tensor in self._tensors)
        return f"{type(self).__name__}([{inner}])"


def as_resident(
    value: torch.Tensor | Mapping[str, torch.Tensor] | Sequence[torch.Tensor] | TensorResident,
) -> TensorResident:
    """Wrap the objects people already have as managed values.

    A tensor becomes a `ResidentTensor`, a mapping of names to tensors (a ``state_dict``) a
    `TensorBundle`, a list or tuple a `TensorSequence`; a `TensorResident` is returned as it is.

    Args:
        value: A tensor, a mapping of names to tensors, a list or tuple of tensors, or a
            `TensorResident`.

    Returns:
        The value as a `TensorResident`.

    Raises:
        TypeError: Any other kind of object, or a container holding a non-tensor.
        ValueError: An empty container, or an empty or repeated name.

    Example:
        ```python
        import torch
        from fhelium.values import TensorBundle, as_resident

        assert isinstance(as_resident({"w": torch.zeros(2)}), TensorBundle)
        ```
    """
    if isinstance(value, TensorResident):
        return value
    if isinstance(value, torch.Tensor):
        return ResidentTensor(value)
    if isinstance(value, Mapping):
        return TensorBundle(value)
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return TensorSequence(value)
    raise TypeError(
        "expected a tensor, a mapping of names to tensors, a list or tuple of tensors, "
        f"or a TensorResident; got {type(value).__name__}"
    )
