"""The tree shows the architecture, and keeps showing it: the rules docs/CONTRACTS.md states, checked on the source.

Imports are read with `ast` (nothing is executed), including imports inside functions and under TYPE_CHECKING:
a lazy import still makes one room depend on another.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kv_exporter.protocol import RowDriver

PACKAGE = Path(__file__).resolve().parents[2] / "kv_exporter"
MAX_MODULE_LINES = 450
ROOMS = ("plugin", "sidecar", "web", "transport")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """The package's own modules that `name` imports (a `from package import module` counts as the module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert not node.level, f"{name}: relative import of {node.module}"
            base = node.module
            submodules = {f"{base}.{alias.name}" for alias in node.names} & MODULES.keys()
            # `from package import module` depends on the module; a name from the package depends on the package.
            found.update(submodules if len(submodules) == len(node.names) else {base, *submodules})
    return {module for module in found if module in MODULES and module != name}


def room(name: str) -> str:
    if name == "kv_exporter.__main__":  # `python -m kv_exporter`: the sidecar's command line
        return "sidecar"
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ROOMS else "contract"


# The vllm.general_plugins entry point (`kv_exporter.register`) imports the plugin when vLLM calls it: the one edge
# from the top of the package into a room, by design.
ENTRY_POINT_EDGE = ("kv_exporter", "kv_exporter.plugin")
GRAPH = {name: imports_of(name) - ({ENTRY_POINT_EDGE[1]} if name == ENTRY_POINT_EDGE[0] else set()) for name in MODULES}


@pytest.mark.parametrize(("importer", "forbidden"), [("plugin", "sidecar"), ("sidecar", "plugin"), ("plugin", "web")])
def test_rooms_do_not_import_each_other(importer: str, forbidden: str) -> None:
    crossings = sorted(
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        if room(name) == importer
        for target in targets
        if room(target) == forbidden
    )
    assert crossings == []


def test_the_contract_and_the_web_config_import_no_room_above_them() -> None:
    allowed = {"contract": {"contract"}, "web": {"contract", "web"}}
    crossings = sorted(
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        if room(name) in allowed
        for target in targets
        if room(target) not in allowed[room(name)]
    )
    assert crossings == []


# What the transport may use outside its room: the package version (the client's User-Agent) and the TLS handshake
# machinery that the web configuration's module still holds (`web/tls.py`: plain `ssl`, nothing of the exporter).
TRANSPORT_MAY_IMPORT = {"kv_exporter", "kv_exporter.web.tls"}


def test_the_transport_imports_nothing_of_the_exporter() -> None:
    """HTTP server and client know requests and bytes, never manifests, inputs, snapshots, families or
    collections: routing, statuses and what a collection timeout means live with the application (`sidecar`)."""
    crossings = sorted(
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        if room(name) == "transport"
        for target in targets
        if room(target) != "transport" and target not in TRANSPORT_MAY_IMPORT
    )
    assert crossings == []
    assert {name for name in MODULES if room(name) == "transport"} >= {
        "kv_exporter.transport.connections", "kv_exporter.transport.request_head", "kv_exporter.transport.fetch"
    }  # fmt: skip


def test_no_import_cycle_inside_the_package() -> None:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(GRAPH[name]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_no_module_is_over_the_size_a_reader_can_hold() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    assert {name: lines for name, lines in sizes.items() if lines > MAX_MODULE_LINES} == {}


def test_the_checker_sees_the_imports_it_guards() -> None:
    # The rules above are only as good as the import graph: it must see a known edge of each kind.
    assert "kv_exporter.manifest" in GRAPH["kv_exporter.plugin.publish"]
    assert "kv_exporter.sidecar.snapshot" in GRAPH["kv_exporter.sidecar.families"]
    assert "kv_exporter.web.reload" in GRAPH["kv_exporter.sidecar.cli"]  # a lazy import inside a function


def test_only_the_protocol_branches_on_a_row_driver() -> None:
    """RowDriver carries its own rules; elsewhere a member is named only to declare a cache, never to branch on it."""
    branching = re.compile(
        r"(\bis\b|==|!=|\bin\b)\s*\(?\s*RowDriver\.|RowDriver\.\w+\s*(==|!=|\bis\b)|[!=]= \"(fixed|max_num_seqs)\""
    )
    assert branching.search("if d.rows is RowDriver.FIXED:") and branching.search('return x.rows == "fixed"')
    found = [
        f"{name}: {line.strip()}"
        for name, path in MODULES.items()
        if name != "kv_exporter.protocol"
        for line in path.read_text().splitlines()
        if branching.search(line)
    ]
    assert found == []


def test_every_row_driver_has_its_rules() -> None:
    for driver in RowDriver:
        assert driver.rows_at_ceiling(3, 0) >= 1 and driver.rows_running(3, 0) >= 0
    assert [d for d in RowDriver if d.scales_with_max_num_seqs] == [RowDriver.MAX_NUM_SEQS]
