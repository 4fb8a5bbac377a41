"""Disk primitives for checkpoints: durable writes, streamed writes and verified reads.

This module is the only place that issues write/fsync/rename on checkpoint data. Large files are
written in big sequential chunks straight from memory (no pickling); each chunk's CRC-32 is computed
on a helper thread while the next chunk is written (zlib and os.write both release the GIL), and
writeback is started per chunk (`sync_file_range`, Linux) so the final fsync has little left to do
and written data leaves the page cache instead of crowding out training memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
import shutil
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .errors import CheckpointError, CorruptCheckpointError

DEFAULT_CHUNK_BYTES = 64 << 20

_SYNC_FILE_RANGE_WAIT_BEFORE = 1
_SYNC_FILE_RANGE_WRITE = 2
_SYNC_FILE_RANGE_WAIT_AFTER = 4


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def _start_writeback(fd: int, offset: int, length: int) -> None:
    if _sync_file_range is not None and length > 0:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def _finish_writeback(fd: int, offset: int, length: int) -> None:
    """Wait until [offset, offset+length) is on disk, then drop it from the page cache."""
    if _sync_file_range is None or length <= 0:
        return
    _sync_file_range(
        fd, offset, length,
        _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER,
    )
    with contextlib.suppress(OSError):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def fsync_dir(path: Path) -> None:
    """Make the entries of directory `path` (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: memoryview, path: Path) -> None:
    view = data
    while len(view):
        try:
            n = os.write(fd, view)
        except OSError as err:
            raise CheckpointError(f"write failed: {err.strerror}", path) from err
        view = view[n:]


def write_file(path: Path, data: bytes | memoryview, *, fsync: bool = True) -> None:
    """Create `path` (must not exist) holding `data`, fsynced when `fsync`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        _write_all(fd, memoryview(data).cast("B"), path)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def atomic_replace(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Replace `path` with `data` atomically: temp file, (fsync), rename, (fsync parent)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    try:
        write_file(tmp, data, fsync=durable)
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise CheckpointError(f"atomic replace failed: {err.strerror}", path) from err
    if durable:
        fsync_dir(path.parent)


def crc32_pieces(pieces: Sequence[memoryview | bytes | bytearray]) -> int:
    """CRC-32 of the concatenation of `pieces` (zlib releases the GIL on large buffers)."""
    crc = 0
    for piece in pieces:
        crc = zlib.crc32(piece, crc)
    return crc


def checksum_bytes(data: bytes | memoryview, chunk_bytes: int) -> list[int]:
    """Per-chunk CRC-32 list of an in-memory buffer (the manifest's checksum shape)."""
    view = memoryview(data).cast("B")
    return [zlib.crc32(view[i:i + chunk_bytes]) for i in range(0, len(view), chunk_bytes)]


# Called before each chunk with (bytes_done, bytes_total); raises to abandon the write.
ProgressCheck = Callable[[int, int], None]


def write_file_streamed(
    path: Path,
    data: memoryview,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    check: ProgressCheck | None = None,
    rate_limit: float | None = None,
) -> list[int]:
    """Write `data` to new file `path` sequentially and fsync it; return per-chunk CRC-32s.

    `check` runs before every chunk and may raise to abandon (the partial file is left for the
    caller to remove with its directory). `rate_limit` (bytes/s) throttles the writer, for a disk
    shared with the training data.
    """
    total = len(data)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="spottrainer-crc") as pool:
            crcs: list[Future[int]] = []
            start = time.monotonic()
            prev: tuple[int, int] | None = None
            done = 0
            while done < total:
                if check is not None:
                    check(done, total)
                end = min(done + chunk_bytes, total)
                piece = data[done:end]
                crcs.append(pool.submit(zlib.crc32, piece))
                _write_all(fd, piece, path)
                _start_writeback(fd, done, end - done)
                if prev is not None:
                    _finish_writeback(fd, *prev)
                prev = (done, end - done)
                done = end
                if rate_limit:
                    ahead = done / rate_limit - (time.monotonic() - start)
                    if ahead > 0:
                        time.sleep(ahead)
            if check is not None:
                check(done, total)
            os.fsync(fd)
            if prev is not None:
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fd, prev[0], prev[1], os.POSIX_FADV_DONTNEED)
            return [f.result() for f in crcs]
    except OSError as err:
        raise CheckpointError(f"write failed: {err.strerror}", path) from err
    finally:
        os.close(fd)


def read_file_verified(path: Path, *, size: int, chunks: Sequence[int],
                       chunk_bytes: int) -> bytes:
    """Read small file `path` whole and verify its size and per-chunk CRC-32s."""
    try:
        data = path.read_bytes()
    except FileNotFoundError as err:
        raise CorruptCheckpointError("file is missing", path) from err
    except OSError as err:
        raise CheckpointError(f"cannot read: {err.strerror}", path) from err
    if len(data) != size:
        raise CorruptCheckpointError(f"size is {len(data)}, manifest says {size}", path)
    got = checksum_bytes(data, chunk_bytes)
    if len(got) != len(chunks):
        raise CorruptCheckpointError(
            f"manifest lists {len(chunks)} checksums, size needs {len(got)}", path)
    for index, (have, want) in enumerate(zip(got, chunks, strict=True)):
        if have != want:
            raise CorruptCheckpointError(f"checksum mismatch in chunk {index}", path)
    return data


def map_file_verified(path: Path, *, size: int, chunks: Sequence[int],
                      chunk_bytes: int) -> mmap.mmap | bytearray:
    """Map `path` copy-on-write (MAP_PRIVATE) and verify its size and every chunk's CRC-32.

    Verification reads every page in order (the kernel reads ahead of the CRC), so the data is
    in memory when this returns, without a copy into freshly zeroed anonymous memory.
    Writes to the mapping stay private to the process; the file is never modified.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as err:
        raise CorruptCheckpointError("file is missing", path) from err
    except OSError as err:
        raise CheckpointError(f"cannot open: {err.strerror}", path) from err
    try:
        actual = os.fstat(fd).st_size
        if actual != size:
            raise CorruptCheckpointError(f"size is {actual}, manifest says {size}", path)
        expected_chunks = (size + chunk_bytes - 1) // chunk_bytes
        if len(chunks) != expected_chunks:
            raise CorruptCheckpointError(
                f"manifest lists {len(chunks)} checksums, size needs {expected_chunks}", path)
        if size == 0:
            return bytearray()
        # No POSIX_FADV_WILLNEED: it reads the whole file before the first CRC can start;
        # sequential faults let the kernel's readahead run ahead of the CRC instead.
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as err:
        raise CheckpointError(f"cannot map: {err.strerror}", path) from err
    finally:
        os.close(fd)
    with contextlib.suppress(OSError, AttributeError):
        mapped.madvise(mmap.MADV_SEQUENTIAL)
    # One sequential pass (no thread pool): in-order faults keep the kernel's readahead
    # ahead of the CRC; parallel CRC threads measured slower on a cold file.
    view = memoryview(mapped)
    try:
        crcs = [zlib.crc32(view[i:i + chunk_bytes]) for i in range(0, size, chunk_bytes)]
    finally:
        view.release()
    for index, (got, want) in enumerate(zip(crcs, chunks, strict=True)):
        if got != want:
            mapped.close()
            raise CorruptCheckpointError(f"checksum mismatch in chunk {index}", path)
    with contextlib.suppress(OSError, AttributeError):
        mapped.madvise(mmap.MADV_NORMAL)
    return mapped


def drop_page_cache(path: Path) -> None:
    """Evict `path`'s clean pages from the page cache (for honest cold-read measurements)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def remove_tree(path: Path) -> None:
    """Remove a directory tree; a tree that is already gone is fine."""
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)
