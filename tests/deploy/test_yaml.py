"""Every YAML file under deploy/ passes yamllint."""

from __future__ import annotations

from tests.deploy.helpers import DEPLOY, run, tool
from tests.support.constants import REPO


def test_yamllint() -> None:
    # Relative paths: yamllint matches its `ignore` patterns against them.
    run(tool("yamllint"), "--strict", "-c", "tests/deploy/yamllint.yaml", str(DEPLOY.relative_to(REPO)), cwd=REPO)
