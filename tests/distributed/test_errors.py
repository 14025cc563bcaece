"""The distributed errors (docs/concepts/errors.md): their place in the hierarchy, their
fields and messages, and pickling (they cross process boundaries)."""

from __future__ import annotations

import pickle

from fhelium import errors
from fhelium.errors import (
    ResidencyCollectiveError,
    ResidencyCommunicationError,
    ResidencyDivergenceError,
    ResidencyError,
)


def test_hierarchy_and_exports() -> None:
    assert ResidencyDivergenceError.__bases__ == (ResidencyError,)
    assert ResidencyCollectiveError.__bases__ == (ResidencyError,)
    assert ResidencyCommunicationError.__bases__ == (ResidencyCollectiveError,)
    for cls in (ResidencyDivergenceError, ResidencyCollectiveError, ResidencyCommunicationError):
        assert cls.__name__ in errors.__all__
        assert issubclass(cls, RuntimeError)


def test_fields_messages_and_pickling() -> None:
    divergence = ResidencyDivergenceError(
        request_name="step-3",
        rank=2,
        reference_rank=0,
        action_index=1,
        expected="enter ensure #1 at rank-device",
        actual="enter ensure #2 at rank-device",
    )
    assert "rank=2 differs from reference_rank=0 action_index=1" in str(divergence)
    header = ResidencyDivergenceError(
        request_name="s", rank=1, reference_rank=0, action_index=None, expected="a", actual="b"
    )
    assert "before any action" in str(header)
    collective = ResidencyCollectiveError(
        operation="broadcast", phase="admission", failed_ranks=(1, 3), details=("x", "y")
    )
    assert "failed_ranks=[1, 3]: rank 1: x; rank 3: y" in str(collective)
    communication = ResidencyCommunicationError(
        operation="gather", phase="transfer", detail="RuntimeError: Timed out"
    )
    assert communication.failed_ranks == ()
    assert communication.details == ("RuntimeError: Timed out",)
    assert "phase 'transfer'" in str(communication)
    for error in (divergence, header, collective, communication):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error)
        assert str(copy) == str(error)
        assert copy.__dict__ == error.__dict__
