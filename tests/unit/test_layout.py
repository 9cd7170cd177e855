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


# What the transport may use outside its room: the package version (the client's User-Agent) and the client-certificate
# SAN check of the web configuration's TLS module (`web/tls.py`: plain `ssl`, nothing of the exporter).
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
        "kv_exporter.transport.server", "kv_exporter.transport.request_head", "kv_exporter.transport.fetch"
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
    assert [d for d in RowDriver if d.count_stated] == [RowDriver.FIXED]


CONTRACTS = PACKAGE.parent / "docs/CONTRACTS.md"


def documented_modules() -> set[str]:
    """Module paths (relative to kv_exporter/) that docs/CONTRACTS.md's ownership table names: a cell's first name
    carries its folder, the names after it in the same cell are in that folder (`plugin/identity.py`, `baseline.py`)."""
    text = CONTRACTS.read_text()
    table = text.split("## Module ownership\n", 1)[1].split("\n## ", 1)[0]
    found: set[str] = set()
    for line in table.splitlines()[2:]:
        if not line.startswith("| `"):
            continue
        names = re.findall(r"`([\w/]+\.py)`", line.split(" | ")[0])
        folder = names[0].rpartition("/")[0] if names else ""
        found.update(name if "/" in name else f"{folder}/{name}".lstrip("/") for name in names)
    return found


def test_contracts_names_every_module_and_no_other() -> None:
    modules = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")}
    documented = documented_modules()
    assert not modules - documented, f"modules docs/CONTRACTS.md does not name: {sorted(modules - documented)}"
    assert not documented - modules, (
        f"docs/CONTRACTS.md names modules that do not exist: {sorted(documented - modules)}"
    )


def test_the_package_docstring_names_its_rooms() -> None:
    """The package docstring counts the rooms it lists: the shared contract and each of ROOMS."""
    doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text())) or ""
    words = {2: "Two", 3: "Three", 4: "Four", 5: "Five"}
    assert f"{words[len(ROOMS) + 1]} rooms" in doc, doc
    for name in ROOMS:
        assert f"`{name}`" in doc, name


def defined_in(path: Path) -> dict[str, set[str]]:
    """Top-level classes, functions and constants of a module, each with what it defines (a class's methods)."""
    names: dict[str, set[str]] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = set()
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update((target.id, set()) for target in targets if isinstance(target, ast.Name))
    return names


def test_benchmarks_name_only_what_exists() -> None:
    """docs/benchmarks.md names code as `module.name`, `Class.method` or `Class`: each is still where it says."""
    text = (PACKAGE.parent / "docs/benchmarks.md").read_text()
    by_short = {name.rsplit(".", 1)[-1]: defined_in(path) for name, path in MODULES.items()}
    classes = {name: members for names in by_short.values() for name, members in names.items() if name[0].isupper()}
    stale = []
    for ref in sorted(set(re.findall(r"`([A-Za-z_][\w.]*)`", text))):
        head, _, attr = ref.rpartition(".")
        if attr == "py":
            continue  # a file name
        if head in by_short:
            known = attr in by_short[head]  # module.name
        elif head[:1].isupper():
            known = attr in classes.get(head, set()) or attr in EXTERNAL_CLASSES.get(head, set())  # Class.method
        elif head:
            known = attr not in classes  # a class of the package under a module it is not in
        else:
            known = not re.fullmatch(r"[A-Z]\w*[a-z]\w*", ref) or ref in classes or ref in EXTERNAL_CLASSES
        if not known:
            stale.append(ref)
    assert not stale, f"docs/benchmarks.md names what the source no longer has: {stale}"


# What docs/benchmarks.md names of other projects (transformers, prometheus_client) and the image's Dockerfile.
EXTERNAL_CLASSES: dict[str, set[str]] = {"DynamicCache": set(), "Gauge": set(), "Sample": set(), "Dockerfile": set()}
