"""`init_empty_weights`: build modules with their parameters on the meta device, so a
large model costs no memory until its units are loaded from a checkpoint
(docs/concepts/offload.md#checkpoints).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import Final

import torch
from torch import nn

__all__ = ["init_empty_weights"]

_META: Final = torch.device("meta")


# The innermost active `init_empty_weights` of this thread (or task): None outside, else
# whether buffers go on meta too.
_EMPTY: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "fhelium_init_empty_weights", default=None
)


class _Patch:
    """``nn.Module.register_parameter`` and ``register_buffer`` replaced while any thread
    is inside `init_empty_weights`; the originals are put back when the last one leaves."""

    lock = threading.Lock()
    active = 0
    register_parameter: Callable[..., None] | None = None
    register_buffer: Callable[..., None] | None = None


def _register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    original = _Patch.register_parameter
    assert original is not None
    original(module, name, param)
    if param is None or _EMPTY.get() is None:
        return
    current = module._parameters[name]
    if current is None or current.device == _META:
        return
    module._parameters[name] = _on_meta(current)


def _on_meta(param: nn.Parameter) -> nn.Parameter:
    cls = type(param)
    data = param.detach().to(_META)
    if cls is nn.Parameter:
        moved = nn.Parameter(data, requires_grad=param.requires_grad)
        moved.__dict__.update(param.__dict__)
        return moved
    # A Parameter subclass (a quantised weight, say) takes its attributes as keywords, as
    # Accelerate passes them.
    return cls(data, **{**param.__dict__, "requires_grad": param.requires_grad})


def _register_buffer(
    module: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True
) -> None:
    original = _Patch.register_buffer
    assert original is not None
    original(module, name, tensor, persistent=persistent)
    if tensor is None or not _EMPTY.get():
        return
    current = module._buffers[name]
    if current is not None and current.device != _META:
        module._buffers[name] = current.to(_META)


def _install() -> None:
    with _Patch.lock:
        if _Patch.active == 0:
            # Our wrapper may still be there, put back over a foreign patch we left; it
            # keeps delegating to what we saved then.
            if nn.Module.register_parameter is not _register_parameter:
                _Patch.register_parameter = nn.Module.register_parameter
            if nn.Module.register_buffer is not _register_buffer:
                _Patch.register_buffer = nn.Module.register_buffer
            nn.Module.register_parameter = _register_parameter  # type: ignore[method-assign,assignment]
            nn.Module.register_buffer = _register_buffer  # type: ignore[method-assign,assignment]
        _Patch.active += 1


def _uninstall() -> None:
    with _Patch.lock:
        _Patch.active -= 1
        if _Patch.active:
            return
        # Put back what was there, unless someone patched over us meanwhile (their own
        # restore will put our wrapper back, which then only delegates).
        if nn.Module.register_parameter is _register_parameter:
            nn.Module.register_parameter = _Patch.register_parameter  # type: ignore[method-assign,assignment]
        if nn.Module.register_buffer is _register_buffer:
            nn.Module.register_buffer = _Patch.register_buffer  # type: ignore[method-assign,assignment]


@contextlib.contextmanager
def init_empty_weights(include_buffers: bool = False) -> Iterator[None]:
    """Build modules with their parameters on the meta device: no memory, no init cost.

    While the block runs on this thread, every parameter a module registers is replaced
    by one of the same class, shape, dtype and ``requires_grad`` on ``meta`` (as
    Accelerate's ``init_empty_weights`` does). Buffers stay real by default, so buffers
    a checkpoint does not hold (a rotary ``inv_freq``) keep the value the module
    computed; ``include_buffers=True`` puts registered buffers on meta too. Tensors are
    made where the module's code makes them and moved to meta as they are registered.
    Other threads are not affected; blocks nest (the innermost decides);
    ``torch.nn.Module`` is restored exactly when the last block leaves, on an exception
    too.

    Args:
        include_buffers: Put buffers on meta too.

    Yields:
        None.

    Raises:
        TypeError: ``include_buffers`` is not a bool.

    Example:
        ```python
        import torch
        from torch import nn
        from fhelium.residency.nn import init_empty_weights

        with init_empty_weights():
            model = nn.Sequential(nn.Linear(4096, 4096), nn.BatchNorm1d(4096))
        assert model[0].weight.device == torch.device("meta")
        assert model[1].running_mean.device == torch.device("cpu")
        ```
    """
    if not isinstance(include_buffers, bool):
        raise TypeError(f"include_buffers must be a bool, got {type(include_buffers).__name__}")
    with contextlib.ExitStack() as stack:
        _install()
        stack.callback(_uninstall)
        token = _EMPTY.set(include_buffers)
        stack.callback(_EMPTY.reset, token)
        yield
