"""The manifest: the one contract between the hook (inside the engine) and the sidecar.

One JSON document per worker process, named from the engine's identity and ranks so a restarted engine overwrites
its own file. Written atomically; read strictly: a bad file raises `ManifestError` naming the file and a short reason
code (used as a metric label), and nothing is guessed. No torch, no vllm.

The dataclasses below are the whole description of the document: `kv_exporter.document` reads them strictly and
writes the JSON Schema from them (`kv_exporter/schema/manifest-v<N>.schema.json`, by `deploy/generate.py`).
What a schema cannot say is checked here by hand: size and declaration-count limits, duplicate keys, duplicate
declarations, and the rules across fields that `Declaration` checks when it is built.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import tempfile
import time
import typing
import zlib
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal

from kv_exporter import __version__
from kv_exporter.document import (
    DOCUMENT_ERROR_REASONS,
    NOT_IN_DOCUMENT,
    Choice,
    Derived,
    Doc,
    DocumentError,
    NotBlank,
    Prose,
    Range,
    Since,
    VersionField,
    decode,
    encode,
    json_schema,
)
from kv_exporter.dtypes import ITEMSIZE, dtype_itemsize, dtype_name, dtype_problem
from kv_exporter.engine_memory import EngineMemory
from kv_exporter.filestat import NotARegularFile, read_regular_file
from kv_exporter.observation import Observation, ObservationProblem, read_allocator, read_observation
from kv_exporter.printable import printable
from kv_exporter.procfs import current_pid_namespace, process_start_ticks
from kv_exporter.protocol import ModelLocalKVScope, RowDriver, kv_row_bytes

# Versions this reader accepts; writers write the newest. 2 added `pod` and `observation`; 3 the observation's
# per-owner `peak_bytes` and its `unreadable` caches; 4 the allocator's peak, high-water bounds, retries, OOMs and
# end-of-warm-up figures, and why there are none; 5 the unreadable reason `not_followed`, the allocator's
# per-process cap and the engine's own budget.
SchemaVersion = Literal[1, 2, 3, 4, 5]
SCHEMA_VERSIONS: tuple[int, ...] = typing.get_args(SchemaVersion)
SCHEMA_VERSION = SCHEMA_VERSIONS[-1]
SCHEMA_FOLDER = Path(__file__).with_name("schema")
MANIFEST_SUFFIX = ".json"
# The folder the hook writes to and the sidecar reads, unless told otherwise (an emptyDir shared in the pod).
DEFAULT_MANIFEST_DIR = "/run/kv-exporter"

CollectorName = Literal["vllm_omni", "kv_exporter"]
COLLECTORS: tuple[str, ...] = typing.get_args(CollectorName)

Count = Annotated[int, Range(0)]
Positive = Annotated[int, Range(1)]
Name = Annotated[str, NotBlank()]
Text = Annotated[str, Prose()]


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


# The reasons `read_manifest` gives, and those a refused observation gives (metric label values, exported at 0).
_FILE_REASONS = ("unreadable", "not_regular_file", "too_large", "not_utf8", "invalid_json")
_MANIFEST_REASONS = ("unsupported_schema_version", "too_many_declarations", "duplicate_declaration")
READER_ERROR_REASONS = (*DOCUMENT_ERROR_REASONS, *_FILE_REASONS, *_MANIFEST_REASONS)
OBSERVATION_PROBLEM_REASONS = (*DOCUMENT_ERROR_REASONS, "duplicate_owner")


class ManifestError(ValueError):
    """A manifest that cannot be used. `reason` is a short stable code; `detail` (short) says what exactly. The
    message shows the path and the detail printable (a file name need not be UTF-8); `path` stays the path as listed."""

    def __init__(self, path: str, reason: str, detail: str) -> None:
        self.path = path
        self.reason = reason
        self.detail = printable(detail)
        super().__init__(f"{printable(path)}: {reason}: {self.detail}")


@dataclass(frozen=True)
class Declaration:
    """One declaration as published: its owner's path, every spec field, and the sizes they give."""

    owner: Annotated[str, Doc('owner\'s path in named_modules(); "" for the root')]
    name: Name
    layers: Positive
    kv_heads: Positive
    head_dim: Positive
    dtype: Annotated[str, Choice(tuple(ITEMSIZE), dtype_problem)]
    physical_capacity_positions: Positive
    capacity_source: Text
    scope: ModelLocalKVScope
    rows: RowDriver
    rows_fixed: Annotated[Count, Doc("the count when rows is fixed (>= 1 then); ignored otherwise, as upstream")]
    rows_reason: Text
    allocation_note: Text | None
    itemsize: Annotated[Positive, Derived("its dtype")] = field(init=False)
    bytes_per_row: Annotated[
        Positive,
        Derived("the geometry and dtype"),
        Doc("2 x layers x kv_heads x head_dim x physical_capacity_positions x itemsize"),
    ] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "scope", ModelLocalKVScope(self.scope))
        object.__setattr__(self, "rows", RowDriver(self.rows))
        if self.rows.count_stated:  # a count the model controls must be stated and reviewable
            if self.rows_fixed < 1:
                raise DocumentError(
                    "out_of_range", f"rows={self.rows.value} needs rows_fixed >= 1, got {self.rows_fixed}"
                )
            if not self.rows_reason.strip():
                raise ValueError(f"rows={self.rows.value} needs a non-blank rows_reason")
        itemsize = dtype_itemsize(self.dtype)
        geometry = (self.layers, self.kv_heads, self.head_dim, self.physical_capacity_positions)
        object.__setattr__(self, "itemsize", itemsize)
        object.__setattr__(self, "bytes_per_row", kv_row_bytes(*geometry, itemsize))

    @classmethod
    def json_schema_rules(cls) -> dict[str, Any]:
        """__post_init__'s rule for counts the model controls, as JSON Schema says it."""
        fixed = [driver.value for driver in RowDriver if driver.count_stated]
        return {
            "if": {"properties": {"rows": {"enum": fixed}}},
            "then": {"properties": {"rows_fixed": {"minimum": 1}, "rows_reason": {"type": "string", "pattern": r"\S"}}},
        }

    @classmethod
    def from_spec(cls, owner: str, spec: Any) -> Declaration:
        """From our spec or vllm-omni's own (duck-typed on field names and enum values)."""
        return cls(
            owner=owner,
            name=str(spec.name),
            layers=int(spec.layers),
            kv_heads=int(spec.kv_heads),
            head_dim=int(spec.head_dim),
            dtype=dtype_name(spec.dtype),
            physical_capacity_positions=int(spec.physical_capacity_positions),
            capacity_source=str(spec.capacity_source),
            scope=ModelLocalKVScope(_enum_value(spec.scope)),
            rows=RowDriver(_enum_value(spec.rows)),
            rows_fixed=int(getattr(spec, "rows_fixed", 1)),
            rows_reason=str(getattr(spec, "rows_reason", "")),
            allocation_note=None if spec.allocation_note is None else str(spec.allocation_note),
        )

    def rows_at(self, sequences: int) -> int:
        """Rows live when `sequences` sequences run (0 allowed)."""
        return self.rows.rows_running(self.rows_fixed, sequences)

    def row_count(self, max_num_seqs: int = 1) -> int:
        """Rows at peak, as vllm-omni counts them."""
        return self.rows.rows_at_ceiling(self.rows_fixed, max_num_seqs)

    def peak_bytes(self, max_num_seqs: int = 1) -> int:
        return self.bytes_per_row * self.row_count(max_num_seqs)


def _enum_value(value: object) -> str:
    """`RowDriver.FIXED`, vllm-omni's own enum member, or the plain string all give "fixed"."""
    return str(getattr(value, "value", value))


@dataclass(frozen=True)
class EngineIdentity:
    """Which engine a worker belongs to, in the terms vLLM's and vllm-omni's metric labels use."""

    model_name: Name
    stage: Count = 0
    engine_index: Annotated[Count, Doc("vLLM's `engine` label, or vllm-omni's `replica`")] = 0
    data_parallel_rank: Count = 0
    tp_rank: Count = 0
    pp_rank: Count = 0


@dataclass(frozen=True)
class DeviceInfo:
    kind: Name = "cuda"
    index: Count | None = None  # physical index, after the CUDA_VISIBLE_DEVICES mapping
    uuid: Name | None = None  # as NVML and dcgm-exporter spell it ("GPU-...")


@dataclass(frozen=True)
class ProcessInfo:
    pid: Positive
    start_time_ticks: Count | None = None  # field 22 of /proc/PID/stat: tells a reused pid from the original
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
class PodInfo:
    """Where the worker runs in Kubernetes (from the downward API), so its series join kube-state-metrics and dcgm."""

    name: Name | None = None
    namespace: Name | None = None
    container: Name | None = None


@dataclass(frozen=True)
class Baseline:
    """The worker's GPU memory when the manifest was written, where measurable."""

    nvml_process_used_bytes: Count | None = None
    torch_reserved_bytes: Count | None = None


@dataclass(frozen=True)
class Manifest:
    engine: EngineIdentity
    process: ProcessInfo
    device: DeviceInfo
    max_num_seqs: Positive
    phase: Phase
    collector: CollectorName
    declarations: tuple[Declaration, ...]
    baseline: Baseline = Baseline()
    written_at: Annotated[float, Range(0), Doc("Unix time, seconds")] = field(default_factory=time.time)
    writer_version: Name = __version__
    schema_version: Annotated[SchemaVersion, VersionField()] = 5
    pod: Annotated[PodInfo, Since(2)] = PodInfo()
    observation: Annotated[
        Observation | None, Since(2), Doc("what the worker's live caches held at its last sample; null: not observed")
    ] = None
    engine_memory: Annotated[
        EngineMemory | None, Since(5), Doc("the engine's own KV budget as the worker reads it; null: not readable")
    ] = None
    # Filled in by the reader, not part of the document: why `observation` is None although the file had one, and
    # why its allocator figures (`observation.cuda`) are although it had them.
    observation_problem: ObservationProblem | None = field(default=None, compare=False, metadata=NOT_IN_DOCUMENT)
    allocator_problem: ObservationProblem | None = field(default=None, compare=False, metadata=NOT_IN_DOCUMENT)

    def declared_peak_bytes(self, max_num_seqs: int | None = None) -> int:
        """Sum of the declarations at `max_num_seqs` (the manifest's own by default)."""
        seqs = self.max_num_seqs if max_num_seqs is None else max_num_seqs
        return sum(d.peak_bytes(seqs) for d in self.declarations)

    def to_dict(self) -> dict[str, Any]:
        document: dict[str, Any] = encode(self)
        return document

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False) + "\n"


def schema_path(version: int = SCHEMA_VERSION) -> Path:
    return SCHEMA_FOLDER / f"manifest-v{version}.schema.json"


def manifest_schema(version: int = SCHEMA_VERSION) -> dict[str, Any]:
    """The JSON Schema of manifests of `version`, generated from the dataclasses above."""
    return json_schema(
        Manifest,
        version,
        schema_id=f"https://kv-exporter.invalid/schema/manifest-v{version}.json",
        title=f"kv-exporter manifest, schema version {version}",
        description=(
            "One worker process's model-local KV declarations, written by the kv-exporter vLLM plugin and read by "
            "the kv-exporter sidecar. Generated from kv_exporter/manifest.py. The reader additionally checks what "
            "JSON Schema cannot: bytes_per_row and itemsize agree with the geometry and dtype, a fixed row count "
            "is at least 1 and has a reason, no (owner, name) pair repeats, no duplicate keys, size and "
            "declaration-count limits."
        ),
    )


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
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_directory(folder)
    return target


def _fsync_directory(folder: Path) -> None:
    """Make the rename durable; some filesystems refuse to open a directory, which is fine to ignore."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def is_manifest_name(name: str) -> bool:
    return name.endswith(MANIFEST_SUFFIX) and not name.startswith(".")


def read_manifest(path: str | os.PathLike[str], limits: ManifestLimits = DEFAULT_LIMITS) -> Manifest:
    """Read and validate one manifest file; raises `ManifestError` for anything unusable, and FileNotFoundError when
    there is no file (it was removed, as a worker's clean exit removes its own: not a bad manifest, no manifest)."""
    source = os.fspath(path)
    try:
        data = read_regular_file(source, limits.max_bytes + 1)
    except NotARegularFile as exc:
        raise ManifestError(source, "not_regular_file", str(exc)) from None
    except FileNotFoundError:
        raise
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
    try:
        return _manifest(document, limits)
    except DocumentError as exc:
        raise ManifestError(source, exc.reason, exc.detail) from None


def _manifest(document: object, limits: ManifestLimits) -> Manifest:
    if not isinstance(document, dict):
        raise DocumentError("wrong_type", f"manifest must be an object, got {type(document).__name__}")
    version = _check_version(document.get("schema_version", SCHEMA_VERSION))  # a missing one: reported as missing
    declarations = document.get("declarations")
    if isinstance(declarations, list) and len(declarations) > limits.max_declarations:
        raise DocumentError("too_many_declarations", f"{len(declarations)} > limit {limits.max_declarations}")
    # The observation is read on its own: a bad one costs the observation, never the declarations beside it.
    raw_observation = document.get("observation")
    manifest = decode(
        Manifest, {**document, "observation": None} if "observation" in document else document, version=version
    )
    seen: set[tuple[str, str]] = set()
    for d in manifest.declarations:
        if (d.owner, d.name) in seen:
            raise DocumentError("duplicate_declaration", f"owner {d.owner!r} declares {d.name!r} twice")
        seen.add((d.owner, d.name))
    if raw_observation is None:
        return manifest
    try:
        observation = read_observation(raw_observation, version)
    except DocumentError as exc:
        return replace(manifest, observation_problem=ObservationProblem(exc.reason, exc.detail))
    # The allocator's figures are read on their own too: bad ones cost only them, never the owners' figures.
    raw_cuda = raw_observation.get("cuda") if isinstance(raw_observation, dict) else None
    if raw_cuda is None:
        return replace(manifest, observation=observation)
    try:
        return replace(manifest, observation=replace(observation, cuda=read_allocator(raw_cuda, version)))
    except DocumentError as exc:
        return replace(manifest, observation=observation, allocator_problem=ObservationProblem(exc.reason, exc.detail))


def _check_version(version: object) -> int:
    """First, because another version may have other fields: its version is the one thing to report."""
    if isinstance(version, bool) or not isinstance(version, int):
        raise DocumentError("wrong_type", f"schema_version must be an integer, got {type(version).__name__}")
    if version not in SCHEMA_VERSIONS:
        known = ", ".join(map(str, SCHEMA_VERSIONS))
        raise DocumentError("unsupported_schema_version", f"got {version}; this reader knows {known}")
    return version


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
