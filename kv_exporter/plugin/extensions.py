"""Whether the plugin's C extensions load, said where the plugin is installed and where vLLM registers it.

pip builds both as optional (setup.py): where the engine's image has no C compiler or no Python headers the package
still installs, and without them a worker cannot observe its caches (observation reported "not-built") or keep a
step record. That must not be found out from a metric weeks later:
- `python -m kv_exporter.plugin --check` (`main`) exits 1 naming each extension that does not load and why, and the
  fix; install-plugin.sh runs it, so an image without them is refused at build;
- `register()` (every process vLLM starts) logs an error, once per process, for each one the settings need (the
  tracker unless KV_EXPORTER_OBSERVE_INTERVAL=0, the step writer unless KV_EXPORTER_STEP_RECORD=0). It never raises:
  the engine serves on, with the declarations published; a missing extension costs only what it measures.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points

from kv_exporter.plugin.oncelog import logger
from kv_exporter.plugin.settings import ENV_OBSERVE_INTERVAL, ENV_STEP_RECORD, HookSettings

__all__ = ["EXTENSIONS", "Extension", "main", "report_missing", "unloadable"]

ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT = "kv_exporter"
FIX = (
    "kv-exporter's wheel (cp310-abi3: CPython 3.10 and later, Linux x86_64 and aarch64) has it built; installed from "
    "the source, it is compiled: install a C compiler and this Python's headers (Debian/Ubuntu: "
    "gcc and python3-dev, or the python3.X-dev of this interpreter), then reinstall kv-exporter"
)


@dataclass(frozen=True)
class Extension:
    module: str
    what: str  # what it is
    without: str  # what a worker does without it
    switch: str  # the setting that turns off what needs it


EXTENSIONS = (
    Extension(
        "kv_exporter.plugin.observe._tracker",
        "the cache tracker",
        'observes no cache (its observation is reported unavailable, "not-built")',
        f"{ENV_OBSERVE_INTERVAL}=0",
    ),
    Extension(
        "kv_exporter.plugin._steps",
        "the step record's writer",
        "keeps no step record (the sidecar reads running sequences from the engine's page instead)",
        f"{ENV_STEP_RECORD}=0",
    ),
)


def unloadable(extensions: Sequence[Extension] = EXTENSIONS) -> dict[Extension, str]:
    """Each of `extensions` that does not import here, with the error it raised."""
    found = {}
    for extension in extensions:
        try:
            importlib.import_module(extension.module)
        except Exception as exc:  # not built (ImportError), or built for another interpreter, or failing its init
            found[extension] = f"{type(exc).__name__}: {exc}"
    return found


def needed(settings: HookSettings) -> list[Extension]:
    """The extensions what `settings` turn on needs."""
    tracker, steps = EXTENSIONS
    return [
        extension for extension, on in ((tracker, settings.observe_interval_s > 0), (steps, settings.step_record)) if on
    ]


def report_missing(settings: HookSettings) -> None:
    """At registration (once per process: `register` is idempotent): an error for each extension the settings need
    that does not load."""
    for extension, error in unloadable(needed(settings)).items():
        logger.error(
            "kv-exporter: %s (%s) cannot load (%s): every worker %s. Either %s, or set %s. "
            "`python -m kv_exporter.plugin --check` says whether it loads.",
            extension.what,
            extension.module,
            error,
            extension.without,
            FIX,
            extension.switch,
        )


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kv_exporter.plugin --check`: 0 when vLLM will find the plugin and both extensions load."""
    parser = argparse.ArgumentParser(prog="python -m kv_exporter.plugin", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", required=True, help="check the installed plugin")
    parser.parse_args(argv)
    problems = [
        f"{extension.what} ({extension.module}) cannot load ({error}): every worker {extension.without}; {FIX}"
        for extension, error in unloadable().items()
    ]
    if ENTRY_POINT not in [point.name for point in entry_points(group=ENTRY_POINT_GROUP)]:
        problems.append(f"vLLM will not find the plugin: no {ENTRY_POINT!r} entry point in {ENTRY_POINT_GROUP}")
    for problem in problems:
        print(f"kv-exporter plugin check: {problem}", file=sys.stderr)
    if not problems:
        print(f"kv-exporter plugin check: ok ({', '.join(extension.what for extension in EXTENSIONS)} load)")
    return 1 if problems else 0
