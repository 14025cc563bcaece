"""Real gloo process groups for the distributed suite: `run_ranks` forks one process per
rank, each joins a group through a file rendezvous, runs a function and reports what it
returned or raised. Each rank's address space is capped (`helpers.limits`), so a
runaway rank fails on its own instead of exhausting the machine."""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import pickle
import signal
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from helpers.limits import capped_memory


@dataclass(frozen=True)
class Outcome:
    """What one rank's function returned or raised (``error`` then holds the exception,
    ``trace`` its formatted traceback); ``exit_code`` is the process's."""

    rank: int
    value: Any = None
    error: BaseException | None = None
    trace: str = ""
    exit_code: int | None = None

    def unwrap(self) -> Any:
        if self.error is not None:
            raise AssertionError(f"rank {self.rank} raised:\n{self.trace}") from self.error
        return self.value


def _child(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    rendezvous: str,
    timeout_s: float,
    report: str,
    args: tuple[Any, ...],
) -> None:
    # A forked child inherits the test session's "warnings are errors" filter; the
    # backends warn on their own (shutdown order), which is not what is under test.
    warnings.resetwarnings()
    warnings.simplefilter("ignore")
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    outcome: Outcome
    try:
        capped_memory()
        dist.init_process_group(
            "gloo",
            init_method=rendezvous,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        # Every rank has finished joining before any runs ``fn``: a rank that returns
        # (or exits) at once would otherwise close its side of a connection another
        # rank is still setting up, and that rank would fail to join.
        dist.barrier()
        outcome = Outcome(rank, value=fn(rank, world, *args))
    except BaseException as error:
        try:
            pickle.dumps(error)
            kept: BaseException = error
        except Exception:
            kept = RuntimeError(f"{type(error).__name__}: {error}")
        outcome = Outcome(rank, error=kept, trace=traceback.format_exc())
    try:
        payload = pickle.dumps(outcome)
    except Exception:
        payload = pickle.dumps(Outcome(rank, value=repr(outcome.value)))
    Path(report).write_bytes(payload)
    # Skip interpreter teardown: a peer that is gone can make the backend's destructors
    # wait, and nothing here needs flushing beyond the report.
    os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout_s: float = 20.0,
    deadline_s: float = 60.0,
) -> list[Outcome]:
    """Runs ``fn(rank, world, *args)`` on ``world`` forked ranks of one gloo group whose
    collectives time out after ``timeout_s``; returns each rank's `Outcome`. A rank still
    running after ``deadline_s`` is killed and reported as hung (the test fails)."""
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="fhelium-ranks-") as folder:
        rendezvous = f"file://{folder}/rendezvous"
        reports = [os.path.join(folder, f"rank-{rank}.pkl") for rank in range(world)]
        processes = [
            context.Process(
                target=_child,
                args=(fn, rank, world, rendezvous, timeout_s, reports[rank], args),
                daemon=True,
            )
            for rank in range(world)
        ]
        for process in processes:
            process.start()
        end = time.monotonic() + deadline_s
        hung = []
        for rank, process in enumerate(processes):
            process.join(max(0.0, end - time.monotonic()))
            if process.is_alive():
                hung.append(rank)
        for rank in hung:
            pid = processes[rank].pid
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            processes[rank].join()
        if hung:
            raise AssertionError(f"ranks {hung} still ran after {deadline_s} s (a hang)")
        outcomes = []
        for rank, process in enumerate(processes):
            path = Path(reports[rank])
            if path.exists():
                outcome = pickle.loads(path.read_bytes())
                outcomes.append(
                    Outcome(
                        outcome.rank,
                        outcome.value,
                        outcome.error,
                        outcome.trace,
                        process.exitcode,
                    )
                )
            else:
                outcomes.append(Outcome(rank, exit_code=process.exitcode))
        return outcomes
