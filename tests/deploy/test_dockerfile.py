"""The Dockerfile: hadolint-clean, the right stages, and its install steps run here exactly as written.

No Docker engine runs on these machines. The build stage's work is in deploy/docker/install-sidecar.sh and the
plugin stage's in deploy/docker/install-plugin.sh; this test lays out the files the Dockerfile's COPY lines
copy, runs the same scripts, and then runs the installed sidecar and the image's HEALTHCHECK command.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.deploy.helpers import run, tool, wait_http
from tests.support.constants import REPO
from tests.support.net import free_port
from tests.support.sidecar import stop_process

DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"


@dataclass
class Instruction:
    keyword: str
    args: str


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[Instruction]

    def all(self, keyword: str) -> list[str]:
        return [i.args for i in self.instructions if i.keyword == keyword]


def parse_dockerfile(text: str) -> list[Stage]:
    """Instructions per stage (continuation lines joined, comments dropped)."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        if raw.lstrip().startswith("#") or not raw.strip():
            continue
        pending += raw.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        lines.append(pending.strip())
        pending = ""
    stages: list[Stage] = []
    for line in lines:
        keyword, _, args = line.partition(" ")
        if keyword.upper() == "FROM":
            base, _, name = args.partition(" AS ")
            stages.append(Stage(name.strip(), base.strip(), []))
        elif stages:
            stages[-1].instructions.append(Instruction(keyword.upper(), args.strip()))
    return stages


STAGES = {stage.name: stage for stage in parse_dockerfile(DOCKERFILE.read_text())}


def test_hadolint() -> None:
    run(tool("hadolint"), "--failure-threshold", "info", str(DOCKERFILE))


def test_shell_scripts_pass_shellcheck() -> None:
    scripts = [*sorted((REPO / "deploy/docker").glob("*.sh")), REPO / "scripts/ensure-system-deps.sh"]
    run(tool("shellcheck"), *map(str, scripts))


def test_hadolint_is_live(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\n")
    proc = subprocess.run([tool("hadolint"), str(bad)], capture_output=True, text=True, check=False)
    assert proc.returncode != 0 and "DL3007" in proc.stdout


def test_stages() -> None:
    assert list(STAGES) == ["build", "vllm-plugin", "sidecar"], "sidecar must be the last (default) target"
    sidecar = STAGES["sidecar"]
    (user,) = sidecar.all("USER")
    uid, _, gid = user.partition(":")
    # Numeric, so that Kubernetes' runAsNonRoot can verify it; not root.
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit()
    assert sidecar.all("HEALTHCHECK") and sidecar.all("EXPOSE") == ["9477"]
    assert json.loads(sidecar.all("ENTRYPOINT")[0]) == ["kv-exporter"]
    # The sidecar stage copies the built venv, never the vLLM image's environment.
    assert all("--from=build" in c for c in sidecar.all("COPY") if c.startswith("--from"))


def dockerignore_allows(path: str) -> bool:
    """Docker's rule: a pattern matches a path or any of its parents; the last matching pattern wins."""
    patterns = [p.strip() for p in DOCKERIGNORE.read_text().splitlines() if p.strip() and not p.startswith("#")]
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[:depth]) for depth in range(1, len(parts) + 1)]
    allowed = True
    for pattern in patterns:
        glob = pattern.removeprefix("!").rstrip("/")
        globs = {glob, glob.removeprefix("**/")}
        if any(fnmatch.fnmatch(prefix, g) for prefix in prefixes for g in globs):
            allowed = pattern.startswith("!")
    return allowed


def copy_sources() -> list[tuple[str, str]]:
    """(source in the build context, destination) for every COPY that reads the context."""
    pairs = []
    for stage in STAGES.values():
        for args in stage.all("COPY"):
            if args.startswith("--from"):
                continue
            *sources, dest = shlex.split(args)
            pairs += [(src, dest) for src in sources]
    return pairs


def test_dockerignore_admits_what_copy_needs_and_nothing_heavy() -> None:
    for source, _ in copy_sources():
        assert (REPO / source).exists(), f"COPY source {source} missing"
        assert dockerignore_allows(source), f".dockerignore excludes COPY source {source}"
    # the tracker this host built in place (abi3 now, this interpreter's suffix before), not the image's
    built = [
        f"kv_exporter/plugin/observe/_tracker{suffix}"
        for suffix in (".abi3.so", sysconfig.get_config_var("EXT_SUFFIX"))
    ]
    for heavy in (".venv", ".venv-vllm", "tests", ".git", "kv_exporter/__pycache__", *built):
        assert not dockerignore_allows(heavy), f".dockerignore lets {heavy} into the build context"


def lay_out_build_context(stage: Stage, root: Path) -> Path:
    """Copy what the stage's COPY lines copy, to where they put it (WORKDIR relative), under `root`."""
    (workdir,) = stage.all("WORKDIR")
    for args in stage.all("COPY"):
        *sources, dest = shlex.split(args)
        target_dir = root / (dest.lstrip("/") if dest.startswith("/") else f"{workdir.lstrip('/')}/{dest}")
        target_dir.mkdir(parents=True, exist_ok=True)
        for source in sources:
            path = REPO / source
            if path.is_dir():
                shutil.copytree(
                    path, target_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", "*.so")
                )
            else:
                shutil.copy2(path, target_dir / path.name)
    return root / workdir.lstrip("/")


def run_step(run_args: str, root: Path, replacements: dict[str, Path], env: dict[str, str]) -> None:
    """A RUN line of the Dockerfile with its absolute paths moved under `root`; scripts from /usr/local/bin. It runs
    in `root`, so no Python it starts finds this checkout's package in its working directory."""
    argv = shlex.split(run_args.split("&&")[0])
    argv = [str(replacements.get(a, a)) for a in argv]
    script = root / "usr/local/bin" / argv[0]
    run("sh", str(script), *argv[1:], cwd=root, env=env, timeout=600)


BUILT_REVISION = "0123456789abcdef0123456789abcdef01234567"  # what `--build-arg REVISION=...` passes


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """The build stage's RUN, as written, on a copy of its build context: (venv prefix, wheel folder)."""
    root = tmp_path_factory.mktemp("image")
    build = STAGES["build"]
    src = lay_out_build_context(build, root)
    prefix, wheels = root / "opt/kv-exporter", root / "wheels"
    env = {**os.environ, "PYTHON": sys.executable, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "REVISION": BUILT_REVISION}
    (run_line,) = build.all("RUN")
    run_step(run_line, root, {"/src": src, "/opt/kv-exporter": prefix, "/wheels": wheels}, env)
    yield prefix, wheels


def test_sidecar_install_has_no_torch_and_runs(installed: tuple[Path, Path]) -> None:
    prefix, wheels = installed
    assert len(list(wheels.glob("kv_exporter-*.whl"))) == 1
    out = run(str(prefix / "bin/python"), "-c", "import kv_exporter.sidecar.cli, pynvml, yaml, bcrypt; print('ok')")
    assert out.strip() == "ok"
    for heavy in ("torch", "vllm", "transformers"):
        assert not list((prefix / "lib").glob(f"python*/site-packages/{heavy}")), heavy
    assert "serve" in run(str(prefix / "bin/kv-exporter"), "--help")


def test_building_the_package_prints_no_deprecation(tmp_path: Path) -> None:
    """What an operator sees on `pip install`: setuptools deprecated the license table, kv-exporter uses SPDX."""
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-w", str(tmp_path), str(REPO)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    assert "deprecat" not in (built.stdout + built.stderr).lower(), built.stderr
    (wheel,) = tmp_path.glob("kv_exporter-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()


def test_the_image_knows_the_revision_it_was_built_from(installed: tuple[Path, Path]) -> None:
    prefix, _ = installed
    version = run(str(prefix / "bin/kv-exporter"), "--version").strip()
    assert version.startswith("kv-exporter, version ") and f"(revision: {BUILT_REVISION}, python: " in version
    assert "ARG REVISION=unknown" in DOCKERFILE.read_text()  # the build argument the script reads


def healthcheck_argv(prefix: Path) -> list[str]:
    """The HEALTHCHECK CMD of the sidecar stage, with the image's paths mapped to the test's install."""
    (line,) = STAGES["sidecar"].all("HEALTHCHECK")
    argv: list[str] = json.loads(line[line.index("CMD") + 3 :].strip())
    mapped = {"/opt/kv-exporter/bin/python": str(prefix / "bin/python")}
    copies = {dest: REPO / src for src, dest in copy_sources() if dest.startswith("/opt/kv-exporter/")}
    return [mapped.get(a) or str(copies.get(a, a)) for a in argv]


def test_healthcheck_against_the_installed_sidecar(installed: tuple[Path, Path], tmp_path: Path) -> None:
    prefix, _ = installed
    port = free_port()
    env = {**os.environ, "KV_EXPORTER_HEALTH_URL": f"http://127.0.0.1:{port}/healthz"}
    argv = healthcheck_argv(prefix)
    # Nothing listens yet: unhealthy.
    assert subprocess.run(argv, env=env, capture_output=True, check=False).returncode == 1
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    proc = subprocess.Popen(
        [
            str(prefix / "bin/kv-exporter"),
            "serve",
            f"--manifest-dir={manifests}",
            "--no-nvml",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", 30, proc)
        assert subprocess.run(argv, env=env, capture_output=True, check=False).returncode == 0
    finally:
        stop_process(proc)


def test_plugin_install_step(installed: tuple[Path, Path], tmp_path: Path) -> None:
    """The vllm-plugin stage's RUN into a fresh environment, from the build stage's source as its COPY takes it:
    vLLM's plugin loader would find kv_exporter, and the cache tracker is built for this interpreter."""
    prefix, _ = installed
    built_source = prefix.parents[1] / "src"  # the build stage's WORKDIR under the fixture's root
    venv = tmp_path / "vllm-image-python"
    run(sys.executable, "-m", "venv", str(venv))
    stage = STAGES["vllm-plugin"]
    root = tmp_path / "root"
    (root / "usr/local/bin").mkdir(parents=True)
    for source, dest in copy_sources():
        if source.endswith("install-plugin.sh"):
            shutil.copy2(REPO / source, root / dest.lstrip("/") / Path(source).name)
    env = {**os.environ, "PYTHON": str(venv / "bin/python"), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    (run_line,) = stage.all("RUN")
    run_step(run_line, root, {"/tmp/kv-exporter-src": built_source}, env)
    out = run(
        str(venv / "bin/python"),
        "-c",
        "from importlib.metadata import entry_points; import kv_exporter.plugin.observe._tracker as t;"
        "print([e.value for e in entry_points(group='vllm.general_plugins') if e.name == 'kv_exporter'], t.__file__)",
        cwd=tmp_path,
    )
    assert out.startswith("['kv_exporter:register'] ") and str(venv) in out, out
