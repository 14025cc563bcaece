"""The programs behind `python -m fhelium.residency demo` (the command line is
`fhelium.residency.__main__`): `llama` generates tokens from a Llama-architecture model
through `fhelium.residency.nn.offload`, four ways; `layers` streams layer weights
through a bounded device with the controller, three ways."""

__all__ = ["DemoUsageError"]


class DemoUsageError(ValueError):
    """A demo's argument that cannot work (a budget smaller than a unit, say): the command
    line reports it as a usage error, one line, exit status 2."""
