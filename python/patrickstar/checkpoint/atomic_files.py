"""Durable, atomic filesystem operations of a checkpoint save (Note [Atomic checkpoints] in
checkpoint/__init__.py): fsync of files and directories, atomic replacement of a file and
exchange of two directories, and the partial directories of writers that died."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import itertools
import os
import re
import secrets
import shutil

__all__ = ["fsync_dir", "exchange", "crash_point", "PartialDirectory", "remove_stale_partials",
           "write_text_atomically", "write_bytes_durably", "write_error",
           "open_for_writing", "file_sha256", "publish_directory"]

_READ_BLOCK = 8 << 20
_PARTIAL = re.compile(r"^\.(?P<tag>.+)\.partial-(?P<pid>\d+)-(?P<token>[0-9a-f]+)$")
_counter = itertools.count()
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def exchange(a: str, b: str) -> bool:
    """Atomically swaps two paths (renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, f"renameat2(RENAME_EXCHANGE) of '{a}' and '{b}': {os.strerror(code)}")


def crash_point(name: str) -> None:
    """Test hook (Note [Atomic checkpoints]): PATRICKSTAR_CHECKPOINT_CRASH_AT=name kills the
    writer with SIGKILL at that point, as a power loss or OOM kill would. save_checkpoint
    announces it when it is set (protocol.py)."""
    if os.environ.get("PATRICKSTAR_CHECKPOINT_CRASH_AT") == name:
        os.kill(os.getpid(), 9)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class PartialDirectory:
    """The hidden directory a save writes into, `DIR/.TAG.partial-<pid>-<token>`, locked (an
    flock on the directory) by its writer until `close()`.

    Note [Partial directory ownership]
    A partial directory is stale when nobody holds its lock, whatever its pid says: a restarted
    container reuses the dead writer's pid, and a writer in another pid namespace sharing the
    directory has a pid that means nothing here. The random token keeps a stale directory of
    this very pid from blocking the save. The directory is created under a name cleanup
    ignores (`.creating-`), locked, and only then renamed, so it never appears unlocked under
    its partial name (runtime/nvme_tier.h, Note [Swap file ownership], is the same idea)."""

    def __init__(self, save_dir: str, tag: str):
        token = secrets.token_hex(8)
        creating = os.path.join(save_dir, f".{tag}.creating-{os.getpid()}-{token}")
        self.path = os.path.join(save_dir, f".{tag}.partial-{os.getpid()}-{token}")
        os.mkdir(creating)
        self._fd = os.open(creating, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            os.rename(creating, self.path)
        except BaseException:
            os.close(self._fd)
            shutil.rmtree(creating, ignore_errors=True)
            raise

    def close(self) -> None:
        """Removes what is left at `path` (after an exchange, the tag's previous contents) and
        drops the lock."""
        if self._fd is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            os.close(self._fd)
            self._fd = None


def remove_stale_partials(save_dir: str) -> list[str]:
    """Removes the partial directories no live writer holds (Note [Partial directory
    ownership])."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir(save_dir):
            if not _PARTIAL.match(entry):
                continue
            path = os.path.join(save_dir, entry)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                if _try_lock(fd):
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(entry)
            finally:
                os.close(fd)
    return removed


def write_error(error: OSError, path: str, written: int, total: int) -> OSError:
    """`error` (a write, flush or fsync of `path` that failed) as an OSError with the same errno
    that names the file, how far the write got, and the free space of its filesystem. Python's
    own error for a failed `handle.write` names no file ("[Errno 28] No space left on device"),
    which leaves a user of a week-long run guessing which disk filled up."""
    code = error.errno
    try:
        info = os.statvfs(os.path.dirname(path) or ".")
        free = f"; {info.f_bavail * info.f_frsize} bytes free on its filesystem"
    except OSError:
        free = ""
    reason = os.strerror(code) if code else str(error)
    result = OSError(code, f"{reason} writing checkpoint file after {written} of {total} "
                           f"bytes{free}", path)
    result.__cause__ = error
    return result


@contextlib.contextmanager
def open_for_writing(path: str):
    """`open(path, "wb")` whose close does not replace the error that ended the block. After a
    failed write the buffer still holds unwritten bytes, and closing the file flushes them, fails
    again and raises a bare "[Errno 28] No space left on device" instead of the error naming the
    file (write_error). The descriptor is closed either way."""
    handle = open(path, "wb")
    try:
        yield handle
    except BaseException:
        with contextlib.suppress(OSError):
            handle.close()
        raise
    handle.close()


def write_text_atomically(path: str, text: str) -> None:
    temp = f"{path}.tmp-{os.getpid()}-{next(_counter)}"
    try:
        write_bytes_durably(temp, text.encode("utf-8"))
        os.replace(temp, path)
    except BaseException:
        # A full disk must not leave `latest.tmp-*` files in the checkpoint directory (nothing
        # else would ever remove them); the previous `path` is untouched.
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    fsync_dir(os.path.dirname(path) or ".")


def write_bytes_durably(path: str, data) -> None:
    """Writes `data` to `path` and fsyncs the file (the directory is fsync'd when published)."""
    with open_for_writing(path) as handle:
        try:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        except OSError as error:
            raise write_error(error, path, 0, len(data)) from error


def publish_directory(partial: str, final: str) -> None:
    """Renames the complete `partial` directory to `final`, atomically replacing an existing
    `final` where the filesystem can exchange them, and fsyncs the parent."""
    fsync_dir(partial)
    crash_point("before_rename")
    if os.path.lexists(final):
        if not exchange(partial, final):
            # No atomic exchange on this filesystem: a crash between these two renames
            # loses `final` (but never `latest`'s target unless `latest` names it).
            shutil.rmtree(final)
            os.rename(partial, final)
    else:
        os.rename(partial, final)
    fsync_dir(os.path.dirname(final) or ".")


def file_sha256(path: str, length: int) -> str:
    """sha256 of the first `length` bytes of `path`, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        remaining = length
        while remaining > 0:
            block = handle.read(min(_READ_BLOCK, remaining))
            if not block:
                break
            digest.update(block)
            remaining -= len(block)
    return digest.hexdigest()
