"""Text from outside (file names, what a bad document holds) made safe to show on a page, in a log or a terminal.

`os.scandir` gives a file name that is not UTF-8 as a str holding lone surrogates (Python's surrogateescape), and
JSON's `\\ud800` escapes decode to lone surrogates too: neither can be encoded as UTF-8, so one such character used
to fail a whole page. Control characters would reach a terminal as escape sequences. `printable` writes both as
`\\xNN` / `\\uNNNN` escapes, as Python's backslashreplace does for an undecodable byte, and cuts long text short.
"""

from __future__ import annotations

import re

DETAIL_MAX_CHARS = 300  # what an error message may quote from its input

# C0/C1 controls and DEL, and every surrogate (only a lone one can be in a str).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if 0xDC80 <= code <= 0xDCFF:  # an undecodable byte, as surrogateescape keeps it
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, max_chars: int | None = None) -> str:
    """`text` with unsafe characters escaped, at most `max_chars` characters of it (then a note of what was cut)."""
    cut = ""
    if max_chars is not None and len(text) > max_chars:
        text, cut = text[:max_chars], f"... ({len(text) - max_chars} more characters)"
    return _UNSAFE.sub(_escape, text) + cut
