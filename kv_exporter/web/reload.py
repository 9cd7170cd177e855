"""Reloading the web configuration: re-read when the file or a certificate it names changes, keep the last good one."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kv_exporter.filestat import FileSignature, signature_of
from kv_exporter.web.config import WebConfig, WebConfigError

logger = logging.getLogger("kv_exporter.web")

RELOAD_CHECK_INTERVAL_S = 1.0

_Fingerprint = tuple[tuple[str, FileSignature | str], ...]


def _fingerprint(paths: Iterable[Path]) -> _Fingerprint:
    return tuple((str(path), signature_of(path)) for path in paths)


def _load_with_fingerprint(path: Path) -> tuple[WebConfig, _Fingerprint]:
    """Load, and fingerprint the files the config names (a new config may name other certificates).

    The config file is stat-ed before it is read: if it changes in between, the stored fingerprint is already
    out of date and the next check reloads, instead of missing the change.
    """
    before = _fingerprint([path])
    config = WebConfig.load(path)
    return config, before + _fingerprint(config.watched_files()[1:])


# How long after a check begins the requests that find it due or running wait for it: a check reads a few small files
# (~1 ms), so a scrape that follows an edit answers for the file as it is, and tests with a fake clock see the result
# at once. Past the wait, and between checks, a request gets the config in force.
CHECK_WAIT_S = 0.2
# A check still running after this long (a slow disk, an NFS server gone) is reported, and the old config serves on.
STUCK_AFTER_S = 5.0


class WebConfigReloader:
    """The current `WebConfig`, re-read when the file or a certificate it names changes.

    The first load raises `WebConfigError` (refuse to start, as the toolkit does). Later, a changed file is
    re-read at most once per `interval`, in a thread of its own, so that no request waits on a slow disk for more
    than CHECK_WAIT_S (the files are opened without blocking: a FIFO is refused at once); an invalid new version,
    or a check stuck past STUCK_AFTER_S, is logged once and the last good config stays in force. Whether TLS is on
    is fixed at start-up (the listener was built for it), so a change that turns it on or off is refused until a
    restart.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        interval: float = RELOAD_CHECK_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self._interval = interval
        self._clock = clock
        self._lock = threading.Lock()  # held only to start a check or take its result, never during one
        self._config, self._fingerprint = _load_with_fingerprint(self.path)
        self._checked_at = clock()
        self._check: threading.Thread | None = None
        self._check_started = 0.0
        self._failed: _Fingerprint | None = None
        self.reloads = 0
        self.reload_failures = 0
        self.last_error: str | None = None

    @property
    def last_reload_ok(self) -> bool:
        return self.last_error is None

    def current(self, wait_s: float = CHECK_WAIT_S) -> WebConfig:
        """The config in force. When the last check is older than the interval, a new one starts; this caller
        waits for a check it started or found running until `wait_s` after that check began (0 for a caller that
        must never wait: the server's loop, which may start the check that the request it then hands to a worker
        waits for). A stuck check holds each request only in its first `wait_s`."""
        if self._check is None and self._clock() - self._checked_at < self._interval:
            return self._config
        with self._lock:
            check = self._check
            if check is None and self._clock() - self._checked_at >= self._interval:
                self._checked_at = self._clock()
                self._check_started = time.monotonic()
                check = self._check = threading.Thread(target=self._run_check, name="web-config-check", daemon=True)
                check.start()
        if check is not None:
            if wait_s > 0:
                check.join(max(0.0, self._check_started + wait_s - time.monotonic()))
            if check.is_alive():
                self._report_stuck()
        return self._config

    def _run_check(self) -> None:
        try:
            self._maybe_reload()
        except Exception:  # a bug here must not end the checks for good
            logger.exception("web config check failed")
        finally:
            with self._lock:
                self._check = None

    def _report_stuck(self) -> None:
        running_s = time.monotonic() - self._check_started
        if running_s < STUCK_AFTER_S or self.last_error is not None:
            return
        self.last_error = f"{self.path}: re-reading it has not finished for {running_s:.0f} s (a slow disk?)"
        self.reload_failures += 1
        logger.error("web config not reloaded, keeping the previous one: %s", self.last_error)

    def _maybe_reload(self) -> None:
        fingerprint = _fingerprint(self._config.watched_files())
        if fingerprint == self._fingerprint or fingerprint == self._failed:
            return
        try:
            config, new_fingerprint = _load_with_fingerprint(self.path)
            if config.tls_enabled != self._config.tls_enabled:
                state = "on" if self._config.tls_enabled else "off"
                raise WebConfigError(self.path, f"TLS was {state} at start-up; turning it over needs a restart")
        except WebConfigError as exc:
            self._failed = fingerprint
            self.reload_failures += 1
            self.last_error = str(exc)
            logger.error("web config not reloaded, keeping the previous one: %s", exc)
            return
        self._config, self._fingerprint, self._failed = config, new_fingerprint, None
        self.reloads += 1
        self.last_error = None
        logger.info("web config reloaded from %s", self.path)


class ReloadStatusCollector(Collector):
    """Whether the last change to the web config (or a certificate it names) could be loaded, as a metric."""

    def __init__(self, reloader: WebConfigReloader, name: str, documentation: str) -> None:
        """`name`, `documentation`: the metric's, as the sidecar's table gives them (the web config knows no table)."""
        self.reloader = reloader
        self.name, self.documentation = name, documentation

    def collect(self) -> Iterable[Metric]:
        self.reloader.current()  # notice an edit even if no request looked since (at most one check a second)
        yield GaugeMetricFamily(self.name, self.documentation, value=int(self.reloader.last_reload_ok))
