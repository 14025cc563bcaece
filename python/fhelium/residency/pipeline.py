"""`ResidencyController.run`: a sequence of requests used one step at a time, with the
transfers of the next steps issued ahead so they overlap the current step's compute.

See docs/concepts/controller.md#prefetch for the rules this module implements.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator, Mapping
from typing import Any

from fhelium.residency._pipeline import Pipeline
from fhelium.residency._use import Controller, ResidencyUse
from fhelium.residency.location import ResidencyLocation
from fhelium.residency.request import ResidencyRequest

__all__ = ["ResidencyPipeline"]

# The state and steps of each pipeline not yet ended, by `id` of the pipeline (see
# `ResidencyPipeline`).
_RUNNING: dict[int, tuple[Pipeline, Generator[ResidencyUse, None, None]]] = {}


class ResidencyPipeline(Iterator[ResidencyUse]):
    """The steps of `ResidencyController.run`, each an entered `ResidencyUse`.

    Iterate it; each step stays active until the next one is requested, while the transfers
    of up to `prefetch` later steps are issued. Closing it (`close`, leaving its ``with``
    block, or dropping it, as breaking out of a ``for`` loop over it does) ends the active
    step, releases every staged step's holds and reservations and waits for the copies still
    in flight; dropped where its thread cannot enter the manager (collected inside a source's
    ``load()``), it queues all of that instead. An error while staging ends the pipeline and
    propagates from the iteration. Used from one thread; other threads may run pipelines on
    the same manager. Constructed by the controller. See docs/concepts/controller.md#prefetch.

    Raises:
        TypeError: Raised during iteration for a request that is not a `ResidencyRequest`.
        ResidencyPlanError: A step that does not fit once nothing is left to wait for
            (as `ResidencyController.use` raises).
    """

    # The steps run in a generator over `_state`, which never refers back to the
    # pipeline. `_RUNNING` holds both until the pipeline ends or is dropped, when its
    # finalizer ends them: so a pipeline collected in a reference cycle is ended with
    # its steps' leases and holds still alive, never finalized one by one (each would
    # warn that it was abandoned).
    __slots__ = ("_state", "_steps")

    def __init__(
        self,
        controller: Controller,
        requests: Iterable[ResidencyRequest],
        *,
        prefetch: int,
        consumer_streams: Mapping[ResidencyLocation, Any] | None,
        transfer_streams: Mapping[ResidencyLocation, Any] | None,
    ) -> None:
        self._state = Pipeline(
            controller,
            requests,
            prefetch=prefetch,
            consumer_streams=consumer_streams,
            transfer_streams=transfer_streams,
        )
        self._steps = self._state.run()
        _RUNNING[id(self)] = (self._state, self._steps)

    def __del__(self) -> None:
        # Interpreter teardown may have cleared module globals; nothing is left to do.
        running = _RUNNING.pop(id(self), None) if _RUNNING is not None else None
        if running is None:
            return
        state, steps = running
        # Dropped, not closed: where this thread cannot enter the manager (a collection
        # inside a source's `load()`), its releases are queued instead.
        state.dropped = True
        steps.close()

    def _ended(self) -> None:
        _RUNNING.pop(id(self), None)

    # ------------------------------------------------------------------ protocol

    def __iter__(self) -> ResidencyPipeline:
        return self

    def __next__(self) -> ResidencyUse:
        state = self._state
        if state.closed:
            raise StopIteration
        try:
            return next(self._steps)
        except BaseException:
            state.closed = True
            self._ended()
            raise

    def close(self) -> None:
        """End the active step and release what the pipeline holds; idempotent.

        Waits on the host for every copy still in flight and releases its protections.

        Raises:
            Exception: An error from ending the active step or from waiting for a copy
                still in flight propagates; the pipeline is closed all the same.
        """
        self._state.closed = True
        self._ended()
        self._steps.close()

    def __enter__(self) -> ResidencyPipeline:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, traceback: Any) -> None:
        self.close()

    @property
    def prefetch(self) -> int:
        """How many steps ahead transfers are issued."""
        return self._state.prefetch

    @property
    def position(self) -> int:
        """How many steps have been entered so far."""
        return self._state.position

    @property
    def current(self) -> ResidencyUse | None:
        """The active step, or None between steps and once closed."""
        return self._state.current

    @property
    def staged(self) -> tuple[int, ...]:
        """The indices of the later steps whose transfers were already issued."""
        return tuple(sorted(self._state.staged))

    def __repr__(self) -> str:
        state = self._state
        return (
            f"ResidencyPipeline(prefetch={state.prefetch}, position={state.position}, "
            f"staged={list(self.staged)}, {'closed' if state.closed else 'open'})"
        )
