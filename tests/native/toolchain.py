"""Building the tracker's C for the C-level tests: its tables alone, and the whole extension with AddressSanitizer and
UndefinedBehaviorSanitizer, for this interpreter (its headers and libpython, as sysconfig reports them)."""

from __future__ import annotations

import subprocess
import sysconfig
from pathlib import Path

from tests.support.constants import REPO

OBSERVE = REPO / "kv_exporter" / "plugin" / "observe"
TRACKER_MODULE = "kv_exporter.plugin.observe._tracker"
# Every error a sanitizer finds stops the process (UBSan otherwise prints and carries on); frames kept for reports.
SANITIZE = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g", "-O1")


def compile_c(arguments: list[str | Path]) -> None:
    result = subprocess.run(["gcc", *map(str, arguments)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-4000:]


def gcc_library(name: str) -> str:
    path = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True, check=True).stdout
    assert Path(path.strip()).is_absolute(), f"gcc knows no {name} ({path!r})"
    return path.strip()


def preloaded() -> str:
    """What a sanitized extension needs loaded first into an interpreter not built with it: ASan's runtime, and the C++
    runtime, which ASan's interceptor of C++ throws looks up as it starts (torch throws; without it ASan aborts)."""
    return f"{gcc_library('libasan.so')}:{gcc_library('libstdc++.so')}"


def sanitizer_env(base: dict[str, str], reports: Path) -> dict[str, str]:
    """The interpreter's own allocations are not ASan's to report (detect_leaks=0: CPython keeps much at exit), but
    every object goes through malloc (PYTHONMALLOC=malloc), so a use after free of one is seen, not hidden in
    pymalloc's arenas. Reports go to files `reports`.PID (pytest captures the standard error a report would go to)."""
    return {
        **base,
        "LD_PRELOAD": preloaded(),
        "ASAN_OPTIONS": f"detect_leaks=0:log_path={reports}",
        "UBSAN_OPTIONS": f"print_stacktrace=1:log_path={reports}",
        "PYTHONMALLOC": "malloc",
    }


def sanitizer_reports(reports: Path) -> str:
    return "".join(path.read_text() for path in sorted(reports.parent.glob(f"{reports.name}.*")))


def embedding_flags() -> list[str]:
    """Compiling and linking a program that embeds this interpreter."""
    libdir = sysconfig.get_config_var("LIBDIR")
    version = sysconfig.get_config_var("LDVERSION")
    return [f"-I{sysconfig.get_paths()['include']}", f"-L{libdir}", f"-Wl,-rpath,{libdir}", f"-lpython{version}"]


def build_sanitized_tracker(folder: Path) -> Path:
    """The tracker extension as setup.py builds it, plus both sanitizers; its path, named as the module's file."""
    target = folder / f"_tracker{sysconfig.get_config_var('EXT_SUFFIX')}"
    include = sysconfig.get_paths()["include"]
    compile_c(["-shared", "-fPIC", *SANITIZE, f"-I{include}", OBSERVE / "_tracker.c", "-o", target])
    return target


def preloading(extension: Path, then: str) -> str:
    """Python code that loads `extension` as the tracker module, before anything imports it, then runs `then`."""
    return f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location({TRACKER_MODULE!r}, {str(extension)!r})
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
{then}
"""
