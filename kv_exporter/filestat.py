"""Files other processes write: when one must be read again, and how to read one without being held by it.

Signature: device and inode tell a replaced file (an atomic rename, a Kubernetes secret swap) from the old one; size
and mtime an ordinary rewrite. The change time catches what those miss: a chmod that makes a file readable, and an
in-place rewrite that restores the old mtime (`cp -p`, `rsync -t`, tar); nothing can set it back.

Reading: a FIFO put where a file should be blocks a plain `open` until some writer comes, forever if none does; an
entry can change type between a listing and the open. So the file is opened without blocking and what was opened is
checked before a byte is read, and at most a given size is read.
"""

from __future__ import annotations

import os
import stat

FileSignature = tuple[int, int, int, int, int]  # device, inode, size, mtime_ns, ctime_ns


def signature(st: os.stat_result) -> FileSignature:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def signature_of(path: str | os.PathLike[str]) -> FileSignature | str:
    """The signature of `path`, or the reason it has none ("error 2"), which is compared like a signature."""
    try:
        return signature(os.stat(path))
    except OSError as exc:
        return f"error {exc.errno}"


_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


class NotARegularFile(Exception):
    """What is at the path is not a regular file; the message says what it is."""


def _check_regular(mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), f"file type {stat.S_IFMT(mode):o}")
        raise NotARegularFile(f"{kind}, not a regular file")


def read_regular_file(path: str, max_bytes: int) -> bytes:
    """At most `max_bytes` of the regular file at `path`. Raises NotARegularFile for anything else there (a link to
    nothing included), FileNotFoundError when nothing is there, OSError when it cannot be read."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        raise _open_error(path, exc) from None
    try:
        _check_regular(os.fstat(fd).st_mode)
        chunks = []
        while max_bytes > 0 and (chunk := os.read(fd, min(max_bytes, 1 << 20))):
            chunks.append(chunk)
            max_bytes -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _open_error(path: str, exc: OSError) -> Exception:
    """Why the open failed, as read_regular_file raises it (a socket, for one, cannot be opened at all)."""
    try:
        _check_regular(os.stat(path).st_mode)
    except FileNotFoundError:
        return NotARegularFile("a symbolic link to nothing") if os.path.lexists(path) else exc
    except NotARegularFile as irregular:
        return irregular
    except OSError:
        pass
    return exc
