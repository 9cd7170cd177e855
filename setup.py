"""The plugin's two C extensions, the cache tracker and the step record's writer (everything else is in pyproject.toml).

Here rather than in pyproject.toml's `[tool.setuptools.ext-modules]`, which setuptools still warns is experimental
on every install. Optional: where no C compiler is found the package still installs, and the worker reports its
observation unavailable ("not-built") and writes no step record; `make test` and the plugin image require both
(docs/CONTRACTS.md).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kv_exporter.plugin.observe._tracker",
            ["kv_exporter/plugin/observe/_tracker.c"],
            depends=["kv_exporter/plugin/observe/_tables.h"],
            optional=True,
        ),
        Extension("kv_exporter.plugin._steps", ["kv_exporter/plugin/_steps.c"], optional=True),
    ]
)
