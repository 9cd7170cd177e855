"""`model_local_kv_web_config_last_reload_successful` from the real sidecar process: 1 with a good web config, 0
while a broken edit is refused (the last good config still serves), 1 again once fixed; absent without the flag."""

from __future__ import annotations

import time
from pathlib import Path

import bcrypt

from kv_exporter.sidecar.metrics_table import WEB_CONFIG_RELOAD
from kv_exporter.web.reload import RELOAD_CHECK_INTERVAL_S
from tests.support.constants import REPO
from tests.support.net import basic_authorization
from tests.support.scrape import absent, pick
from tests.support.sidecar import Sidecar, sidecar

AUTH = {"Authorization": basic_authorization("prom", "s3cret")}


def reload_ok(sc: Sidecar) -> float:
    time.sleep(RELOAD_CHECK_INTERVAL_S + 0.2)  # the file is checked at most once per interval
    return pick(sc.samples(AUTH), WEB_CONFIG_RELOAD.name)


def test_reload_metric_follows_the_file(tmp_path: Path) -> None:
    config = tmp_path / "web.yml"
    good = f"basic_auth_users:\n  prom: {bcrypt.hashpw(b's3cret', bcrypt.gensalt(rounds=4)).decode()}\n"
    config.write_text(good)
    args = ("--manifest-dir", str(tmp_path), "--no-nvml", f"--web.config.file={config}")
    with sidecar(tmp_path, *args) as sc:
        assert sc.get()[0] == 401
        assert pick(sc.samples(AUTH), WEB_CONFIG_RELOAD.name) == 1
        config.write_text(good + "no_such_key: 1\n")
        assert reload_ok(sc) == 0  # refused, and the password of the last good config still works
        config.unlink()
        assert reload_ok(sc) == 0
        config.write_text(good)
        assert reload_ok(sc) == 1
        assert sc.stop() == 0


def test_no_reload_metric_without_a_web_config(tmp_path: Path) -> None:
    with sidecar(tmp_path, "--manifest-dir", str(tmp_path), "--no-nvml") as sc:
        assert absent(sc.samples(), WEB_CONFIG_RELOAD.name)
        assert sc.stop() == 0


def test_the_reload_metric_is_documented() -> None:
    for doc in ("metrics.md", "CONTRACTS.md"):
        assert f"`{WEB_CONFIG_RELOAD.name}`" in (REPO / "docs" / doc).read_text(), doc
