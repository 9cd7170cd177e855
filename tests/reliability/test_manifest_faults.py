"""Manifest folder faults against the real sidecar process: missing, deleted while serving, unreadable, rewritten
while being read. /metrics answers 200 throughout, the folder error is counted once per outage (not per scrape),
the folder-state gauge says what is wrong for as long as it is (and `ok` again once fixed), and the sidecar picks the
manifests up again as soon as they are readable."""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kv_exporter.manifest import Manifest, manifest_filename, write_manifest
from tests.support.manifests import MODEL, ceiling_bytes, live_manifest
from tests.support.scrape import Samples, absent, manifest_states, pick, total
from tests.support.sidecar import Sidecar, serve_args, sidecar

ERRORS = "model_local_kv_manifest_errors_total"
SCRAPES = 3
FOLDER_STATES = ("ok", "missing", "unreadable", "not_a_folder")


def assert_folder_state(s: Samples, state: str) -> None:
    """One series per state, 1 for the folder's (as model_local_kv_observation_state)."""
    shown = {name: pick(s, "model_local_kv_manifest_folder_state", state=name) for name in FOLDER_STATES}
    assert shown == {name: float(name == state) for name in FOLDER_STATES}


def assert_declared(s: Samples, manifest: Manifest) -> None:
    assert_folder_state(s, "ok")
    assert manifest_states(s) == (1, 0, 0)
    assert pick(s, "model_local_kv_max_num_seqs", model_name=MODEL) == manifest.max_num_seqs
    assert total(s, "model_local_kv_ceiling_bytes") == ceiling_bytes(manifest)


def assert_folder_unreadable(s: Samples, outages: int, state: str) -> None:
    assert_folder_state(s, state)
    assert manifest_states(s) == (0, 0, 0)
    assert pick(s, "model_local_kv_manifest_errors_total", reason="folder_unreadable") == outages
    assert absent(s, "model_local_kv_ceiling_bytes")
    # No live manifest sits on the GPU: this exporter has nothing of it to report (see docs/reliability.md).
    assert absent(s, "model_local_kv_gpu_projected_peak_bytes")


def test_folder_missing_at_start_then_created(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    with sidecar(tmp_path, *serve_args(folder)) as sc:
        for _ in range(SCRAPES):
            assert_folder_unreadable(sc.samples(), outages=1, state="missing")
        manifest = live_manifest()
        write_manifest(folder, manifest)
        assert_declared(sc.samples(), manifest)
        assert sc.stop() == 0
    assert sc.log().count("unreadable") == 1


def test_folder_deleted_while_serving_then_recreated(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    manifest = live_manifest()
    write_manifest(folder, manifest)
    with sidecar(tmp_path, *serve_args(folder)) as sc:
        assert_declared(sc.samples(), manifest)
        shutil.rmtree(folder)
        for _ in range(SCRAPES):
            assert_folder_unreadable(sc.samples(), outages=1, state="missing")
        write_manifest(folder, manifest)
        assert_declared(sc.samples(), manifest)
        shutil.rmtree(folder)  # a second outage is counted again
        assert_folder_unreadable(sc.samples(), outages=2, state="missing")
        assert sc.stop() == 0


def test_a_file_where_the_folder_should_be(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.write_text("not a folder\n")
    with sidecar(tmp_path, *serve_args(folder)) as sc:
        for _ in range(SCRAPES):
            assert_folder_unreadable(sc.samples(), outages=1, state="not_a_folder")
        folder.unlink()
        manifest = live_manifest()
        write_manifest(folder, manifest)
        assert_declared(sc.samples(), manifest)
        assert sc.stop() == 0


def test_folder_without_permission(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    manifest = live_manifest()
    write_manifest(folder, manifest)
    folder.chmod(0o000)
    with sidecar(tmp_path, *serve_args(folder), permission_bits=True) as sc:
        for _ in range(SCRAPES):
            assert_folder_unreadable(sc.samples(), outages=1, state="unreadable")
        folder.chmod(0o755)
        assert_declared(sc.samples(), manifest)
        assert sc.stop() == 0
    assert "Permission denied" in sc.log()


def test_manifest_without_permission_is_read_once_readable(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    manifest = live_manifest()
    path = write_manifest(folder, manifest)
    path.chmod(0o000)
    with sidecar(tmp_path, *serve_args(folder), permission_bits=True) as sc:
        for _ in range(SCRAPES):
            s = sc.samples()
            assert manifest_states(s) == (0, 0, 1)
            assert pick(s, "model_local_kv_manifest_errors_total", reason="unreadable") == 1
        path.chmod(0o644)  # only the inode's change time moves: no new size, mtime or inode
        assert_declared(sc.samples(), manifest)
        assert sc.stop() == 0


def test_rewritten_atomically_while_being_read(tmp_path: Path) -> None:
    """The hook's writer (temporary file + rename) racing 8 scrapers: never a torn read."""
    folder = tmp_path / "m"
    versions = [live_manifest(max_num_seqs=n) for n in (64, 256)]
    write_manifest(folder, versions[0])
    stop = threading.Event()
    written = [0]

    def rewrite() -> None:
        while not stop.is_set():
            write_manifest(folder, versions[written[0] % 2])
            written[0] += 1

    with sidecar(tmp_path, *serve_args(folder)) as sc:
        writer = threading.Thread(target=rewrite)
        writer.start()
        seen: list[float] = []
        try:
            # At least 15 scrapes each, and on until the writer has replaced the file 20 times (a loaded machine
            # gives the writer thread little time): the race must really have happened.
            def scrape() -> None:
                seen.extend(scrape_max_num_seqs(sc, 15, until=lambda: written[0] > 20))

            scrapers = [threading.Thread(target=scrape) for _ in range(8)]
            for t in scrapers:
                t.start()
            for t in scrapers:
                t.join(120)
        finally:
            stop.set()
            writer.join(10)
        final = versions[(written[0] - 1) % 2]
        assert_declared(sc.samples(), final)
        assert sc.stop() == 0
    assert len(seen) >= 8 * 15 and set(seen) == {64, 256}, (len(seen), set(seen))
    assert written[0] > 20, written[0]


def scrape_max_num_seqs(sc: Sidecar, count: int, until: Callable[[], bool] = lambda: True) -> list[float]:
    """At least `count` scrapes, then more until `until()` holds (at most 100 x count)."""
    values: list[float] = []
    while len(values) < count or (not until() and len(values) < 100 * count):
        s = sc.samples()
        assert manifest_states(s) == (1, 0, 0)
        assert not absent(s, ERRORS) and total(s, ERRORS) == 0  # exported at 0 per reason, none counted
        values.append(pick(s, "model_local_kv_max_num_seqs", model_name=MODEL))
    return values


def rewrite_in_place(path: Path, data: bytes, pause_s: float = 0.0) -> None:
    """A writer that is not atomic (e.g. `cat > file`): truncate, then write in pieces."""
    with open(path, "r+b") as handle:
        handle.truncate(0)
        for start in range(0, len(data), 512):
            handle.write(data[start : start + 512])
            handle.flush()
            time.sleep(pause_s)


def test_rewritten_in_place_while_being_read(tmp_path: Path) -> None:
    """A non-atomic writer: a scrape may see half a file (rejected, counted), never a wrong figure, and the next
    scrape after the write reads the whole new version."""
    folder = tmp_path / "m"
    old, new = live_manifest(max_num_seqs=64), live_manifest(max_num_seqs=128)
    path = write_manifest(folder, old)
    with sidecar(tmp_path, *serve_args(folder)) as sc:
        assert_declared(sc.samples(), old)
        writer = threading.Thread(target=rewrite_in_place, args=(path, new.to_json().encode(), 0.1))
        writer.start()
        while writer.is_alive():
            s = sc.samples()
            live, _, invalid = manifest_states(s)
            assert (live, invalid) in ((1, 0), (0, 1)), (live, invalid)
            if live:
                assert pick(s, "model_local_kv_max_num_seqs", model_name=MODEL) in (old.max_num_seqs, 128)
        writer.join()
        assert_declared(sc.samples(), new)
        assert sc.stop() == 0


def test_rewritten_in_place_with_the_old_mtime(tmp_path: Path) -> None:
    """`cp -p`, `rsync -t`, `tar x` restore the old modification time: same inode, size and mtime, new content."""
    folder = tmp_path / "m"
    old = live_manifest(max_num_seqs=256)
    new = dataclasses.replace(old, max_num_seqs=128)  # the same number of digits: the same size
    path = write_manifest(folder, old)
    before = path.stat()
    with sidecar(tmp_path, *serve_args(folder)) as sc:
        assert_declared(sc.samples(), old)
        data = new.to_json().encode()
        assert len(data) == before.st_size
        rewrite_in_place(path, data)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert path.stat().st_mtime_ns == before.st_mtime_ns and path.stat().st_ino == before.st_ino
        assert_declared(sc.samples(), new)
        assert sc.stop() == 0
    assert path.name == manifest_filename(new.engine)
