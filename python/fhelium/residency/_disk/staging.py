"""The disk tier's staging ring, and the transfers that stream a file through it.

Bytes that come from or go to a CUDA device, and every byte of a store opened with
``direct=True``, pass through a `Staging` ring: two chunks of `CHUNK` bytes, pinned
where the runtime can pin, each guarded by the event of the last copy that used it.
Reading the next chunk from the file (on the ring's I/O thread) overlaps hashing and
copying out the one before, and writing a chunk to the file overlaps hashing and the
device copy of the next (`write_through`, `read_through`). While a pipeline stages a
step (`DiskTier.defer`), a read to a device, or a reconstruction by a source that
``loads_alone`` (`copy_through`), runs whole on the I/O thread, after the ones before
it, and its event is a `StagedEvent`
(docs/concepts/locations-and-budgets.md#staging-and-direct-io); whatever else uses the
ring first waits for them. With direct I/O, memory on a page moves straight between the
file and itself, `STRAIGHT` bytes at a time, and only the rest is staged.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, Final

import torch

from fhelium._core import Checksum
from fhelium.residency._disk.format import (
    ALIGN,
    DiskFile,
    ended_early,
    read_exactly,
    verify,
    write_all,
)

__all__ = [
    "CHUNK",
    "SLOTS",
    "STRAIGHT",
    "Staging",
    "copy_through",
    "pageable",
    "pageable_on_a_page",
    "read_through",
    "write_through",
]

# One staging chunk (a multiple of ALIGN), and how many the ring holds.
CHUNK: Final = 16 << 20
SLOTS: Final = 2
# With direct I/O, memory on a page moves straight between the file and itself in
# pieces this large (a multiple of ALIGN): each is hashed on the caller's thread while
# the ring's I/O thread writes it, or while it reads the next; large pieces keep the
# device's queue deep.
STRAIGHT: Final = 64 << 20


def pageable(nbytes: int) -> torch.Tensor:
    """New pageable memory owned by the process (never a map of a file)."""
    return torch.empty(nbytes, dtype=torch.uint8)


def pageable_on_a_page(nbytes: int) -> torch.Tensor:
    """New pageable memory owned by the process that starts on a page, as direct I/O
    reads straight into (torch's allocator aligns to 64 bytes only, which sends every
    byte through the staging ring and a second copy): an anonymous private map, kept
    alive by the tensor, freed with it."""
    if nbytes < CHUNK:
        return pageable(nbytes)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


class Staging:
    """The disk tier's staging ring: `SLOTS` chunks of `CHUNK` bytes, pinned where the
    runtime can pin (page-aligned pageable memory otherwise), each guarded by the event
    of the last device copy that used it. Made on first use, kept until `close`."""

    __slots__ = (
        "_events",
        "_holders",
        "_io",
        "_jobs",
        "_loose",
        "_pool",
        "_pool_pid",
        "_streams",
        "buffers",
        "next",
        "runtime",
    )

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.buffers: list[torch.Tensor] = []
        self._holders: list[object] = []  # what keeps pageable chunks alive
        self._events: list[Any] = [None] * SLOTS
        # Per slot: the stream of device copies enqueued since it was last sealed.
        self._streams: list[Any] = [None] * SLOTS
        # Per slot: the file read or write the I/O thread runs on it.
        self._io: list[Future[None] | None] = [None] * SLOTS
        self._loose: list[Future[None]] = []
        # Deferred reads the I/O thread runs whole, slots included; they never raise.
        self._jobs: list[Future[None]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self.next = 0

    def _allocate(self) -> None:
        # Pinned memory is page-aligned (the allocators map whole pages), so a slot is
        # exactly CHUNK: asking for CHUNK + ALIGN would make torch's power-of-two pinned
        # allocator hand out twice CHUNK. Only a runtime that returns an unaligned buffer
        # gets one ALIGN bigger, which direct I/O then uses from its first aligned byte.
        try:
            raw = [self.runtime.empty_pinned(CHUNK) for _ in range(SLOTS)]
            raw = [
                r if r.data_ptr() % ALIGN == 0 else self.runtime.empty_pinned(CHUNK + ALIGN)
                for r in raw
            ]
        except RuntimeError:  # no pinning here (a CPU-only build): page-aligned memory
            self._holders = [mmap.mmap(-1, CHUNK) for _ in range(SLOTS)]
            self.buffers = [torch.frombuffer(m, dtype=torch.uint8) for m in self._holders]
            return
        self.buffers = [r[(-r.data_ptr()) % ALIGN :][:CHUNK] for r in raw]

    def take(self) -> int:
        """The next slot, once the device copies that last used it have completed."""
        if not self.buffers:
            self._allocate()
        slot = self.next
        self.next = (slot + 1) % SLOTS
        self.finish_io(slot)
        self.wait(slot)
        return slot

    def submit(self, slot: int | None, inline: bool, work: Callable[..., None], *args: Any) -> None:
        """Runs file I/O ``work(*args)`` on ``slot`` (None: on memory outside the ring)
        on the ring's one I/O thread, in submission order, so the caller can go on
        with the other slot; or at once with ``inline``. The file calls release the
        interpreter, and so do the host copies beside them."""
        if inline:
            work(*args)
            return
        try:
            future = self._executor().submit(work, *args)
        except RuntimeError:  # the interpreter is shutting down: no new threads
            work(*args)
            return
        if slot is None:
            self._loose.append(future)
        else:
            self._io[slot] = future

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None or self._pool_pid != os.getpid():
            # A forked child inherits the pool but not its thread: it makes its own.
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="fhelium-disk-io")
            self._pool_pid = os.getpid()
            self._jobs = []
        return self._pool

    def defer(self, job: Callable[[], None]) -> None:
        """Runs ``job`` (a whole deferred read, which uses the slots itself and never
        raises) on the I/O thread after the reads deferred before it; at once where no
        thread can start."""
        self._jobs = [future for future in self._jobs if not future.done()]
        if not self.buffers:
            self._allocate()  # here, not on the I/O thread: pinning may sync
        try:
            self._jobs.append(self._executor().submit(job))
        except RuntimeError:  # the interpreter is shutting down: no new threads
            job()

    def quiesce(self) -> None:
        """Waits for the deferred reads: the caller then has the slots to itself."""
        jobs, self._jobs = self._jobs, []
        # A forked child inherits the parent's jobs, not the thread that runs them.
        if jobs and self._pool_pid == os.getpid():
            wait_futures(jobs)

    def finish_io(self, slot: int | None = None) -> None:
        """Waits for the I/O on ``slot`` (all I/O for None), raising its error."""
        for index in range(SLOTS) if slot is None else (slot,):
            future = self._io[index]
            if future is not None:
                self._io[index] = None
                future.result()
        if slot is None:
            loose, self._loose = self._loose, []
            for future in loose:
                future.result()

    def wait(self, slot: int) -> None:
        """Waits for the device copies recorded on the slot."""
        event = self._events[slot]
        if event is not None:
            self._events[slot] = None
            self.runtime.synchronize_event(event)

    def view(self, slot: int, length: int) -> memoryview:
        return memoryview(self.buffers[slot].numpy())[:length]  # type: ignore[arg-type]

    def fill(self, slot: int, at: int, source: torch.Tensor, stream: Any) -> None:
        """Copies flat bytes ``source`` into the slot at ``at``: on the host for a
        ``stream`` of None, else from the device on ``stream``."""
        self._copy(slot, self.buffers[slot][at : at + int(source.numel())], source, stream)

    def drain(self, slot: int, at: int, target: torch.Tensor, stream: Any) -> None:
        """Copies the slot's bytes from ``at`` into flat ``target``: on the host for a
        ``stream`` of None, else to the device on ``stream``."""
        self._copy(slot, target, self.buffers[slot][at : at + int(target.numel())], stream)

    def _copy(
        self, slot: int, destination: torch.Tensor, source: torch.Tensor, stream: Any
    ) -> None:
        if stream is None:
            destination.copy_(source)
            return
        self.runtime.copy_bytes(destination, source, stream)
        self._streams[slot] = stream

    def land(self, slot: int) -> None:
        """`seal` then `wait`: the slot's device copies are done, the host may read it."""
        self.seal(slot)
        self.wait(slot)

    def zero(self, slot: int, begin: int, end: int) -> None:
        self.buffers[slot][begin:end].zero_()

    def seal(self, slot: int) -> Any:
        """Ends a round of device copies with the slot: records the event that guards
        it (returned; None when it had none). `take` and `wait` wait for it."""
        copied_on = self._streams[slot]
        if copied_on is None:
            return None
        self._streams[slot] = None
        event = self._events[slot] = self.runtime.record_event(copied_on)
        return event

    def settle(self) -> None:
        """Waits for every copy and file operation still using a slot (after a
        failure, and at close)."""
        futures = [future for future in self._io if future is not None] + self._loose
        self._io = [None] * SLOTS
        self._loose = []
        if futures:
            wait_futures(futures)  # their errors were, or will be, raised by their owner
        for slot in range(SLOTS):
            stream = self._streams[slot]
            self._streams[slot] = None
            if stream is not None:
                self.runtime.synchronize_stream(stream)
            self.wait(slot)

    def close(self) -> None:
        """`settle`, then ends the I/O thread."""
        try:
            self.quiesce()
            self.settle()
        finally:
            pool, self._pool = self._pool, None
            if pool is not None and self._pool_pid == os.getpid():
                pool.shutdown(wait=True)

    def settle_after(self, error: BaseException) -> None:
        """`settle` on a failure path: a failure to wait becomes a note on ``error``."""
        try:
            self.settle()
        except Exception as cleanup:
            error.add_note(
                f"waiting for the disk tier's staging copies after the failure also failed: "
                f"{cleanup!r}"
            )


def copy_through(
    staging: Staging, tensors: tuple[torch.Tensor, ...], buffers: list[torch.Tensor], stream: Any
) -> Any:
    """Copies host ``tensors`` into device ``buffers`` (flat bytes, one each) through
    the ring, a chunk at a time on ``stream``, on the thread that calls it; the event
    of the last copy (None when none was made). On a failure the copies made are
    waited for before it raises."""
    last = None
    try:
        for tensor, buffer in zip(tensors, buffers, strict=True):
            flat = tensor.contiguous().reshape(-1).view(torch.uint8)
            for begin in range(0, int(flat.numel()), CHUNK):
                piece = flat[begin : begin + CHUNK]
                slot = staging.take()
                staging.fill(slot, 0, piece, None)
                staging.drain(slot, 0, buffer[begin : begin + int(piece.numel())], stream)
                event = staging.seal(slot)
                last = event if event is not None else last
    except BaseException as error:
        staging.settle_after(error)
        raise
    return last


def write_through(
    staging: Staging,
    descriptor: int,
    direct: bool,
    prefix: bytes,
    blobs: list[torch.Tensor],
    hashers: list[Checksum],
    device: torch.device | None,
) -> int:
    """Writes ``prefix`` and ``blobs`` (on CUDA ``device``, or on the host for None)
    to the new file open as ``descriptor`` through ``staging``, a chunk at a time:
    while the ring's I/O thread hashes one slot's bytes (into ``hashers``, one per
    blob) and writes them to the file, the next is filled (from the device, or by a
    host copy)."""
    stream = None if device is None else staging.runtime.current_stream(device)
    try:
        total = len(prefix) + sum(int(blob.numel()) for blob in blobs)
        inline = total <= CHUNK  # one chunk: nothing to overlap
        slot, fill = staging.take(), 0
        # (checksum, begin, length) of each blob's bytes in the slot being filled.
        pieces: list[tuple[Checksum, int, int]] = []

        def flush() -> None:
            """Hashes the slot's ``fill`` bytes, hands them to the I/O thread (which
            writes them while the next slot fills) and takes the next slot."""
            nonlocal slot, fill, pieces
            staging.land(slot)
            view = staging.view(slot, fill)
            for hasher, begin, length in pieces:
                hasher.update(view[begin : begin + length])
            staging.submit(slot, inline, write_all, descriptor, view)
            slot, fill, pieces = staging.take(), 0, []

        header = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
        segments: list[tuple[torch.Tensor, Any, Checksum | None]] = [
            (header, None, None),
            *((blob, stream, hasher) for blob, hasher in zip(blobs, hashers, strict=True)),
        ]
        for segment, copy_stream, hasher in segments:
            position, length = 0, int(segment.numel())
            if (
                direct
                and copy_stream is None
                and fill % ALIGN == 0
                and length >= ALIGN
                and segment.data_ptr() % ALIGN == 0
            ):
                # Host memory on a page (pinned memory is), at a page of the file:
                # its whole pages are written straight from it, in order on the
                # I/O thread, after what the slot holds; only its tail is staged.
                if fill:
                    flush()
                position = length - length % ALIGN
                straight = memoryview(segment.numpy())[:position]  # type: ignore[arg-type]
                for at in range(0, position, STRAIGHT):
                    piece = straight[at : at + STRAIGHT]
                    staging.submit(None, inline, write_all, descriptor, piece)
                    if hasher is not None:  # while the I/O thread writes it
                        hasher.update(piece)
            while position < length:
                step = min(CHUNK - fill, length - position)
                staging.fill(slot, fill, segment[position : position + step], copy_stream)
                if hasher is not None:
                    pieces.append((hasher, fill, step))
                fill += step
                position += step
                if fill == CHUNK:
                    flush()
        staging.land(slot)
        if fill:
            padded = fill + (-fill % ALIGN) if direct else fill
            staging.zero(slot, fill, padded)
            view = staging.view(slot, padded)
            for hasher, begin, length in pieces:
                hasher.update(view[begin : begin + length])
            staging.submit(slot, inline, write_all, descriptor, view)
        staging.finish_io()
        if direct:
            os.ftruncate(descriptor, total)
        return total
    except BaseException as error:
        staging.settle_after(error)
        raise


def read_through(
    staging: Staging,
    descriptor: int,
    direct: bool,
    file: DiskFile,
    buffers: list[torch.Tensor],
    stream: Any = None,
    *,
    hashers: list[Checksum] | None = None,
    inline: bool = False,
) -> Any:
    """Reads the file's data into ``buffers`` (one per storage, host or CUDA),
    hashing each storage's bytes into ``hashers`` as they arrive and checking them
    at the end (None: no check).

    With direct I/O, a host buffer that starts on a page, for a storage that starts
    on a page of the file (the first storage always does), is read into straight
    from the file for all its whole pages. Everything else goes through
    ``staging``, a chunk at a time: while one slot's bytes are copied out (CUDA
    copies enqueued on ``stream``), the ring's I/O thread reads the next chunk into
    the other and hashes it. With ``inline`` (on the I/O thread itself) every read
    runs on the calling thread, while the device copies of the chunk before run.
    Returns the event of the last device copy (None when none was made). The caller
    opens ``descriptor`` (with ``direct`` I/O or not) and closes it."""
    path = file.path
    last = None

    try:
        # (offset in the data, length, flat target, storage index) of each byte
        # range to stage.
        spans: list[tuple[int, int, torch.Tensor, int]] = []
        for index, ((start, size), buffer) in enumerate(zip(file.storages, buffers, strict=True)):
            whole = size - size % ALIGN if direct and stream is None else 0
            if whole and (file.data_start + start) % ALIGN == 0 and buffer.data_ptr() % ALIGN == 0:
                view = memoryview(buffer.numpy())[:whole]  # type: ignore[arg-type]
                at = file.data_start + start
                if hashers is None:  # nothing to overlap: one read
                    read_exactly(descriptor, view, at, path)
                else:
                    # A piece at a time on the I/O thread, each hashed here while
                    # the next is read.
                    pieces = [view[i : i + STRAIGHT] for i in range(0, whole, STRAIGHT)]
                    alone = len(pieces) == 1
                    staging.submit(None, alone, read_exactly, descriptor, pieces[0], at, path)
                    for number, piece in enumerate(pieces):
                        staging.finish_io()
                        if number + 1 < len(pieces):
                            after = pieces[number + 1]
                            where = at + (number + 1) * STRAIGHT
                            staging.submit(
                                None, alone, read_exactly, descriptor, after, where, path
                            )
                        hashers[index].update(piece)
                spans.append((start + whole, size - whole, buffer[whole:], index))
            else:
                spans.append((start, size, buffer, index))
        # The chunks that cover the spans, each starting on a page and at most CHUNK
        # long; a span starting within a chunk's reach extends that chunk.
        chunks: list[tuple[int, int]] = []
        for offset, length, _, _ in spans:
            end = offset + length
            if not length:
                continue
            begin = offset - offset % ALIGN
            if chunks and begin < chunks[-1][0] + CHUNK:
                previous, reach = chunks[-1]
                chunks[-1] = (previous, max(reach, min(CHUNK, end - previous)))
                begin = previous + CHUNK
            while begin < end:
                chunks.append((begin, min(CHUNK, end - begin)))
                begin += CHUNK

        def read(slot: int, begin: int, step: int) -> None:
            want = step + (-step % ALIGN) if direct else step
            got = os.preadv(descriptor, [staging.view(slot, want)], file.data_start + begin)
            if got < step:
                raise ended_early(path)

        inline = inline or len(chunks) <= 1
        slot = staging.take()
        if chunks:
            staging.submit(slot, inline, read, slot, *chunks[0])
        for position, (begin, step) in enumerate(chunks):
            staging.finish_io(slot)
            following = -1
            if position + 1 < len(chunks):
                following = staging.take()
                staging.submit(following, inline, read, following, *chunks[position + 1])
            # The chunk is here: each storage's part of it is hashed (chunks come in
            # order, so each checksum gets its bytes in order) while the I/O
            # thread reads the next, then copied out.
            chunk = staging.view(slot, step)
            for offset, length, target, index in spans:
                low, high = max(offset, begin), min(offset + length, begin + step)
                if low < high:
                    if hashers is not None:
                        hashers[index].update(chunk[low - begin : high - begin])
                    staging.drain(slot, low - begin, target[low - offset : high - offset], stream)
            event = staging.seal(slot)
            last = event if event is not None else last
            slot = following
        verify(file, hashers)
        return last
    except BaseException as error:
        staging.settle_after(error)
        raise
