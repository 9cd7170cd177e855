"""The plugin's two C extensions, the cache tracker and the step record's writer (everything else is in pyproject.toml).

Here rather than in pyproject.toml's `[tool.setuptools.ext-modules]`, which setuptools still warns is experimental
on every install. Both are written against CPython's limited API of 3.10 (each source defines `Py_LIMITED_API
0x030A0000` itself) and built as such (`py_limited_api`: named `*.abi3.so`), and the wheel is tagged `cp310-abi3`:
one wheel per architecture serves every CPython from 3.10 (`make wheel-check`; pyproject.toml's
`[tool.cibuildwheel]` builds them). Where that wheel is installed no compiler is needed. Optional: where pip builds
from the source and no C compiler is found the package still installs, and the worker reports its observation
unavailable ("not-built") and writes no step record; `make test` and the plugin image require both
(docs/CONTRACTS.md).
"""

from setuptools import Extension, setup

LIMITED_API = "cp310"  # the oldest CPython whose limited API the sources keep to (Py_LIMITED_API 0x030A0000)

setup(
    ext_modules=[
        Extension(
            "kv_exporter.plugin.observe._tracker",
            ["kv_exporter/plugin/observe/_tracker.c"],
            depends=["kv_exporter/plugin/observe/_tables.h"],
            optional=True,
            py_limited_api=True,
        ),
        Extension("kv_exporter.plugin._steps", ["kv_exporter/plugin/_steps.c"], optional=True, py_limited_api=True),
    ],
    options={"bdist_wheel": {"py_limited_api": LIMITED_API}},
)
