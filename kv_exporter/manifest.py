"""The manifest: the one contract between the hook (inside the engine) and the sidecar.

One JSON document per worker process, named from the engine's identity and ranks so a restarted engine overwrites
its own file. Written atomically; read strictly: a bad file raises `ManifestError` naming the file and a short
reason code (used as a metric label), and nothing is guessed. No torch, no vllm.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import tempfile
import time
import zlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from kv_exporter import __version__
from kv_exporter.dtypes import UnknownDTypeError, dtype_itemsize, dtype_name
from kv_exporter.procfs import current_pid_namespace, process_start_ticks
from kv_exporter.protocol import ModelLocalKVScope, RowDriver

SCHEMA_VERSION = 1
MANIFEST_SUFFIX = ".json"
# The folder the hook writes to and the sidecar reads, unless told otherwise (an emptyDir shared in the pod).
DEFAULT_MANIFEST_DIR = "/run/kv-exporter"
COLLECTORS = ("vllm_omni", "kv_exporter")

# Integers in a manifest must survive any JSON reader exactly.
MAX_SAFE_INT = 2**53 - 1


class Phase(str, Enum):
    """When the manifest was written: after load_model, or again after warm-up / graph capture."""

    LOAD = "load"
    WARMUP = "warmup"


@dataclass(frozen=True)
class ManifestLimits:
    """Caps that keep one runaway declarer from blowing up the sidecar or Prometheus."""

    max_bytes: int = 1 << 20
    max_declarations: int = 256


DEFAULT_LIMITS = ManifestLimits()


class ManifestError(ValueError):
    """A manifest that cannot be used. `reason` is a short stable code; `detail` says what exactly."""

    def __init__(self, path: str, reason: str, detail: str) -> None:
        super().__init__(f"{path}: {reason}: {detail}")
        self.path = path
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Declaration:
    """One declaration as published: every spec field, plus its owner path and precomputed sizes."""

    owner: str
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    itemsize: int
    physical_capacity_positions: int
    capacity_source: str
    scope: str
    rows: str
    rows_fixed: int
    rows_reason: str
    allocation_note: str | None
    bytes_per_row: int

    @classmethod
    def from_spec(cls, owner: str, spec: Any) -> Declaration:
        """From our spec or vllm-omni's own (duck-typed on field names and enum values)."""
        dtype = dtype_name(spec.dtype)
        itemsize = dtype_itemsize(dtype)
        layers, kv_heads, head_dim = int(spec.layers), int(spec.kv_heads), int(spec.head_dim)
        positions = int(spec.physical_capacity_positions)
        return cls(
            owner=owner,
            name=str(spec.name),
            layers=layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            itemsize=itemsize,
            physical_capacity_positions=positions,
            capacity_source=str(spec.capacity_source),
            scope=ModelLocalKVScope(_enum_value(spec.scope)).value,
            rows=RowDriver(_enum_value(spec.rows)).value,
            rows_fixed=int(getattr(spec, "rows_fixed", 1)),
            rows_reason=str(getattr(spec, "rows_reason", "")),
            allocation_note=None if spec.allocation_note is None else str(spec.allocation_note),
            bytes_per_row=2 * layers * kv_heads * head_dim * positions * itemsize,
        )

    @property
    def is_fixed(self) -> bool:
        return self.rows == RowDriver.FIXED.value

    def rows_at(self, sequences: int) -> int:
        """Rows live when `sequences` sequences run (0 allowed): rows_fixed for FIXED."""
        return self.rows_fixed if self.is_fixed else max(0, sequences)

    def row_count(self, max_num_seqs: int = 1) -> int:
        """Rows at peak, as vllm-omni counts them: rows_fixed for FIXED, else max(1, max_num_seqs)."""
        return self.rows_fixed if self.is_fixed else max(1, max_num_seqs)

    def peak_bytes(self, max_num_seqs: int = 1) -> int:
        return self.bytes_per_row * self.row_count(max_num_seqs)


def _enum_value(value: object) -> str:
    """`RowDriver.FIXED`, vllm-omni's own enum member, or the plain string all give "fixed"."""
    return str(getattr(value, "value", value))


@dataclass(frozen=True)
class EngineIdentity:
    """Which engine a worker belongs to, in the terms vLLM's and vllm-omni's metric labels use."""

    model_name: str
    stage: int = 0
    engine_index: int = 0  # vLLM's `engine` label (data-parallel engine index); vllm-omni's `replica`
    data_parallel_rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0


@dataclass(frozen=True)
class DeviceInfo:
    kind: str = "cuda"
    index: int | None = None  # physical index, after the CUDA_VISIBLE_DEVICES mapping
    uuid: str | None = None  # as NVML and dcgm-exporter spell it ("GPU-...")


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    start_time_ticks: int | None = None  # field 22 of /proc/PID/stat: tells a reused pid from the original
    pid_namespace: str | None = None  # readlink /proc/self/ns/pid: whether the sidecar can check the pid
    hostname: str = ""

    @classmethod
    def current(cls) -> ProcessInfo:
        pid = os.getpid()
        return cls(
            pid=pid,
            start_time_ticks=process_start_ticks(pid),
            pid_namespace=current_pid_namespace(),
            hostname=socket.gethostname(),
        )


@dataclass(frozen=True)
class Baseline:
    """The worker's GPU memory when the manifest was written, where measurable."""

    nvml_process_used_bytes: int | None = None
    torch_reserved_bytes: int | None = None


@dataclass(frozen=True)
class Manifest:
    engine: EngineIdentity
    process: ProcessInfo
    device: DeviceInfo
    max_num_seqs: int
    phase: Phase
    collector: str
    declarations: tuple[Declaration, ...]
    baseline: Baseline = Baseline()
    written_at: float = field(default_factory=time.time)
    writer_version: str = __version__
    schema_version: int = SCHEMA_VERSION

    def declared_peak_bytes(self, max_num_seqs: int | None = None) -> int:
        """Sum of the declarations at `max_num_seqs` (the manifest's own by default)."""
        seqs = self.max_num_seqs if max_num_seqs is None else max_num_seqs
        return sum(d.peak_bytes(seqs) for d in self.declarations)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["phase"] = self.phase.value
        data["declarations"] = [asdict(d) for d in self.declarations]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False) + "\n"


def manifest_filename(engine: EngineIdentity) -> str:
    """Stable per engine identity and ranks; readable, and collision-safe for model names with odd characters."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", engine.model_name).strip("._")[:80] or "model"
    digest = zlib.crc32(engine.model_name.encode()) & 0xFFFFFFFF
    return (
        f"{slug}-{digest:08x}.stage{engine.stage}.engine{engine.engine_index}"
        f".dp{engine.data_parallel_rank}.tp{engine.tp_rank}.pp{engine.pp_rank}{MANIFEST_SUFFIX}"
    )


def write_manifest(directory: str | os.PathLike[str], manifest: Manifest) -> Path:
    """Write atomically: a temporary file in the same folder, fsync, rename. Readers never see half a file."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / manifest_filename(manifest.engine)
    payload = manifest.to_json().encode()
    # A leading dot keeps readers, which list *.json without dot-files, away from the temporary file.
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".part", dir=folder)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(payload)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        with _suppress_oserror():
            os.unlink(tmp)
        raise
    _fsync_directory(folder)
    return target


class _suppress_oserror:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        return kind is not None and issubclass(kind, OSError)


def _fsync_directory(folder: Path) -> None:
    """Make the rename durable; some filesystems refuse to open a directory, which is fine to ignore."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_manifest_name(name: str) -> bool:
    return name.endswith(MANIFEST_SUFFIX) and not name.startswith(".")


def read_manifest(path: str | os.PathLike[str], limits: ManifestLimits = DEFAULT_LIMITS) -> Manifest:
    """Read and validate one manifest file; raises `ManifestError` for anything unusable."""
    source = os.fspath(path)
    try:
        with open(source, "rb") as handle:
            data = handle.read(limits.max_bytes + 1)
    except OSError as exc:
        raise ManifestError(source, "unreadable", exc.strerror or str(exc)) from exc
    return parse_manifest(data, source, limits)


def parse_manifest(data: bytes, source: str, limits: ManifestLimits = DEFAULT_LIMITS) -> Manifest:
    """Validate a manifest document; `source` names it in errors."""
    if len(data) > limits.max_bytes:
        raise ManifestError(source, "too_large", f"more than {limits.max_bytes} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(source, "not_utf8", str(exc)) from exc
    try:
        document = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:
        raise ManifestError(source, "invalid_json", str(exc)[:200]) from exc
    return _Validator(source, limits).manifest(document)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


E = TypeVar("E", bound=Enum)


class _Validator:
    """Turns a decoded JSON document into a `Manifest`, or raises the first problem as a `ManifestError`."""

    def __init__(self, source: str, limits: ManifestLimits) -> None:
        self.source = source
        self.limits = limits

    def fail(self, reason: str, detail: str) -> ManifestError:
        return ManifestError(self.source, reason, detail)

    def manifest(self, doc: object) -> Manifest:
        obj = self.fields(doc, "manifest", _TOP_FIELDS)
        version = obj["schema_version"]
        if isinstance(version, bool) or not isinstance(version, int):
            raise self.fail("wrong_type", f"schema_version must be an integer, got {type(version).__name__}")
        if version != SCHEMA_VERSION:
            raise self.fail("unsupported_schema_version", f"got {version}; this reader knows {SCHEMA_VERSION}")
        written_at = self.number(obj, "written_at", "manifest")
        declarations = self.array(obj, "declarations")
        if len(declarations) > self.limits.max_declarations:
            raise self.fail("too_many_declarations", f"{len(declarations)} > limit {self.limits.max_declarations}")
        parsed = tuple(self.declaration(item, i) for i, item in enumerate(declarations))
        seen: set[tuple[str, str]] = set()
        for decl in parsed:
            if (decl.owner, decl.name) in seen:
                raise self.fail("duplicate_declaration", f"owner {decl.owner!r} declares {decl.name!r} twice")
            seen.add((decl.owner, decl.name))
        return Manifest(
            engine=self.engine(obj["engine"]),
            process=self.process(obj["process"]),
            device=self.device(obj["device"]),
            max_num_seqs=self.integer(obj, "max_num_seqs", "manifest", minimum=1),
            phase=self.enum(obj, "phase", Phase, "manifest"),
            collector=self.choice(obj, "collector", COLLECTORS, "manifest"),
            declarations=parsed,
            baseline=self.baseline(obj["baseline"]),
            written_at=written_at,
            writer_version=self.text(obj, "writer_version", "manifest", blank_ok=False),
            schema_version=version,
        )

    def engine(self, doc: object) -> EngineIdentity:
        obj = self.fields(doc, "engine", _ENGINE_FIELDS)
        return EngineIdentity(
            model_name=self.text(obj, "model_name", "engine", blank_ok=False),
            **{name: self.integer(obj, name, "engine", minimum=0) for name in _ENGINE_FIELDS if name != "model_name"},
        )

    def process(self, doc: object) -> ProcessInfo:
        obj = self.fields(doc, "process", _PROCESS_FIELDS)
        return ProcessInfo(
            pid=self.integer(obj, "pid", "process", minimum=1),
            start_time_ticks=self.opt_integer(obj, "start_time_ticks", "process"),
            pid_namespace=self.opt_text(obj, "pid_namespace", "process"),
            hostname=self.text(obj, "hostname", "process"),
        )

    def device(self, doc: object) -> DeviceInfo:
        obj = self.fields(doc, "device", _DEVICE_FIELDS)
        return DeviceInfo(
            kind=self.text(obj, "kind", "device", blank_ok=False),
            index=self.opt_integer(obj, "index", "device"),
            uuid=self.opt_text(obj, "uuid", "device", blank_ok=False),
        )

    def baseline(self, doc: object) -> Baseline:
        obj = self.fields(doc, "baseline", _BASELINE_FIELDS)
        return Baseline(**{name: self.opt_integer(obj, name, "baseline") for name in _BASELINE_FIELDS})

    def declaration(self, doc: object, index: int) -> Declaration:
        where = f"declarations[{index}]"
        obj = self.fields(doc, where, _DECLARATION_FIELDS)
        dtype = self.text(obj, "dtype", where, blank_ok=False)
        try:
            itemsize = dtype_itemsize(dtype)
        except UnknownDTypeError as exc:
            raise self.fail("invalid_value", f"{where}.dtype: {exc}") from exc
        if dtype != dtype_name(dtype):
            raise self.fail("invalid_value", f"{where}.dtype {dtype!r} is not canonical ({dtype_name(dtype)!r})")
        decl = Declaration(
            owner=self.text(obj, "owner", where),
            name=self.text(obj, "name", where, blank_ok=False),
            layers=self.integer(obj, "layers", where, minimum=1),
            kv_heads=self.integer(obj, "kv_heads", where, minimum=1),
            head_dim=self.integer(obj, "head_dim", where, minimum=1),
            dtype=dtype,
            itemsize=self.integer(obj, "itemsize", where, minimum=1),
            physical_capacity_positions=self.integer(obj, "physical_capacity_positions", where, minimum=1),
            capacity_source=self.text(obj, "capacity_source", where),
            scope=self.enum(obj, "scope", ModelLocalKVScope, where).value,
            rows=self.enum(obj, "rows", RowDriver, where).value,
            rows_fixed=self.integer(obj, "rows_fixed", where, minimum=0),  # >= 1 for FIXED: checked below
            rows_reason=self.text(obj, "rows_reason", where),
            allocation_note=self.opt_text(obj, "allocation_note", where),
            bytes_per_row=self.integer(obj, "bytes_per_row", where, minimum=1),
        )
        self.check_consistent(decl, itemsize, where)
        return decl

    def check_consistent(self, decl: Declaration, itemsize: int, where: str) -> None:
        if decl.itemsize != itemsize:
            raise self.fail("inconsistent", f"{where}: itemsize {decl.itemsize} but {decl.dtype} is {itemsize}")
        expected = 2 * decl.layers * decl.kv_heads * decl.head_dim * decl.physical_capacity_positions * itemsize
        if decl.bytes_per_row != expected:
            raise self.fail("inconsistent", f"{where}: bytes_per_row {decl.bytes_per_row}, geometry gives {expected}")
        if decl.is_fixed and decl.rows_fixed < 1:
            raise self.fail("out_of_range", f"{where}: rows=fixed needs rows_fixed >= 1, got {decl.rows_fixed}")
        if decl.is_fixed and not decl.rows_reason.strip():
            raise self.fail("invalid_value", f"{where}: rows=fixed needs a non-blank rows_reason")

    # -- primitives -------------------------------------------------------------------------------------------

    def fields(self, doc: object, where: str, names: tuple[str, ...]) -> Mapping[str, Any]:
        if not isinstance(doc, dict):
            raise self.fail("wrong_type", f"{where} must be an object, got {type(doc).__name__}")
        missing = [name for name in names if name not in doc]
        if missing:
            raise self.fail("missing_field", f"{where} lacks {', '.join(missing)}")
        unknown = sorted(set(doc) - set(names))
        if unknown:
            raise self.fail("unknown_field", f"{where} has unknown field(s) {', '.join(unknown)}")
        return doc

    def integer(self, obj: Mapping[str, Any], name: str, where: str, minimum: int = 0) -> int:
        value = obj[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail("wrong_type", f"{where}.{name} must be an integer, got {type(value).__name__}")
        if not minimum <= value <= MAX_SAFE_INT:
            raise self.fail("out_of_range", f"{where}.{name} = {value} outside [{minimum}, 2**53-1]")
        return value

    def number(self, obj: Mapping[str, Any], name: str, where: str) -> float:
        value = obj[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail("wrong_type", f"{where}.{name} must be a number, got {type(value).__name__}")
        if not math.isfinite(value) or value < 0:
            raise self.fail("out_of_range", f"{where}.{name} = {value} must be finite and >= 0")
        return float(value)

    def text(self, obj: Mapping[str, Any], name: str, where: str, blank_ok: bool = True) -> str:
        value = obj[name]
        if not isinstance(value, str):
            raise self.fail("wrong_type", f"{where}.{name} must be a string, got {type(value).__name__}")
        if not blank_ok and not value.strip():
            raise self.fail("invalid_value", f"{where}.{name} must not be blank")
        return value

    def array(self, obj: Mapping[str, Any], name: str) -> list[Any]:
        value = obj[name]
        if not isinstance(value, list):
            raise self.fail("wrong_type", f"{name} must be an array, got {type(value).__name__}")
        return value

    def opt_integer(self, obj: Mapping[str, Any], name: str, where: str) -> int | None:
        return None if obj[name] is None else self.integer(obj, name, where)

    def opt_text(self, obj: Mapping[str, Any], name: str, where: str, blank_ok: bool = True) -> str | None:
        return None if obj[name] is None else self.text(obj, name, where, blank_ok)

    def enum(self, obj: Mapping[str, Any], name: str, kind: type[E], where: str) -> E:
        value = self.text(obj, name, where)
        try:
            return kind(value)
        except ValueError:
            allowed = ", ".join(str(member.value) for member in kind)
            raise self.fail("unknown_enum", f"{where}.{name} = {value!r}; expected one of {allowed}") from None

    def choice(self, obj: Mapping[str, Any], name: str, allowed: tuple[str, ...], where: str) -> str:
        value = self.text(obj, name, where)
        if value not in allowed:
            raise self.fail("unknown_enum", f"{where}.{name} = {value!r}; expected one of {', '.join(allowed)}")
        return value


_TOP_FIELDS = (
    "schema_version",
    "written_at",
    "writer_version",
    "phase",
    "collector",
    "engine",
    "process",
    "device",
    "max_num_seqs",
    "baseline",
    "declarations",
)
_ENGINE_FIELDS = ("model_name", "stage", "engine_index", "data_parallel_rank", "tp_rank", "pp_rank")
_PROCESS_FIELDS = ("pid", "start_time_ticks", "pid_namespace", "hostname")
_DEVICE_FIELDS = ("kind", "index", "uuid")
_BASELINE_FIELDS = ("nvml_process_used_bytes", "torch_reserved_bytes")
_DECLARATION_FIELDS = tuple(Declaration.__dataclass_fields__)
