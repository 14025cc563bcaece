"""Pytest fixtures shared by every suite, and the Hypothesis profile.

Helpers that tests import by name live in the `helpers` package beside this file.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings

from fhelium.residency.location import PAGEABLE_HOST, PINNED_HOST, ResidencyLocation, cuda_location
from fhelium.residency.model import ResidencyHandle
from helpers.records import Pair, check_frozen_record, make_handle

# When a Hypothesis test fails, its pytest plugin imports hypothesis.extra._patching, which
# imports libcst, which touches the deprecated mypy_extensions.TypedDict. Under
# filterwarnings = ["error"] that DeprecationWarning turns every Hypothesis failure into an
# INTERNALERROR that aborts the session. Import it once here, with the warning silenced.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    with contextlib.suppress(ImportError):  # libcst is optional for Hypothesis
        import hypothesis.extra._patching  # noqa: F401

settings.register_profile(
    "fhelium",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
settings.load_profile("fhelium")


@pytest.fixture
def frozen_record() -> Callable[[Any, Sequence[str]], None]:
    return check_frozen_record


@pytest.fixture
def handle() -> ResidencyHandle[Any]:
    return make_handle()


@pytest.fixture
def other_handle() -> ResidencyHandle[Any]:
    return make_handle(handle_id="handle-2")


@pytest.fixture
def cuda0() -> ResidencyLocation:
    return cuda_location("cuda:0")


@pytest.fixture
def cuda1() -> ResidencyLocation:
    return cuda_location("cuda:1")


@pytest.fixture
def pageable() -> ResidencyLocation:
    return PAGEABLE_HOST


@pytest.fixture
def pinned() -> ResidencyLocation:
    return PINNED_HOST


@pytest.fixture
def pair() -> Pair:
    return Pair(torch.arange(4, dtype=torch.float32), torch.ones(3, dtype=torch.int64))
