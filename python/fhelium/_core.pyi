"""Typing for the compiled extension `fhelium._core` (Rust, PyO3)."""

from typing import Final, NoReturn, final

__all__ = ["__version__", "MAX_CUDA_INDEX", "PlanIR", "error_table_probe", "lower_plan"]

__version__: Final[str]
MAX_CUDA_INDEX: Final[int]

@final
class PlanIR:
    """A plan lowered into the Rust core: immutable, validated, shareable."""

    @property
    def name(self) -> str: ...
    @property
    def handle_count(self) -> int: ...
    @property
    def shape(self) -> tuple[int, int, int, int]: ...
    def action_slots(self) -> list[int]: ...
    def transfer_destinations(self) -> list[int]: ...
    def reserved_by_location(self) -> list[tuple[int, int]]: ...

def lower_plan(
    name: str,
    handles: list[tuple[str, str, int]],
    reclaim: list[tuple[int, int, int, int]],
    enter: list[tuple[int, int, int, int]],
    exit: list[tuple[int, int, int, int]],
    reservations: list[tuple[int, int, str]],
    /,
) -> PlanIR: ...
def error_table_probe(kind: str, /) -> NoReturn: ...
