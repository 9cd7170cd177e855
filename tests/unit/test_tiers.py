"""The torch-free tier stays torch-free: `make unit` runs tests/unit and tests/golden in .venv-unit, which holds the
package and requirements-unit.txt only. The tests that need torch or transformers live in tests/torch."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

from tests.support.constants import REPO

HEAVY = ("torch", "transformers", "vllm", "vllm_omni")
TIER = ("tests/unit", "tests/golden")


def tier_files() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for folder in TIER for p in (REPO / folder).glob("*.py"))


def test_no_tier_module_imports_torch_even_lazily() -> None:
    """No import of a heavy module anywhere in a tier file, at module level or inside a test (nor an importorskip:
    a skipped test in the tier would hide a torch test there)."""
    found = []
    for path in tier_files():
        for node in ast.walk(ast.parse((REPO / path).read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip" and node.args:
                names = [getattr(node.args[0], "value", "")]
            else:
                continue
            found += [f"{path}:{node.lineno} {name}" for name in names if name.split(".")[0] in HEAVY]
    assert not found, found


def test_the_tier_imports_with_torch_blocked() -> None:
    """Every tier module and whatever it imports (the package, tests/support) imports in a process where torch,
    transformers and vLLM cannot be imported, and none of them is loaded afterwards."""
    modules = [path.removesuffix(".py").replace("/", ".") for path in tier_files()]
    code = f"""
import importlib, sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {HEAVY!r}:
            raise ModuleNotFoundError(f"{{name}} is outside the torch-free tier")
sys.meta_path.insert(0, Blocked())
for name in {modules!r}:
    importlib.import_module(name)
print(sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r}))
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"


def test_the_tier_environment_holds_no_torch() -> None:
    requirements = (REPO / "requirements-unit.txt").read_text().splitlines()
    names = [re.split(r"[<>=!~\[; ]", line.strip(), maxsplit=1)[0] for line in requirements]
    names = [n.lower() for n in names if n and not n.startswith(("#", "-"))]
    assert names and not set(names) & set(HEAVY), names
    makefile = (REPO / "Makefile").read_text()
    assert re.search(
        r"^unit: \$\(UNIT_STAMP\)\n\t\$\(UNIT_VENV\)/bin/python -m pytest -q \$\(UNIT_TESTS\)$", makefile, re.M
    )
    assert re.search(rf"^UNIT_TESTS := {' '.join(TIER)}$", makefile, re.M)
