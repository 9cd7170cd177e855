"""`kv-exporter serve --web.config.file`: the exporter-toolkit configuration reaches the real server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import bcrypt

from tests.support.constants import REPO
from tests.support.net import basic_authorization
from tests.support.sidecar import Sidecar, sidecar


def status(sc: Sidecar, path: str, user: str | None = None, password: str = "") -> int:
    headers = {} if user is None else {"Authorization": basic_authorization(user, password)}
    return sc.get(path, headers, timeout=10)[0]


def test_basic_auth_from_web_config(tmp_path: Path) -> None:
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    config = tmp_path / "web.yml"
    config.write_text(f"basic_auth_users:\n  prom: {hashed}\n")
    with sidecar(tmp_path, "--manifest-dir", str(tmp_path), "--no-nvml", f"--web.config.file={config}") as sc:
        assert status(sc, "/metrics") == 401
        assert status(sc, "/metrics", "prom", "wrong") == 401
        assert status(sc, "/metrics", "prom", "s3cret") == 200
        assert status(sc, "/", "prom", "s3cret") == 200


def test_bad_web_config_refuses_to_start(tmp_path: Path) -> None:
    config = tmp_path / "web.yml"
    config.write_text("no_such_key: 1\n")
    result = subprocess.run(
        [sys.executable, "-m", "kv_exporter", "serve", "--no-nvml", "--web.listen-address", "127.0.0.1:0",
         f"--web.config.file={config}"],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 1
    assert "no_such_key" in result.stderr
