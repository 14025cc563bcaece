"""A manager belongs to the process that made it (docs/concepts/lifetimes.md#fork).

A process forked while a manager is open (a DataLoader worker, a ``multiprocessing``
fork) gets the manager's memory, and any lock another thread held at the fork, but not
its files, devices or threads. Each test runs a parent script in a child interpreter
(its memory capped) that forks; the fork's refusals, its exit and the parent's values
afterwards are checked here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from helpers.limits import capped_memory

# The parent: a manager with values in memory and on disk, a lease, a hold and a
# reservation, and another thread inside a source's load() (holding the manager) at the
# moment it forks. The forked child runs CHILD and reports; then the parent checks every
# value's bytes and files.
PARENT = textwrap.dedent(
    """
    import json, os, signal, sys, threading
    from pathlib import Path
    import torch
    from fhelium.errors import ResidencyForkedError
    from fhelium.residency import (
        PAGEABLE_HOST, DropResident, EnsureResident, MemoryReservation, Recoverability,
        ReplicaMode, ResidencyController, ResidencyManager, ResidencyPlan, ResidencyRequest,
        ResidencyRequirement, ResidencyValueSpec,
    )
    from fhelium.residency.disk import disk_location
    from fhelium.values import ResidentTensor

    root, mode = Path(sys.argv[1]), sys.argv[2]
    DISK = disk_location(root)
    manager = ResidencyManager({PAGEABLE_HOST: 1 << 20})
    controller = ResidencyController(manager)
    values = [
        manager.adopt(
            ResidentTensor(torch.full((1024,), float(i))), replica_mode=ReplicaMode.REPLICABLE
        )
        for i in range(4)
    ]
    for handle in values[:2]:
        manager.move(handle, DISK)
    lease = manager.acquire([values[3]], at=PAGEABLE_HOST)
    hold = manager.hold([values[2]], at=PAGEABLE_HOST)
    reservation = manager.reserve(PAGEABLE_HOST, 64, label="kept")

    entered, finish = threading.Event(), threading.Event()

    class Slow:
        def load(self):
            entered.set()
            finish.wait()
            return ResidentTensor(torch.zeros(16))

    spec = ResidencyValueSpec(
        ResidentTensor, 64, 64, ReplicaMode.EXCLUSIVE, Recoverability.RECONSTRUCTIBLE
    )
    slow = manager.register_source(spec, Slow())
    worker = threading.Thread(target=manager.ensure, args=(slow, PAGEABLE_HOST))
    worker.start()
    entered.wait()
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    parent = os.getpid()
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(reader)
        CHILD
    os.close(writer)
    with os.fdopen(reader) as pipe:
        report = json.loads(pipe.read() or "{}")
    _, status = os.waitpid(child, 0)
    finish.set()
    worker.join()
    after = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    for index, handle in enumerate(values):
        manager.ensure(handle, PAGEABLE_HOST)
    with manager.acquire(values, at=PAGEABLE_HOST) as borrowed:
        intact = [bool((borrowed[h].tensor == float(i)).all()) for i, h in enumerate(values)]
    lease.release()
    hold.release()
    reservation.release()
    manager.close()
    left = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    print(json.dumps({
        "parent": parent, "status": status, "report": report, "files": files,
        "after": after, "intact": intact, "left": left,
    }))
    """
)

# Every public operation on the inherited manager and its lifetimes, each under an alarm
# so a hang is reported rather than waited for.
REFUSALS = textwrap.dedent(
    """
    def refusal(operation):
        signal.alarm(5)
        try:
            operation()
        except ResidencyForkedError as error:
            return f"forked:{error.owner_pid}:{error.pid}"
        except BaseException as error:
            return f"{type(error).__name__}: {error}"
        finally:
            signal.alarm(0)
        return "ran"

    def hang(*_):
        raise TimeoutError("hung")

    signal.signal(signal.SIGALRM, hang)
    plan = ResidencyPlan("p", enter=[EnsureResident(values[0], PAGEABLE_HOST)])
    request = ResidencyRequest("r", [ResidencyRequirement(values[0], PAGEABLE_HOST)])
    operations = {
        "snapshot": lambda: manager.snapshot(),
        "state_version": lambda: manager.state_version,
        "adopt": lambda: manager.adopt(ResidentTensor(torch.zeros(4))),
        "register_source": lambda: manager.register_source(spec, Slow()),
        "ensure": lambda: manager.ensure(values[0], PAGEABLE_HOST),
        "copy": lambda: manager.copy(values[3], DISK),
        "move": lambda: manager.move(values[1], PAGEABLE_HOST),
        "drop": lambda: manager.drop(values[3], PAGEABLE_HOST),
        "discard": lambda: manager.discard(values[0]),
        "execute_actions": lambda: manager.execute_actions(list(plan.enter)),
        "explain": lambda: manager.explain(plan),
        "scope": lambda: manager.scope(plan).__enter__(),
        "acquire": lambda: manager.acquire([values[3]], at=PAGEABLE_HOST),
        "hold": lambda: manager.hold([values[3]], at=PAGEABLE_HOST),
        "reserve": lambda: manager.reserve(PAGEABLE_HOST, 8, label="child"),
        "trace": lambda: manager.trace(),
        "clear_trace": lambda: manager.clear_trace(),
        "lease.release": lambda: lease.release(),
        "hold.release": lambda: hold.release(),
        "reservation.release": lambda: reservation.release(),
        "decide": lambda: controller.decide(request),
        "set_policy_metadata": lambda: controller.set_policy_metadata(values[0], priority=1),
        "enter": lambda: manager.__enter__(),
        "close": lambda: manager.close(),
        "close(force)": lambda: manager.close(force=True),
    }
    report = {name: refusal(operation) for name, operation in operations.items()}
    """
)


def _run(tmp_path: Path, child: str, mode: str = "") -> dict[str, object]:
    script = PARENT.replace("    CHILD", textwrap.indent(child, "    "))
    completed = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "spill"), mode],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=capped_memory,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert "Traceback" not in completed.stderr, completed.stderr
    result: dict[str, object] = json.loads(completed.stdout.strip().splitlines()[-1])
    return result


def _check_parent(result: dict[str, object]) -> None:
    """The parent lost nothing: its files are as before the fork, every value reads back
    bitwise, and its own close removed every file."""
    assert result["status"] == 0
    assert result["after"] == result["files"]
    assert result["intact"] == [True, True, True, True]
    assert result["left"] == []


def test_every_operation_on_an_inherited_manager_is_refused(tmp_path: Path) -> None:
    child = REFUSALS + textwrap.dedent(
        """
        with os.fdopen(writer, "w") as pipe:
            pipe.write(json.dumps(report))
        os._exit(0)
        """
    )
    result = _run(tmp_path, child)
    parent = result["parent"]
    report = result["report"]
    assert isinstance(report, dict)
    assert len(report) == 25
    wrong = {
        name: outcome
        for name, outcome in report.items()
        if not str(outcome).startswith(f"forked:{parent}:")
    }
    assert wrong == {}
    _check_parent(result)


def test_a_child_that_exits_normally_leaves_the_parent_alone(tmp_path: Path) -> None:
    """The child drops every reference and exits through the interpreter's normal exit:
    its finalizers and exit hooks (leases, holds, reservations, the manager, the disk
    store) run and must neither touch the parent's files nor print a traceback."""
    child = textwrap.dedent(
        """
        with os.fdopen(writer, "w") as pipe:
            pipe.write(json.dumps({"pid": os.getpid()}))
        del lease, hold, reservation, manager, controller, values
        import gc
        gc.collect()
        sys.exit(0)
        """
    )
    result = _run(tmp_path, child, "exit")
    _check_parent(result)


def test_a_new_manager_in_the_child_works_on_the_same_disk_root(tmp_path: Path) -> None:
    """A manager made in the fork is the fork's own: it spills to the same root, reads
    its bytes back, and closes, while the parent's files stay as they were."""
    child = textwrap.dedent(
        """
        import gc
        mine = ResidencyManager({PAGEABLE_HOST: 1 << 20})
        made = [mine.adopt(ResidentTensor(torch.full((1024,), 100.0 + i))) for i in range(3)]
        for handle in made:
            mine.move(handle, DISK)
        for handle in made:
            mine.move(handle, PAGEABLE_HOST)
        with mine.acquire(made, at=PAGEABLE_HOST) as borrowed:
            ok = [bool((borrowed[h].tensor == 100.0 + i).all()) for i, h in enumerate(made)]
        mine.close()
        with os.fdopen(writer, "w") as pipe:
            pipe.write(json.dumps({"ok": ok, "pid": os.getpid()}))
        os._exit(0)
        """
    )
    result = _run(tmp_path, child)
    assert result["report"] == {"ok": [True, True, True], "pid": result["report"]["pid"]}  # type: ignore[index]
    _check_parent(result)


def test_the_refusal_pickles_with_its_fields() -> None:
    import pickle

    from fhelium.errors import ResidencyClosedError, ResidencyForkedError

    error = ResidencyForkedError("owned by 1", owner_pid=1, pid=2)
    copy = pickle.loads(pickle.dumps(error))
    assert isinstance(copy, ResidencyClosedError)
    assert (copy.owner_pid, copy.pid, str(copy)) == (1, 2, "owned by 1")
