"""What else a manifest folder can hold, against the real sidecar process: entries that are not regular files (a FIFO,
a directory, a socket, a device, a link to nothing) are refused with a reason and counted, never skipped in silence
and never opened in a way that blocks; an entry that changes type between the listing and the open never blocks a
scrape; a file that vanishes between the two (an engine's clean exit during a scrape) is not an error.

(Before: such entries were skipped in silence, a FIFO that replaced a listed file held the scrape, and every later
one, until a writer opened it, and a vanished file was counted as `unreadable`.)"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kv_exporter.manifest import write_manifest
from tests.support.manifests import live_manifest
from tests.support.scrape import manifest_states, pick
from tests.support.sidecar import Sidecar, serve_args, sidecar

SCRAPE_TIMEOUT_S = 10.0  # a scrape that blocks on a FIFO never answers: the client gives up, the test fails
RACING_SCRAPES = 100
CHURN = 200  # files coming and going (with 100 scrapes, today's main counted ~5 of them as unreadable)


def errors_counted(sc: Sidecar) -> dict[str, float]:
    """The manifest error reasons counted so far, and how often."""
    s = sc.samples()
    return {dict(ls)["reason"]: v for (n, ls), v in s.items() if n == "model_local_kv_manifest_errors_total" and v}


def test_entries_that_are_not_regular_files_are_counted_not_opened(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    write_manifest(folder, live_manifest())
    os.mkfifo(folder / "fifo.json")  # nobody ever opens it for writing: a blocking open would wait forever
    (folder / "dir.json").mkdir()
    (folder / "zero.json").symlink_to("/dev/zero")  # a device that never ends
    (folder / "dangling.json").symlink_to(folder / "nowhere")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(folder / "sock.json"))
    kinds = ("a FIFO", "a directory", "a character device", "a symbolic link to nothing", "a socket")
    try:
        with sidecar(tmp_path, *serve_args(folder)) as sc:
            for _ in range(3):
                s = sc.samples()
                assert manifest_states(s) == (1, 0, len(kinds))
                assert pick(s, "model_local_kv_manifest_errors_total", reason="not_regular_file") == len(kinds)
            status, _, body = sc.get("/")
            assert status == 200
            for kind in kinds:
                assert kind.encode() in body
            assert sc.stop() == 0
    finally:
        listener.close()
    assert sc.log().count("not_regular_file") == len(kinds)  # once per entry, not per scrape


@contextmanager
def racing(change: Callable[[], None]) -> Iterator[None]:
    """Run `change` over and over in a thread while the block runs."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            change()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def test_an_entry_that_changes_type_never_blocks_a_scrape(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    write_manifest(folder, live_manifest())
    racer, staged, fifo = folder / "racer.json", folder / ".staged", folder / ".fifo"
    data = live_manifest().to_json().encode()

    def flip() -> None:  # a regular file, then a FIFO, each put in place atomically
        staged.write_bytes(data)
        os.replace(staged, racer)
        os.mkfifo(fifo)
        os.replace(fifo, racer)

    with sidecar(tmp_path, *serve_args(folder)) as sc:
        with racing(flip):
            for _ in range(RACING_SCRAPES):
                status, _, _ = sc.get(timeout=SCRAPE_TIMEOUT_S)
                assert status == 200
        s = sc.samples()
        assert manifest_states(s) == (1, 0, 1)  # the FIFO it ended as
        assert pick(s, "model_local_kv_manifest_errors_total", reason="not_regular_file") >= 1
        assert sc.stop() == 0


def test_a_file_that_vanishes_while_being_read_is_not_an_error(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    write_manifest(folder, live_manifest())
    staged = folder / ".staged"
    data = live_manifest().to_json().encode()
    # Engines come and go: each step writes one manifest (as the hook does) and removes the one written
    # CHURN / 2 steps earlier (a clean exit), so about CHURN / 2 are there at any time, each for a short while.
    step = iter(range(1 << 62))

    def come_and_go() -> None:
        i = next(step)
        staged.write_bytes(data)
        os.replace(staged, folder / f"comer-{i % CHURN}.json")
        with contextlib.suppress(FileNotFoundError):
            (folder / f"comer-{(i + CHURN // 2) % CHURN}.json").unlink()

    with sidecar(tmp_path, *serve_args(folder)) as sc:
        with racing(come_and_go):
            for _ in range(RACING_SCRAPES):
                status, _, _ = sc.get(timeout=SCRAPE_TIMEOUT_S)
                assert status == 200
        assert errors_counted(sc) == {}
        assert sc.stop() == 0
