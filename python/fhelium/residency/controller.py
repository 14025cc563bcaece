"""The controller: declarative requests decided by a bounded, deterministic search.

`decide` reads the manager's state and asks the core's search which values to evict
or spill, so the request fits; it changes nothing. `scope` runs a decision, `use`
decides, runs and borrows in one context.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from fhelium.errors import ResidencyHandleError, ResidencyPlanError
from fhelium.residency._decider import ControllerBase, Decider
from fhelium.residency._decisions import ResidencyDecision, ResidencyEviction
from fhelium.residency._use import ResidencyUse
from fhelium.residency._validation import (
    require_instance,
    require_non_empty_str,
    require_strict_int,
)
from fhelium.residency.location import ResidencyLocation
from fhelium.residency.manager import ResidencyManager, ResidencyScope
from fhelium.residency.model import ResidencyHandle
from fhelium.residency.pipeline import ResidencyPipeline
from fhelium.residency.plan import DropResident, MoveResident, ResidencyPlan  # noqa: F401
from fhelium.residency.policy import (
    DeterministicTieredLRU,
    ResidencyPolicy,
    ResidencyPolicyMetadata,
)
from fhelium.residency.request import ResidencyRequest
from fhelium.residency.snapshot import ResidencyPlanExplanation  # noqa: F401

# The decision records read as defined here (their `__module__`), so the names their
# annotations use must resolve here too (`typing.get_type_hints`): hence the plan and
# snapshot names imported above without other use.

__all__ = ["ResidencyController", "ResidencyDecision", "ResidencyEviction", "ResidencyUse"]


class ResidencyController(ControllerBase):
    """Decides what to evict or spill so a request fits, the same way every time.

    An optional layer over one manager: the caller says what a step needs (a
    `ResidencyRequest`); the controller searches, bounded by ``search_state_limit``, for the
    evictions and spills (per the policy's fallback tiers) that make it fit, builds the plan
    and can run it and borrow the values in one context (`use`) or as a prefetching
    pipeline (`run`). It keeps only per-handle policy metadata and access epochs. See
    docs/concepts/controller.md.

    Args:
        manager: The manager to decide for.
        policy: The eviction policy; `DeterministicTieredLRU` without tiers by default.
        search_state_limit: The most search states `decide` explores before giving up
            (a strict int > 0). The search's depth and memory are bounded whatever it is
            (docs/concepts/controller.md#search-bounds).

    Raises:
        TypeError: ``manager`` is not a `ResidencyManager`; ``policy`` does not implement
            `ResidencyPolicy`; ``policy.name`` or ``search_state_limit`` of the wrong kind.
        ValueError: A blank policy name, or ``search_state_limit <= 0``.

    Example:
        ```python
        import torch
        from fhelium.residency import (
            PAGEABLE_HOST, PINNED_HOST, DeterministicTieredLRU, ReplicaMode,
            ResidencyController, ResidencyManager, ResidencyRequest, ResidencyRequirement,
        )
        from fhelium.residency.simulation import SimulatedRuntime, use_runtime
        from fhelium.values import ResidentTensor

        with use_runtime(SimulatedRuntime(device_count=0)), ResidencyManager(
            {PINNED_HOST: 8192}
        ) as manager:
            a, b = (
                manager.adopt(ResidentTensor(torch.ones(1024)), replica_mode=ReplicaMode.REPLICABLE)
                for _ in range(2)
            )
            controller = ResidencyController(
                manager, policy=DeterministicTieredLRU({PINNED_HOST: [PAGEABLE_HOST]})
            )
            for handle in (a, b, a):  # room for one value of 4096 bytes plus headroom
                request = ResidencyRequest("step", [ResidencyRequirement(handle, PINNED_HOST)])
                with controller.use(request) as use:
                    use.value(handle, at=PINNED_HOST)
        ```
    """

    __slots__ = ("_decider",)

    def __init__(
        self,
        manager: ResidencyManager,
        *,
        policy: ResidencyPolicy | None = None,
        search_state_limit: int = 100_000,
    ) -> None:
        require_instance(manager, ResidencyManager, "manager")
        chosen = DeterministicTieredLRU() if policy is None else policy
        if not isinstance(chosen, ResidencyPolicy):
            raise TypeError(
                "policy must implement ResidencyPolicy (name, config_identity, "
                "fallback_locations, order_candidates)"
            )
        require_non_empty_str(chosen.name, "policy.name")
        if require_strict_int(search_state_limit, "search_state_limit") <= 0:
            raise ValueError(f"search_state_limit must be > 0, got {search_state_limit}")
        # Everything the controller keeps, and its decisions (docs/concepts/controller.md).
        self._decider = Decider(manager, chosen, search_state_limit)

    @property
    def manager(self) -> ResidencyManager:
        """The manager the controller decides for."""
        return self._decider.manager

    @property
    def policy(self) -> ResidencyPolicy:
        """The eviction policy."""
        return self._decider.policy

    def __repr__(self) -> str:
        decider = self._decider
        return f"ResidencyController(policy={decider.policy.name!r}, limit={decider.limit})"

    # ------------------------------------------------------------------ metadata

    def set_policy_metadata(
        self, handle: ResidencyHandle[Any], *, priority: int = 0, stable_key: str | None = None
    ) -> None:
        """Set the controller-local eviction metadata of a live handle, replacing any before.

        Metadata does not advance the manager's version and is never pruned. See
        docs/concepts/controller.md#policy-metadata.

        Args:
            handle: A live handle of the controller's manager.
            priority: A strict int of any sign; a higher priority is kept longer.
            stable_key: ``None`` or a non-empty string, unique among this controller's handles.

        Raises:
            TypeError: ``priority`` is not a strict int, or ``stable_key`` not a string.
            ValueError: A blank ``stable_key``, or one another handle already holds.
            ResidencyHandleError: ``handle`` is not a live, non-discarded handle of the manager
                (any other object included).
            ResidencyClosedError: The manager is closed.
            ResidencyReentrancyError: A source callback of the manager is running.
        """
        self._decider.set_metadata(handle, ResidencyPolicyMetadata(priority, stable_key))

    # ------------------------------------------------------------------ decide

    def decide(self, request: ResidencyRequest) -> ResidencyDecision:
        """Plan a request against the current state; change nothing.

        The search finds the reclaim (evictions and spills) and enter actions that satisfy the
        request, under one hold of the manager, and explains the plan at the version it read.
        It runs no transition, takes no lease and never calls a source. A satisfied request gives
        an empty plan. See docs/concepts/controller.md#decide.

        Args:
            request: What must be resident where, and the reservations to hold.

        Returns:
            The decision: the plan (without exit actions), its evictions and explanation, bound
            to the manager and version it was made against.

        Raises:
            TypeError: ``request`` is not a `ResidencyRequest`.
            ResidencyHandleError: A requirement's handle is foreign, unknown or discarded.
            ResidencyOwnershipError: An EXCLUSIVE value is required at several locations.
            ResidencySearchLimitError: The search reached ``search_state_limit``, its depth
                bound or its memo's memory bound without a verdict (``bound`` says which).
            ResidencyPlanError: The request is infeasible, or its plan's explanation is not
                feasible (an unusable CUDA location, say).
            ResidencyClosedError: The manager is closed.
            ResidencyReentrancyError: A source callback of the manager is running.
            RuntimeError: The policy's ``order_candidates`` did not return each candidate
                exactly once.

        Example:
            ```python
            import torch
            from fhelium.residency import (
                PAGEABLE_HOST, ResidencyController, ResidencyManager, ResidencyRequest,
                ResidencyRequirement,
            )
            from fhelium.values import ResidentTensor

            with ResidencyManager() as manager:
                handle = manager.adopt(ResidentTensor(torch.ones(4)))
                controller = ResidencyController(manager)
                request = ResidencyRequest("noop", [ResidencyRequirement(handle, PAGEABLE_HOST)])
                decision = controller.decide(request)
                assert decision.plan.enter == () and decision.evictions == ()
                with controller.scope(decision):
                    pass
            ```
        """
        require_instance(request, ResidencyRequest, "request")
        return self._decider.decide(request)

    # ------------------------------------------------------------------ scope and use

    def scope(
        self,
        decision: ResidencyDecision,
        *,
        transfer_streams: Mapping[ResidencyLocation, Any] | None = None,
    ) -> ResidencyScope:
        """Build the manager scope of a decision's plan, stale-checked at entry.

        Needs no manager state. A decision made stale by any change since it was decided raises
        `ResidencyStaleStateError` at scope entry, before any reclaim or reservation; it is never
        silently planned again. See docs/concepts/controller.md#scope-of-a-decision.

        Args:
            decision: A decision of this controller's manager and policy.
            transfer_streams: CUDA streams by destination location, as for
                `ResidencyManager.scope`.

        Returns:
            The scope, not yet entered.

        Raises:
            TypeError: ``decision`` is not a `ResidencyDecision`, or ``transfer_streams`` not a
                mapping.
            ResidencyHandleError: The decision was made for another manager.
            ResidencyPlanError: The decision was made by another policy name or configuration.
        """
        require_instance(decision, ResidencyDecision, "decision")
        manager = self._decider.manager
        if decision.manager_id != manager.manager_id:
            raise ResidencyHandleError(
                f"the decision was made for manager {decision.manager_id!r}, "
                f"not {manager.manager_id!r}"
            )
        policy = self._decider.policy
        if decision.policy_name != policy.name or decision.policy_config != tuple(
            policy.config_identity
        ):
            raise ResidencyPlanError(
                f"the decision was made by policy {decision.policy_name!r} with another "
                "configuration; decide again"
            )
        return manager.scope(
            decision.plan,
            expected_state_version=decision.expected_state_version,
            transfer_streams=transfer_streams,
        )

    def use(
        self,
        request: ResidencyRequest,
        *,
        consumer_streams: Mapping[ResidencyLocation, Any] | None = None,
        transfer_streams: Mapping[ResidencyLocation, Any] | None = None,
    ) -> ResidencyUse:
        """Decide, enter the scope and borrow the required values, as one context.

        Entering the returned `ResidencyUse` decides the request, enters the decision's scope
        and acquires the values by location under one hold of the manager, and records access
        epochs; a decision another thread made stale first is decided again (up to 64 times,
        then `ResidencyStaleStateError`); any failure unwinds what was entered. Exit releases
        the leases (``wait=False``) and closes the scope; the values stay cached where they
        are. See docs/concepts/controller.md#use.

        Args:
            request: What must be resident where.
            consumer_streams: The stream that reads the values, for exactly each CUDA location
                among the requirements; ``None`` for a host-only request.
            transfer_streams: CUDA streams by destination location for the copies.

        Returns:
            The use, not yet entered.

        Raises:
            TypeError: ``request`` is not a `ResidencyRequest`; a stream mapping is not a
                mapping, or has a non-location key or a non-stream value.
            ValueError: A host key, a stream on another device, or ``consumer_streams`` keys that
                are not exactly the request's CUDA locations.

        Example:
            ```python
            import torch
            from fhelium.residency import (
                ResidencyController, ResidencyManager, ResidencyRequest, ResidencyRequirement,
                cuda_location,
            )
            from fhelium.residency.simulation import SimulatedRuntime, use_runtime
            from fhelium.values import ResidentTensor

            runtime = SimulatedRuntime(device_count=1)
            gpu = cuda_location("cuda:0")
            with use_runtime(runtime), ResidencyManager({gpu: 1 << 20}) as manager:
                handle = manager.adopt(ResidentTensor(torch.ones(256)))
                controller = ResidencyController(manager)
                stream = runtime.current_stream(gpu.device)
                request = ResidencyRequest("step", [ResidencyRequirement(handle, gpu)])
                with controller.use(request, consumer_streams={gpu: stream}) as use:
                    value = use.value(handle, at=gpu)
                assert use.report is not None
            ```
        """
        return ResidencyUse(
            controller=self,
            request=request,
            consumer_streams=consumer_streams,
            transfer_streams=transfer_streams,
        )

    def run(
        self,
        requests: Iterable[ResidencyRequest],
        *,
        prefetch: int = 0,
        consumer_streams: Mapping[ResidencyLocation, Any] | None = None,
        transfer_streams: Mapping[ResidencyLocation, Any] | None = None,
    ) -> ResidencyPipeline:
        """Use ``requests`` in order, one step at a time, prefetching the next ``prefetch`` steps.

        Each step is an entered `ResidencyUse`, active until the next step is requested; copies
        for later steps run while the current one computes, with every byte charged before it is
        copied. See docs/concepts/controller.md#prefetch.

        Args:
            requests: Any iterable of `ResidencyRequest`, read lazily, at most ``prefetch + 1``
                ahead.
            prefetch: How many later steps to stage while a step runs (a strict int >= 0); 0 is a
                plain `use` per request.
            consumer_streams: The reading stream per CUDA location, as for `use`.
            transfer_streams: Copy streams per CUDA location; with ``prefetch > 0`` a missing
                one is created once by the runtime.

        Returns:
            The pipeline: an iterator of steps and a context manager.

        Raises:
            TypeError: ``requests`` is a string, a single request or not iterable; ``prefetch``
                is not a strict int; a stream mapping of the wrong kind. (An element that is
                not a request raises `TypeError` naming its index when it is reached.)
            ValueError: A negative ``prefetch``; a host key or a stream on another device.

        Example:
            ```python
            import torch
            from fhelium.residency import (
                PINNED_HOST, ReplicaMode, ResidencyController, ResidencyManager, ResidencyRequest,
                ResidencyRequirement, cuda_location,
            )
            from fhelium.residency.schedule import ScheduleAwarePolicy
            from fhelium.residency.simulation import SimulatedRuntime, Timeline, use_runtime
            from fhelium.values import ResidentTensor

            runtime = SimulatedRuntime(1, timeline=Timeline())
            gpu = cuda_location("cuda:0")
            with use_runtime(runtime), ResidencyManager({gpu: 3 << 16}) as manager:
                layers = [
                    manager.adopt(
                        runtime.pin(ResidentTensor(torch.randn(128, 128))),
                        replica_mode=ReplicaMode.REPLICABLE,
                    )
                    for _ in range(4)
                ]
                requests = [
                    ResidencyRequest(f"layer-{i}", [ResidencyRequirement(layer, gpu)])
                    for i, layer in enumerate(layers)
                ]
                controller = ResidencyController(manager, policy=ScheduleAwarePolicy(requests))
                stream = runtime.current_stream(gpu.device)
                with controller.run(requests, prefetch=1, consumer_streams={gpu: stream}) as steps:
                    for step in steps:
                        runtime.compute(stream, 50e-6)
                runtime.synchronize_device(gpu.device)
            ```
        """
        return ResidencyPipeline(
            self._decider,
            requests,
            prefetch=prefetch,
            consumer_streams=consumer_streams,
            transfer_streams=transfer_streams,
        )


def stable_key_of(controller: ResidencyController, handle: ResidencyHandle[Any]) -> str | None:
    """The stable key ``controller``'s policy metadata gives ``handle``, or ``None``; for
    internal users (the lockstep digests of `fhelium.residency.distributed`)."""
    metadata = controller._decider.metadata_of(handle)
    return None if metadata is None else metadata.stable_key
