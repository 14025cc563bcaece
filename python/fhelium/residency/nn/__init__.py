"""Run PyTorch modules whose weights do not fit, a unit at a time (see docs/concepts)."""

from fhelium.residency.nn._checkpoint import init_empty_weights

__all__ = ["init_empty_weights"]
