"""The wheel is the one abi3 wheel setup.py promises: tagged cp310-abi3, both C extensions in it named `*.abi3.so`,
and neither needing a symbol of the interpreter outside its stable ABI as far as a cheap look can tell (no `_Py*`
private, nothing of vectorcall, the buffer protocol or frames, which are not limited in 3.10). dist/'s wheel when it
is newer than every source it is built from (`make wheel-check` leaves one), otherwise one built here without
build isolation (this environment's setuptools, no package index); `scripts/wheel-check.sh` installs and runs it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.constants import REPO

SOURCES = (
    "setup.py",
    "pyproject.toml",
    "kv_exporter/plugin/_steps.c",
    "kv_exporter/plugin/observe/_tracker.c",
    "kv_exporter/plugin/observe/_tables.h",
)
EXTENSIONS = ("kv_exporter/plugin/_steps.abi3.so", "kv_exporter/plugin/observe/_tracker.abi3.so")
# Functions a 3.10 limited-API build must not import: each is either private or limited only from a later CPython.
NOT_LIMITED_IN_310 = (
    "PyObject_GetBuffer",
    "PyBuffer_Release",
    "PyFrame_GetBack",
    "PyFunction_Type",
    "PyUnicode_AsUTF8",
)
NOT_LIMITED_PREFIXES = ("_Py", "PyVectorcall", "PyObject_Vectorcall")
# The underscored names the stable ABI does export (the limited API's macros expand to them: Py_DECREF, Py_None,
# PY_SSIZE_T_CLEAN's argument parsing, ...); abi3audit (scripts/wheel-check.sh) checks against the whole list.
STABLE_UNDERSCORED = frozenset(
    [
        "_PyArg_ParseTupleAndKeywords_SizeT",
        "_PyArg_ParseTuple_SizeT",
        "_PyArg_Parse_SizeT",
        "_PyArg_VaParseTupleAndKeywords_SizeT",
        "_PyArg_VaParse_SizeT",
        "_PyErr_BadInternalCall",
        "_PyObject_CallFunction_SizeT",
        "_PyObject_CallMethod_SizeT",
        "_PyObject_GC_New",
        "_PyObject_GC_NewVar",
        "_PyObject_GC_Resize",
        "_PyObject_New",
        "_PyObject_NewVar",
        "_PyWeakref_RefType",
        "_PyWeakref_ProxyType",
        "_PyWeakref_CallableProxyType",
        "_Py_BuildValue_SizeT",
        "_Py_VaBuildValue_SizeT",
        "_Py_Dealloc",
        "_Py_DecRef",
        "_Py_IncRef",
        "_Py_NoneStruct",
        "_Py_NotImplementedStruct",
        "_Py_TrueStruct",
        "_Py_FalseStruct",
        "_Py_EllipsisObject",
        "_Py_SwappedOp",
        "_Py_CheckRecursiveCall",
        "_PyState_AddModule",
    ]
)


def fresh_dist_wheel() -> Path | None:
    wheels = sorted((REPO / "dist").glob("kv_exporter-*.whl"))
    if len(wheels) != 1:
        return None
    newest_source = max((REPO / source).stat().st_mtime for source in SOURCES)
    return wheels[0] if wheels[0].stat().st_mtime > newest_source else None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    found = fresh_dist_wheel()
    if found is not None:
        return found
    out = tmp_path_factory.mktemp("wheel")
    command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), "."]
    # A copy of the sources: the build's build/ and egg-info stay out of the checkout.
    source = tmp_path_factory.mktemp("source")
    for path in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(REPO / path, source / path)
    shutil.copytree(REPO / "kv_exporter", source / "kv_exporter", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    subprocess.run(command, cwd=source, check=True, timeout=120)
    (built,) = out.glob("kv_exporter-*.whl")
    return built


def test_the_wheel_is_tagged_cp310_abi3(wheel: Path) -> None:
    name, _version, python, abi, platform = wheel.stem.split("-")
    assert (name, python, abi) == ("kv_exporter", "cp310", "abi3"), wheel.name
    assert platform.startswith(("linux_", "manylinux")), wheel.name


def test_both_extensions_in_it_are_abi3(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        assert sorted(name for name in archive.namelist() if name.endswith(".so")) == list(EXTENSIONS)


@pytest.mark.parametrize("extension", EXTENSIONS)
def test_no_extension_imports_anything_outside_the_limited_api(wheel: Path, tmp_path: Path, extension: str) -> None:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm (binutils)")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(extension, tmp_path)
    listing = subprocess.run(
        [nm, "-D", "--undefined-only", str(tmp_path / extension)], capture_output=True, text=True, check=True
    ).stdout
    undefined = {line.split()[-1].split("@")[0] for line in listing.splitlines() if line.strip()}
    outside = sorted(
        symbol
        for symbol in undefined - STABLE_UNDERSCORED
        if symbol.startswith(NOT_LIMITED_PREFIXES) or symbol in NOT_LIMITED_IN_310
    )
    assert "PyModule_Create2" in undefined or "PyModuleDef_Init" in undefined, "not a Python extension?"
    assert outside == [], f"{extension} needs {outside}, outside the limited API of 3.10"
