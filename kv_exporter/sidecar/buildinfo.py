"""Which build is running: version, source revision and Python, for `--version` and the build-info metric.

The revision comes from a `REVISION` file in the package (the image build writes it: there is no git in an image),
else from the git checkout the package runs from (an editable install; read from `.git` directly, no subprocess),
else it is "unknown".
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kv_exporter import __version__

PACKAGE = Path(__file__).resolve().parents[1]
REVISION_FILE = PACKAGE / "REVISION"
UNKNOWN = "unknown"


@dataclass(frozen=True)
class BuildInfo:
    version: str
    revision: str
    python_version: str

    def line(self) -> str:
        return f"kv-exporter, version {self.version} (revision: {self.revision}, python: {self.python_version})"


@cache
def build_info() -> BuildInfo:
    return BuildInfo(__version__, revision(), platform.python_version())


def revision() -> str:
    try:
        written = REVISION_FILE.read_text(encoding="utf-8").strip()
    except OSError:
        written = ""
    return written or _checkout_revision(PACKAGE.parent) or UNKNOWN


def _checkout_revision(root: Path) -> str | None:
    """HEAD's commit in the checkout at `root`; a worktree's `.git` is a file naming its git directory."""
    try:
        git = root / ".git"
        if git.is_file():
            git = (root / git.read_text(encoding="utf-8").split(":", 1)[1].strip()).resolve()
        head = (git / "HEAD").read_text(encoding="utf-8").strip()
        if not head.startswith("ref: "):
            return head or None
        ref = head.removeprefix("ref: ")
        common = git / "commondir"
        stores = [git, (git / common.read_text(encoding="utf-8").strip()).resolve()] if common.is_file() else [git]
        for store in stores:
            loose = store / ref
            if loose.is_file():
                return loose.read_text(encoding="utf-8").strip() or None
            packed = store / "packed-refs"
            if packed.is_file():
                for line in packed.read_text(encoding="utf-8").splitlines():
                    sha, _, name = line.partition(" ")
                    if name == ref:
                        return sha
    except (OSError, IndexError):
        return None
    return None
