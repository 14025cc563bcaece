"""Residency across ranks under `torch.distributed`: one manager per rank.

`rank_manager` builds this rank's manager on its own device (``cuda:{LOCAL_RANK}``, or
a simulated ``cuda:0`` on a machine without CUDA). `LockstepChecker` and
`check_lockstep` prove that SPMD ranks make the same residency decisions: each
decision's digest is all-gathered and a divergence raises `ResidencyDivergenceError`
naming the first rank and the first action that differ. `broadcast`, `scatter` and
`gather` move managed values between the ranks' managers through the process group
(NCCL on GPUs, gloo on the CPU), all or nothing: each receiving rank admits the bytes
under its own budget first, a collective verdict follows every phase, and a refusal or
failure anywhere makes every rank raise `ResidencyCollectiveError` with nothing left
charged. An interrupt (any ``BaseException``) anywhere in a transfer leaves nothing of
it on that rank and propagates unchanged.

Everything here is collective: every rank of the group calls the same functions in the
same order. See docs/concepts/distributed.md.
"""

# Split by concept (docs/architecture.md#layout): `_ranks` sets up this rank and talks to
# the group, `_lockstep` checks decisions, `_collectives` moves values, over `_layout`.
from fhelium.residency.distributed._collectives import broadcast, gather, scatter
from fhelium.residency.distributed._lockstep import (
    DecisionDigest,
    LockstepChecker,
    check_lockstep,
    decision_digest,
)
from fhelium.residency.distributed._ranks import rank_location, rank_manager

__all__ = [
    "DecisionDigest",
    "LockstepChecker",
    "broadcast",
    "check_lockstep",
    "decision_digest",
    "gather",
    "rank_location",
    "rank_manager",
    "scatter",
]
