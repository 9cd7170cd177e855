"""When a file must be read again: one signature of a file's identity and version, for every cache of parsed files.

Device and inode tell a replaced file (an atomic rename, a Kubernetes secret swap) from the old one; size and
mtime an ordinary rewrite. The change time catches what those miss: a chmod that makes a file readable, and an
in-place rewrite that restores the old mtime (`cp -p`, `rsync -t`, tar); nothing can set it back.
"""

from __future__ import annotations

import os

FileSignature = tuple[int, int, int, int, int]  # device, inode, size, mtime_ns, ctime_ns


def signature(st: os.stat_result) -> FileSignature:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def signature_of(path: str | os.PathLike[str]) -> FileSignature | str:
    """The signature of `path`, or the reason it has none ("error 2"), which is compared like a signature."""
    try:
        return signature(os.stat(path))
    except OSError as exc:
        return f"error {exc.errno}"
