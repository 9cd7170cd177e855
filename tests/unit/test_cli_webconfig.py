"""`kv-exporter serve --web.config.file`: the exporter-toolkit configuration reaches the real server."""

from __future__ import annotations

import base64
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import bcrypt

from tests.unit.test_cli import REPO, running


def get(url: str, user: str | None = None, password: str = "") -> int:
    request = urllib.request.Request(url)
    if user is not None:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_basic_auth_from_web_config(tmp_path: Path) -> None:
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    config = tmp_path / "web.yml"
    config.write_text(f"basic_auth_users:\n  prom: {hashed}\n")
    args = ("serve", "--manifest-dir", str(tmp_path), "--no-nvml", "--listen-address", "127.0.0.1:0")
    with running(*args, f"--web.config.file={config}") as (_, url):
        assert get(url + "/metrics") == 401
        assert get(url + "/metrics", "prom", "wrong") == 401
        assert get(url + "/metrics", "prom", "s3cret") == 200
        assert get(url + "/", "prom", "s3cret") == 200


def test_bad_web_config_refuses_to_start(tmp_path: Path) -> None:
    config = tmp_path / "web.yml"
    config.write_text("no_such_key: 1\n")
    result = subprocess.run(
        [sys.executable, "-m", "kv_exporter", "serve", "--no-nvml", "--listen-address", "127.0.0.1:0",
         f"--web.config.file={config}"],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 1
    assert "no_such_key" in result.stderr
