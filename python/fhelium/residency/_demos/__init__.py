"""The programs behind `python -m fhelium.residency demo` (the command line is
`fhelium.residency.__main__`): `llama` generates tokens from a Llama-architecture model
through `fhelium.residency.nn.offload`, four ways; `layers` streams layer weights
through a bounded device with the controller, three ways."""
