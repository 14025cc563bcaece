"""Every public name carries a Google-style docstring that stands on its own.

The API reference is generated from these docstrings (mkdocstrings, ``docstring_style:
google``), so the checks here are what keeps it complete and well formed:

- every public class, function, method, property and exception has a summary line;
- section headers are the Google ones (`Args:`, `Returns:`, `Raises:`, `Example:`,
  `Attributes:`), alone on their line, so a misspelt header cannot slip through as prose;
- every parameter of a signature is in `Args:`, and `Args:` names nothing else;
- every public function and method has `Raises:`, except the few in `RAISES_NOTHING`;
  a property needs one when its getter raises itself;
- every entry of `Raises:` names an exception class that exists;
- a function returning something has `Returns:` (or `Yields:`);
- every field of a record, named tuple or enum is in its class's `Attributes:`;
- the main entry points have an `Example:`, and every `python` block of an example runs.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import dataclasses
import enum
import importlib
import inspect
import itertools
import re
import textwrap
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

import fhelium.errors
from helpers.public_surface import (
    PublicMember,
    PublicName,
    is_field,
    member_callable,
    public_members,
    public_modules,
    public_names,
)

ALLOWED_HEADERS = {"Args", "Attributes", "Example", "Note", "Raises", "Returns", "Yields"}

# Functions and methods that raise nothing a caller could meet: they only read or reset
# state the object owns, with no argument to check and no seam call that a fault could be
# injected into. Everything else public has a `Raises:` section.
RAISES_NOTHING = {
    # reads of the simulated clock and bookkeeping that only touch the runtime's own state
    "fhelium.residency.simulation.Timeline.reset",
    "fhelium.residency.simulation.current_runtime",
    "fhelium.residency.simulation.SimulatedEvent.complete",
    "fhelium.residency.simulation.SimulatedRuntime.clear_faults",
    "fhelium.residency.simulation.SimulatedRuntime.complete_events",
    "fhelium.residency.simulation.SimulatedRuntime.current_device",
    "fhelium.residency.simulation.SimulatedRuntime.pending_event_count",
}

# The entry points a reader starts from: each shows a runnable example.
NEEDS_EXAMPLE = {
    "fhelium.residency.ResidencyManager",
    "fhelium.residency.ResidencyManager.adopt",
    "fhelium.residency.ResidencyManager.register_source",
    "fhelium.residency.ResidencyManager.ensure",
    "fhelium.residency.ResidencyManager.copy",
    "fhelium.residency.ResidencyManager.move",
    "fhelium.residency.ResidencyManager.drop",
    "fhelium.residency.ResidencyManager.discard",
    "fhelium.residency.ResidencyManager.execute_actions",
    "fhelium.residency.ResidencyManager.explain",
    "fhelium.residency.ResidencyManager.scope",
    "fhelium.residency.ResidencyManager.acquire",
    "fhelium.residency.ResidencyManager.hold",
    "fhelium.residency.ResidencyManager.reserve",
    "fhelium.residency.ResidencyManager.snapshot",
    "fhelium.residency.ResidencyManager.trace",
    "fhelium.residency.ResidencyController",
    "fhelium.residency.ResidencyController.decide",
    "fhelium.residency.ResidencyController.use",
    "fhelium.residency.ResidencyController.run",
    "fhelium.residency.ResidencyPlan",
    "fhelium.residency.disk.disk_location",
    "fhelium.residency.simulation.SimulatedRuntime",
    "fhelium.residency.simulation.use_runtime",
    "fhelium.residency.export.trace_events",
    "fhelium.residency.export.write_trace",
    "fhelium.residency.distributed.rank_manager",
    "fhelium.residency.distributed.check_lockstep",
    "fhelium.residency.distributed.broadcast",
}

_HEADER = re.compile(r"^([A-Z][A-Za-z]*):\s*$")
_ITEM = re.compile(r"^(\*{0,2}[A-Za-z_][\w.]*)(?: \([^)]*\))?:(?: |$)")
_FENCE = re.compile(r"```python\n(.*?)```", re.S)


def parse(doc: str) -> tuple[str, dict[str, str]]:
    """Split a cleaned docstring into its summary line and its sections, by header."""
    lines = doc.splitlines()
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in lines[1:]:
        match = _HEADER.match(line)
        if match:
            current = sections.setdefault(match.group(1), [])
            continue
        if current is not None:
            if line and not line.startswith(" "):
                current = None  # back to prose at the base indentation
            else:
                current.append(line)
    return lines[0] if lines else "", {
        header: textwrap.dedent("\n".join(body)) for header, body in sections.items()
    }


def headers(doc: str) -> list[str]:
    return [m.group(1) for line in doc.splitlines() if (m := _HEADER.match(line))]


def items(section: str) -> list[str]:
    """The names a section documents: its lines at the section's own indentation."""
    return [
        m.group(1)
        for line in section.splitlines()
        if line and not line.startswith(" ") and (m := _ITEM.match(line))
    ]


def parameters(function: Any) -> list[str]:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return []
    return [
        name
        for name, parameter in signature.parameters.items()
        if name not in {"self", "cls"}
        and parameter.kind not in {parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD}
    ]


def var_parameters(function: Any) -> set[str]:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return set()
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return {
        stars[parameter.kind] + name
        for name, parameter in signature.parameters.items()
        if parameter.kind in stars
    }


def raises_itself(function: Any) -> bool:
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return False
    return any(isinstance(node, ast.Raise) for node in ast.walk(ast.parse(source)))


def resolves_to_exception(name: str) -> bool:
    candidates: list[Any] = [getattr(builtins, name, None), getattr(fhelium.errors, name, None)]
    if "." in name:
        module, _, attribute = name.rpartition(".")
        with contextlib.suppress(ImportError):
            candidates.append(getattr(importlib.import_module(module), attribute, None))
    return any(inspect.isclass(c) and issubclass(c, BaseException) for c in candidates)


def record_fields(cls: type) -> list[str]:
    if dataclasses.is_dataclass(cls):
        return [field.name for field in dataclasses.fields(cls)]
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return list(cls._fields)
    if issubclass(cls, enum.Enum):
        return [member.name for member in cls]
    return []


# -- what is checked -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
    qualname: str
    obj: Any  # what carries the docstring
    kind: str  # "class", "function", "method", "property"
    owner: type | None = None


def targets() -> Iterator[Target]:
    for entry in public_names():
        if inspect.isclass(entry.obj):
            yield Target(entry.qualname, entry.obj, "class")
            for member in public_members(entry.obj):
                function = member_callable(member)
                if function is None:
                    continue
                kind = "property" if isinstance(member.raw, property) else "method"
                yield Target(_member_name(entry, member), function, kind, entry.obj)
        elif inspect.isfunction(entry.obj):
            yield Target(entry.qualname, entry.obj, "function")


def _member_name(entry: PublicName, member: PublicMember) -> str:
    return f"{entry.qualname}.{member.name}"


TARGETS = list(targets())
IDS = [target.qualname for target in TARGETS]


def docstring(target: Target) -> str:
    doc = target.obj.__doc__
    assert isinstance(doc, str), f"{target.qualname} has no docstring"
    return inspect.cleandoc(doc)


@pytest.mark.parametrize("target", TARGETS, ids=IDS)
def test_has_a_summary(target: Target) -> None:
    summary, _ = parse(docstring(target))
    assert len(summary.split()) >= 3, f"{target.qualname}: summary {summary!r} is too thin"
    assert summary.rstrip().endswith((".", ":")) or target.kind == "property", summary


@pytest.mark.parametrize("target", TARGETS, ids=IDS)
def test_headers_are_google_sections(target: Target) -> None:
    found = headers(docstring(target))
    unknown = [header for header in found if header not in ALLOWED_HEADERS]
    assert not unknown, f"{target.qualname}: unknown section headers {unknown}"
    assert len(found) == len(set(found)), f"{target.qualname}: a section appears twice"


@pytest.mark.parametrize("target", TARGETS, ids=IDS)
def test_every_parameter_is_documented(target: Target) -> None:
    doc = docstring(target)
    _, sections = parse(doc)
    if target.kind == "property":
        return
    documented = items(sections.get("Args", ""))
    if target.kind == "class":
        expected = parameters(target.obj) if _constructed_by_users(target.obj) else []
        documented += items(sections.get("Attributes", ""))
        function: Any = target.obj
    else:
        expected = parameters(target.obj)
        function = target.obj
    missing = [name for name in expected if name not in documented]
    assert not missing, f"{target.qualname}: parameters missing from Args: {missing}"
    if target.kind != "class":
        stale = set(items(sections.get("Args", ""))) - set(expected) - var_parameters(function)
        assert not stale, f"{target.qualname}: Args names no such parameter: {sorted(stale)}"


def _constructed_by_users(cls: type) -> bool:
    """Handed-out objects (leases, holds, borrowed values, uses, pipelines) are made by the library
    only, and an enum's call signature is the Enum machinery's, not a constructor."""
    if issubclass(cls, enum.Enum):
        return False
    return "constructed by the " not in (cls.__doc__ or "").lower()


@pytest.mark.parametrize("target", TARGETS, ids=IDS)
def test_raises_is_documented(target: Target) -> None:
    _, sections = parse(docstring(target))
    if target.kind in {"function", "method"}:
        if target.qualname in RAISES_NOTHING:
            return
        assert "Raises" in sections, f"{target.qualname} documents no Raises: section"
    elif target.kind == "property" and raises_itself(target.obj):
        assert "Raises" in sections, f"{target.qualname} raises but documents no Raises:"


@pytest.mark.parametrize("target", TARGETS, ids=IDS)
def test_raises_names_real_exceptions(target: Target) -> None:
    _, sections = parse(docstring(target))
    for name in items(sections.get("Raises", "")):
        assert resolves_to_exception(name), f"{target.qualname}: {name} is not an exception"


@pytest.mark.parametrize("target", TARGETS, ids=IDS)
def test_returns_is_documented(target: Target) -> None:
    if target.kind not in {"function", "method"}:
        return
    annotation = inspect.signature(target.obj).return_annotation
    if annotation in {None, "None", inspect.Signature.empty}:
        return
    _, sections = parse(docstring(target))
    assert "Returns" in sections or "Yields" in sections, f"{target.qualname}: no Returns:"


@pytest.mark.parametrize(
    "target", [t for t in TARGETS if t.kind == "class"], ids=lambda t: t.qualname
)
def test_record_fields_are_attributes(target: Target) -> None:
    _, sections = parse(docstring(target))
    documented = set(items(sections.get("Attributes", "")))
    fields = record_fields(target.obj)
    fields += [
        member.name
        for member in public_members(target.obj)
        if is_field(member) and not isinstance(member.raw, (int, str, float))
    ]
    missing = sorted(set(fields) - documented)
    assert not missing, f"{target.qualname}: fields missing from Attributes: {missing}"


def test_entry_points_have_examples() -> None:
    by_name = {target.qualname: target for target in TARGETS}
    assert set(by_name) >= NEEDS_EXAMPLE, sorted(NEEDS_EXAMPLE - set(by_name))
    missing = [
        name
        for name in sorted(NEEDS_EXAMPLE)
        if "Example" not in parse(docstring(by_name[name]))[1]
    ]
    assert not missing, f"no Example: section in {missing}"


def test_allowlist_names_exist() -> None:
    names = {target.qualname for target in TARGETS}
    assert names >= RAISES_NOTHING, sorted(RAISES_NOTHING - names)


EXAMPLES = [
    pytest.param(block, id=f"{target.qualname}#{index}")
    for target in TARGETS
    for index, block in enumerate(
        _FENCE.findall(parse(docstring(target))[1].get("Example", "")) if target.obj.__doc__ else []
    )
]


@pytest.mark.parametrize("block", EXAMPLES)
def test_examples_run(block: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "__docstring_example__"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec(compile(block, "<docstring example>", "exec"), namespace)


# -- module-level constants and type aliases -------------------------------------------


def _attribute_docstrings(module: Any) -> set[str]:
    """Names assigned at module level and followed by a string literal (PEP 257 style)."""
    tree = ast.parse(inspect.getsource(module))
    documented: set[str] = set()
    body = tree.body
    for node, following in itertools.pairwise(body):
        if not (
            isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            continue
        if isinstance(node, ast.Assign):
            documented |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            documented.add(node.target.id)
    return documented


CONSTANTS = [
    entry
    for entry in public_names()
    if not inspect.isclass(entry.obj) and not inspect.isfunction(entry.obj)
]


@pytest.mark.parametrize("entry", CONSTANTS, ids=lambda entry: entry.qualname)
def test_constants_and_aliases_are_documented(entry: PublicName) -> None:
    defining = _defining_module(entry)
    assert entry.name in _attribute_docstrings(defining), (
        f"{entry.qualname}: no docstring after its assignment in {defining.__name__}"
    )


def _defining_module(entry: PublicName) -> Any:
    for module in public_modules():
        for node in ast.parse(inspect.getsource(module)).body:
            if isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            else:
                continue
            if entry.name in names:
                return module
    raise AssertionError(f"{entry.qualname} is not assigned in any public module")


# -- the checker itself ----------------------------------------------------------------


def test_parser_reads_google_sections() -> None:
    doc = inspect.cleandoc(
        """Do a thing.

        Longer text.

        Args:
            first: The first.
            second (int): The second,
                on two lines.

        Raises:
            ValueError: When bad.

        Example:
            ```python
            x = 1
            ```
        """
    )
    summary, sections = parse(doc)
    assert summary == "Do a thing."
    assert items(sections["Args"]) == ["first", "second"]
    assert items(sections["Raises"]) == ["ValueError"]
    assert _FENCE.findall(sections["Example"]) == ["x = 1\n"]


def test_an_undocumented_parameter_fails() -> None:
    def method(self: object, nbytes: int, *, label: str) -> None:
        """Reserve bytes.

        Args:
            nbytes: How many.

        Raises:
            ValueError: Never.
        """

    target = Target("example.method", method, "method")
    with pytest.raises(AssertionError, match="label"):
        test_every_parameter_is_documented(target)
