"""The manifest contract: round trip, atomic writes, strict reading with a specific reason for every fault."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from kv_exporter.engine_memory import EngineMemory
from kv_exporter.manifest import (
    SCHEMA_VERSION,
    SCHEMA_VERSIONS,
    Declaration,
    EngineIdentity,
    Manifest,
    ManifestError,
    ManifestLimits,
    PodInfo,
    ProcessInfo,
    manifest_filename,
    manifest_schema,
    parse_manifest,
    read_manifest,
    schema_path,
    write_manifest,
)
from kv_exporter.observation import (
    AllocatorLimitAbsent,
    CudaMemory,
    CudaWarm,
    Observation,
    ObservationState,
    OwnerObservation,
    UnreadableCaches,
    UnreadableReason,
)
from kv_exporter.reference import MINICPM_O, QWEN3_TTS
from tests.support.manifests import reference_manifest

SCHEMA = json.loads(schema_path().read_text(encoding="utf-8"))


def test_round_trip_through_a_file(tmp_path: Path) -> None:
    manifest = reference_manifest()
    path = write_manifest(tmp_path, manifest)
    assert path.name == manifest_filename(manifest.engine)
    assert read_manifest(path) == manifest
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_the_committed_schemas_are_the_ones_the_code_generates(version: int) -> None:
    # One source for the contract: the dataclasses. `python -m deploy.generate` rewrites the files.
    assert manifest_schema(version) == json.loads(schema_path(version).read_text(encoding="utf-8"))


def test_written_manifest_validates_against_the_json_schema(tmp_path: Path) -> None:
    for model in (QWEN3_TTS, MINICPM_O):
        document = json.loads(write_manifest(tmp_path, reference_manifest(model)).read_text())
        jsonschema.validate(document, SCHEMA)


def test_declaration_bytes_are_precomputed() -> None:
    document = json.loads(reference_manifest().to_json())
    assert document["declarations"][0]["bytes_per_row"] == 4_653_056
    assert document["declarations"][0]["itemsize"] == 4


def test_filename_is_stable_per_identity_and_distinct_per_rank() -> None:
    base = EngineIdentity(model_name="org/Model Name")
    assert manifest_filename(base) == manifest_filename(EngineIdentity(model_name="org/Model Name"))
    names = {
        manifest_filename(identity)
        for identity in (
            base,
            EngineIdentity(model_name="org/Model Name", tp_rank=1),
            EngineIdentity(model_name="org/Model Name", pp_rank=1),
            EngineIdentity(model_name="org/Model Name", stage=1),
            EngineIdentity(model_name="org/Model Name", engine_index=1, data_parallel_rank=1),
            EngineIdentity(model_name="org_Model_Name"),  # same slug, different name
        )
    }
    assert len(names) == 6
    assert all("/" not in name and " " not in name for name in names)


def test_rewrite_replaces_atomically_under_a_concurrent_reader(tmp_path: Path) -> None:
    path = write_manifest(tmp_path, reference_manifest(max_num_seqs=1))
    stop = threading.Event()
    failures: list[BaseException] = []

    def reader() -> None:
        while not stop.is_set():
            try:
                read_manifest(path)
            except BaseException as exc:  # any torn read is a failure
                failures.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    for n in range(1, 200):
        write_manifest(tmp_path, reference_manifest(max_num_seqs=n))
    stop.set()
    thread.join()
    assert failures == []
    assert read_manifest(path).max_num_seqs == 199


def test_process_info_reads_proc() -> None:
    info = ProcessInfo.current()
    assert info.pid == os.getpid()
    assert info.start_time_ticks is not None and info.start_time_ticks > 0
    assert info.pid_namespace is not None and info.pid_namespace.startswith("pid:[")


def good_document() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(reference_manifest().to_json())
    return document


def mutate(change: Any) -> bytes:
    document = good_document()
    change(document)
    return json.dumps(document).encode()


def set_path(path: str, value: Any) -> Any:
    def change(document: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target: Any = document
        for key in parents:
            target = target[int(key)] if key.isdigit() else target[key]
        target[int(last) if last.isdigit() else last] = value

    return change


def delete_path(path: str) -> Any:
    def change(document: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target: Any = document
        for key in parents:
            target = target[int(key)] if key.isdigit() else target[key]
        del target[last]

    return change


GOOD = json.dumps(good_document()).encode()
MALFORMED: dict[str, tuple[bytes, str, str]] = {
    "empty file": (b"", "invalid_json", "Expecting value"),
    "truncated": (GOOD[: len(GOOD) // 2], "invalid_json", ""),
    "not utf-8": (GOOD.replace(b"Qwen3-TTS", b"Qwen3-\xff\xfeTTS"), "not_utf8", ""),
    "a list, not an object": (b"[1, 2]", "wrong_type", "manifest must be an object"),
    "NaN literal": (GOOD.replace(b'"written_at": 1764480000.0', b'"written_at": NaN'), "invalid_json", "NaN"),
    "Infinity literal": (GOOD.replace(b'"max_num_seqs": 256', b'"max_num_seqs": Infinity'), "invalid_json", ""),
    "duplicate key": (
        GOOD.replace(b'"max_num_seqs": 256', b'"max_num_seqs": 256, "max_num_seqs": 1'),
        "invalid_json",
        "duplicate",
    ),
    "future schema version": (
        mutate(set_path("schema_version", SCHEMA_VERSION + 1)),
        "unsupported_schema_version",
        f"got {SCHEMA_VERSION + 1}",
    ),
    "schema version as string": (mutate(set_path("schema_version", "1")), "wrong_type", "schema_version"),
    "missing engine": (mutate(delete_path("engine")), "missing_field", "engine"),
    "missing declaration field": (mutate(delete_path("declarations.0.rows")), "missing_field", "rows"),
    "unknown field": (mutate(set_path("engine.colour", "blue")), "unknown_field", "colour"),
    "max_num_seqs as string": (mutate(set_path("max_num_seqs", "256")), "wrong_type", "max_num_seqs"),
    "max_num_seqs as float": (mutate(set_path("max_num_seqs", 256.5)), "wrong_type", "max_num_seqs"),
    "max_num_seqs as bool": (mutate(set_path("max_num_seqs", True)), "wrong_type", "max_num_seqs"),
    "max_num_seqs zero": (mutate(set_path("max_num_seqs", 0)), "out_of_range", "max_num_seqs"),
    "negative layers": (mutate(set_path("declarations.0.layers", -8)), "out_of_range", "layers"),
    "huge positions": (mutate(set_path("declarations.0.physical_capacity_positions", 10**30)), "out_of_range", ""),
    "negative written_at": (mutate(set_path("written_at", -1)), "out_of_range", "written_at"),
    "unknown scope": (mutate(set_path("declarations.0.scope", "forever")), "unknown_enum", "forever"),
    "unknown driver": (mutate(set_path("declarations.0.rows", "max_num_sessions")), "unknown_enum", "rows"),
    "unknown phase": (mutate(set_path("phase", "profiling")), "unknown_enum", "phase"),
    "unknown collector": (mutate(set_path("collector", "guess")), "unknown_enum", "collector"),
    "unknown dtype": (mutate(set_path("declarations.0.dtype", "complex64")), "invalid_value", "complex64"),
    "non-canonical dtype": (mutate(set_path("declarations.0.dtype", "torch.float32")), "invalid_value", "canonical"),
    "bytes_per_row disagrees": (mutate(set_path("declarations.0.bytes_per_row", 1)), "inconsistent", "geometry"),
    "itemsize disagrees": (mutate(set_path("declarations.0.itemsize", 2)), "inconsistent", "itemsize"),
    "a derived size as a boolean": (
        mutate(set_path("declarations.0.bytes_per_row", True)),
        "wrong_type",
        "bytes_per_row",
    ),
    "fixed without reason": (
        mutate(lambda d: d["declarations"][2].update(rows_reason=" ")),
        "invalid_value",
        "rows_reason",
    ),
    "fixed with zero rows": (
        mutate(lambda d: d["declarations"][2].update(rows_fixed=0)),
        "out_of_range",
        "rows_fixed",
    ),
    "blank model name": (mutate(set_path("engine.model_name", "")), "invalid_value", "model_name"),
    "declarations not a list": (mutate(set_path("declarations", {})), "wrong_type", "declarations"),
    "declaration not an object": (mutate(set_path("declarations.0", "x")), "wrong_type", "declarations[0]"),
    "pid zero": (mutate(set_path("process.pid", 0)), "out_of_range", "pid"),
    "uuid blank": (mutate(set_path("device.uuid", "")), "invalid_value", "uuid"),
    "lone surrogate in a name": (GOOD.replace(b'"Qwen3-TTS"', b'"Qwen3\\ud800TTS"'), "invalid_string", "U+D800"),
    "control character in prose": (
        mutate(set_path("declarations.0.capacity_source", "71\x1b[2J")),
        "invalid_string",
        "capacity_source",
    ),
    "a name too long": (mutate(set_path("declarations.0.owner", "a" * 257)), "too_long", "owner"),
    "prose too long": (mutate(set_path("declarations.0.allocation_note", "n" * 1025)), "too_long", "1025"),
    "duplicate declaration": (
        mutate(lambda d: d["declarations"].append(dict(d["declarations"][0]))),
        "duplicate_declaration",
        "twice",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_manifest_is_rejected_with_a_specific_reason(case: str) -> None:
    data, reason, detail = MALFORMED[case]
    with pytest.raises(ManifestError) as caught:
        parse_manifest(data, "bad.json")
    assert caught.value.reason == reason, caught.value
    assert detail in caught.value.detail
    assert caught.value.path == "bad.json"
    assert str(caught.value).startswith("bad.json: ")


# Faults JSON Schema can express (the rest are cross-field or lexical rules only the reader checks).
SCHEMA_LEVEL = sorted(
    name
    for name, (_, reason, detail) in MALFORMED.items()
    if reason not in {"invalid_json", "not_utf8", "inconsistent", "duplicate_declaration"}
    and detail not in {"canonical", "U+D800"}  # JSON Schema patterns cannot see a lone surrogate
)


@pytest.mark.parametrize("case", SCHEMA_LEVEL)
def test_json_schema_agrees_on_schema_level_faults(case: str) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(MALFORMED[case][0]), SCHEMA)


def test_limits_are_enforced() -> None:
    with pytest.raises(ManifestError) as too_large:
        parse_manifest(GOOD, "m.json", ManifestLimits(max_bytes=100))
    assert too_large.value.reason == "too_large"
    with pytest.raises(ManifestError) as too_many:
        parse_manifest(GOOD, "m.json", ManifestLimits(max_declarations=2))
    assert too_many.value.reason == "too_many_declarations"


def test_what_is_not_a_readable_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):  # nothing there: no manifest, not a bad one
        read_manifest(tmp_path / "absent.json")
    (tmp_path / "link.json").symlink_to(tmp_path / "absent.json")
    os.mkfifo(tmp_path / "fifo.json")  # opened without blocking, though no writer ever comes
    (tmp_path / "dir.json").mkdir()
    expected = {
        "link.json": ("not_regular_file", "a symbolic link to nothing"),
        "fifo.json": ("not_regular_file", "a FIFO, not a regular file"),
        "dir.json": ("not_regular_file", "a directory, not a regular file"),
    }
    for name, (reason, detail) in expected.items():
        with pytest.raises(ManifestError) as caught:
            read_manifest(tmp_path / name)
        assert (caught.value.reason, caught.value.detail) == (reason, detail)
        assert str(caught.value) == f"{tmp_path / name}: {reason}: {detail}"


def test_a_file_name_that_is_not_utf8_is_shown_escaped(tmp_path: Path) -> None:
    path = os.path.join(os.fsencode(tmp_path), b"bad\xff\x1b.json")
    Path(os.fsdecode(path)).write_bytes(b"{")
    (listed,) = os.scandir(tmp_path)  # as the sidecar lists it: the byte 0xff as a lone surrogate
    with pytest.raises(ManifestError) as caught:
        read_manifest(listed.path)
    assert caught.value.path == listed.path  # still the path that opens the file
    assert str(caught.value).startswith(f"{tmp_path}/bad\\xff\\x1b.json: invalid_json: ")
    str(caught.value).encode("utf-8")  # no lone surrogate left


def test_strings_at_their_limits_and_rare_characters_are_accepted() -> None:
    # Non-characters, private use and astral-plane text are valid UTF-8: exported (escaped where needed), not refused.
    document = good_document()
    document["declarations"][0]["owner"] = "o" * 255 + "\ufffe"
    document["declarations"][0]["allocation_note"] = "\U0001f600 \ue000 " + "n" * 1020
    jsonschema.validate(document, SCHEMA)
    manifest = parse_manifest(json.dumps(document).encode(), "m.json")
    assert manifest.declarations[0].owner.endswith("\ufffe")


def test_rows_fixed_is_ignored_unless_fixed(tmp_path: Path) -> None:
    """vllm-omni allows rows_fixed=0 on a MAX_NUM_SEQS spec (the field is ignored there): keep it, accept it."""
    document = good_document()
    document["declarations"][0]["rows_fixed"] = 0
    jsonschema.validate(document, SCHEMA)
    manifest = parse_manifest(json.dumps(document).encode(), "m.json")
    assert manifest.declarations[0].rows_fixed == 0
    assert manifest.declarations[0].row_count(256) == 256


def test_declaration_from_a_foreign_spec_object() -> None:
    """Duck typing: any object with vllm-omni's field names and enum values is accepted."""

    class Value:
        def __init__(self, value: str) -> None:
            self.value = value

    class ForeignSpec:
        name = "codec"
        layers, kv_heads, head_dim = 8, 16, 64
        dtype = "torch.float32"
        physical_capacity_positions = 71
        capacity_source = "window"
        scope = Value("request")
        rows = Value("max_num_seqs")
        rows_fixed = 1
        rows_reason = ""
        allocation_note = None

    declaration = Declaration.from_spec("talker", ForeignSpec())
    assert declaration.bytes_per_row == 4_653_056
    assert (declaration.scope, declaration.rows, declaration.dtype) == ("request", "max_num_seqs", "float32")
    assert declaration.rows_at(17) == 17
    assert declaration.rows_at(0) == 0
    assert declaration.row_count(0) == 1


# -- schema version 2: pod identity and the observation ----------------------------------------------------------

CUDA = CudaMemory(
    allocated_bytes=3 << 30,
    reserved_bytes=4 << 30,
    peak_bytes=5 << 30,
    high_water_bytes=(3 << 30) + 4096,
    high_water_floor_bytes=3 << 30,
    alloc_retries=2,
    ooms=1,
    warm=CudaWarm(allocated_bytes=2 << 30, reserved_bytes=4 << 30, peak_bytes=5 << 30, observed_bytes=512),
    limit_bytes=6 << 30,
)
OBSERVATION = Observation(
    state=ObservationState.OK,
    reason="",
    interval_s=10.0,
    taken_at=1_764_480_005.5,
    duration_s=0.0004,
    owners=(
        OwnerObservation("talker.code_predictor.codec_decoder", 9_437_184, 2, 37_748_736),
        OwnerObservation("vocoder", 512, 1, 512),
    ),
    cuda=CUDA,
    unreadable=(UnreadableCaches("vocoder", UnreadableReason.NO_LAYERS, 1),),
)
V4_CUDA_FIELDS = ("peak_bytes", "high_water_bytes", "high_water_floor_bytes", "alloc_retries", "ooms", "warm")
V5_CUDA_FIELDS = ("limit_bytes", "limit_absent")
ENGINE_MEMORY = EngineMemory(
    kv_cache_bytes=60 << 30, kv_cache_blocks=4096, gpu_memory_utilization=1.0, extensible_kv_cache=True
)


def observed_manifest() -> Manifest:
    pod = PodInfo(name="qwen3-tts-7f9c", namespace="tts", container="engine")
    return replace(reference_manifest(QWEN3_TTS), pod=pod, observation=OBSERVATION, engine_memory=ENGINE_MEMORY)


def test_a_version_5_manifest_with_pod_peaks_unreadable_caches_allocator_figures_and_budget_round_trips(
    tmp_path: Path,
) -> None:
    manifest = observed_manifest()
    document = json.loads(write_manifest(tmp_path, manifest).read_text())
    assert document["observation"]["cuda"]["warm"]["observed_bytes"] == 512
    assert document["observation"]["cuda"]["high_water_floor_bytes"] == 3 << 30
    assert document["observation"]["cuda"]["limit_bytes"] == 6 << 30
    assert document["observation"]["cuda"]["limit_absent"] is None
    assert document["engine_memory"] == {
        "kv_cache_bytes": 60 << 30,
        "kv_cache_blocks": 4096,
        "gpu_memory_utilization": 1.0,
        "extensible_kv_cache": True,
    }
    assert document["schema_version"] == SCHEMA_VERSION and document["observation"]["owners"][1] == {
        "owner": "vocoder",
        "bytes": 512,
        "caches": 1,
        "peak_bytes": 512,
    }
    assert document["observation"]["unreadable"] == [{"owner": "vocoder", "reason": "no_layers", "caches": 1}]
    jsonschema.validate(document, SCHEMA)
    assert read_manifest(tmp_path / manifest_filename(manifest.engine)) == manifest


def test_an_uncapped_allocator_says_why_it_has_no_limit() -> None:
    cuda = replace(CUDA, limit_bytes=None, limit_absent=AllocatorLimitAbsent.NO_CAP)
    document = replace(observed_manifest(), observation=replace(OBSERVATION, cuda=cuda)).to_dict()
    assert document["observation"]["cuda"]["limit_absent"] == "no_cap"
    jsonschema.validate(document, SCHEMA)
    manifest = parse_manifest(json.dumps(document).encode(), "v5.json")
    assert manifest.observation is not None and manifest.observation.cuda == cuda


def version_4_document() -> dict[str, Any]:
    document = observed_manifest().to_dict()
    document["schema_version"] = 4
    del document["engine_memory"]
    for name in V5_CUDA_FIELDS:
        del document["observation"]["cuda"][name]
    return document


def test_a_version_4_manifest_is_read_without_the_limit_and_budget_it_did_not_have() -> None:
    document = version_4_document()
    jsonschema.validate(document, json.loads(schema_path(4).read_text()))
    manifest = parse_manifest(json.dumps(document).encode(), "v4.json")
    assert manifest.engine_memory is None
    assert manifest.observation is not None and manifest.observation.cuda is not None
    assert manifest.observation.cuda == replace(CUDA, limit_bytes=None)
    document["observation"]["cuda"]["limit_bytes"] = 1 << 30  # a version 4 worker had none to give: refused alone
    refused = parse_manifest(json.dumps(document).encode(), "v4.json")
    assert refused.observation is not None and refused.observation.cuda is None
    assert refused.allocator_problem is not None and refused.allocator_problem.reason == "unknown_field"


def version_3_document() -> dict[str, Any]:
    document = version_4_document()
    document["schema_version"] = 3
    del document["observation"]["cuda_unavailable"]
    for name in V4_CUDA_FIELDS:
        del document["observation"]["cuda"][name]
    return document


def test_a_version_3_observation_is_read_without_the_allocator_figures_it_did_not_have() -> None:
    document = version_3_document()
    jsonschema.validate(document, json.loads(schema_path(3).read_text()))
    manifest = parse_manifest(json.dumps(document).encode(), "v3.json")
    assert manifest.observation is not None and manifest.observation.cuda is not None
    assert manifest.observation.cuda == CudaMemory(allocated_bytes=3 << 30, reserved_bytes=4 << 30)
    document["observation"]["cuda"]["ooms"] = 1  # a version 3 worker had none to give: those figures are refused
    refused = parse_manifest(json.dumps(document).encode(), "v3.json")
    assert refused.observation is not None and refused.observation.cuda is None
    assert refused.allocator_problem is not None and refused.allocator_problem.reason == "unknown_field"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("high_water_bytes", (3 << 30) - 1),  # below its floor
        ("peak_bytes", (3 << 30) - 1),  # below what is allocated now
        ("reserved_bytes", (3 << 30) - 1),  # less reserved than allocated
    ],
)
def test_allocator_figures_torch_could_never_give_are_refused_alone(name: str, value: int) -> None:
    document = observed_manifest().to_dict()
    document["observation"]["cuda"][name] = value
    manifest = parse_manifest(json.dumps(document).encode(), "v5.json")
    assert manifest.observation is not None and manifest.observation_problem is None
    assert manifest.observation.owners == OBSERVATION.owners  # the owners' figures are kept
    assert manifest.observation.cuda is None
    assert manifest.allocator_problem is not None and manifest.allocator_problem.reason == "inconsistent"
    assert name in manifest.allocator_problem.detail


def test_a_version_3_allocator_without_a_peak_is_not_refused_for_it() -> None:
    manifest = parse_manifest(json.dumps(version_3_document()).encode(), "v3.json")
    assert manifest.allocator_problem is None and manifest.observation is not None
    assert manifest.observation.cuda is not None


def version_2_document() -> dict[str, Any]:
    document = version_3_document()
    document["schema_version"] = 2
    del document["observation"]["unreadable"], document["observation"]["peaks_followed"]
    for owner in document["observation"]["owners"]:
        del owner["peak_bytes"]
    return document


def test_a_version_2_observation_is_read_with_its_peak_at_the_sample() -> None:
    document = version_2_document()
    jsonschema.validate(document, json.loads(schema_path(2).read_text()))
    manifest = parse_manifest(json.dumps(document).encode(), "v2.json")
    assert manifest.observation is not None and manifest.observation_problem is None
    assert [(o.bytes, o.peak_bytes) for o in manifest.observation.owners] == [(9_437_184, 9_437_184), (512, 512)]
    assert manifest.observation.unreadable == ()
    assert manifest.observation.peaks_followed is False  # a version 2 worker followed none


def test_a_version_2_observation_may_not_carry_a_peak() -> None:
    document = version_2_document()
    document["observation"]["owners"][0]["peak_bytes"] = 1 << 30
    manifest = parse_manifest(json.dumps(document).encode(), "v2.json")
    assert manifest.observation is None and manifest.observation_problem is not None
    assert manifest.observation_problem.reason == "unknown_field"


def version_1_document() -> dict[str, Any]:
    document = good_document()
    del document["pod"], document["observation"], document["engine_memory"]
    document["schema_version"] = 1
    return document


def test_a_version_1_manifest_from_an_older_hook_is_still_read() -> None:
    # An operator upgrading the sidecar before the engine image must not lose the engine's declarations.
    document = version_1_document()
    jsonschema.validate(document, json.loads(schema_path(1).read_text()))
    manifest = parse_manifest(json.dumps(document).encode(), "v1.json")
    assert manifest.schema_version == 1 and manifest.observation is None and manifest.pod == PodInfo()
    assert manifest.declarations == reference_manifest(QWEN3_TTS).declarations


@pytest.mark.parametrize("field", ["pod", "observation"])
def test_a_version_1_manifest_may_not_carry_version_2_fields(field: str) -> None:
    document = version_1_document()
    document[field] = None if field == "observation" else {"name": None, "namespace": None, "container": None}
    with pytest.raises(ManifestError) as caught:
        parse_manifest(json.dumps(document).encode(), "v1.json")
    assert (caught.value.reason, field in caught.value.detail) == ("unknown_field", True)


BAD_OBSERVATIONS: dict[str, tuple[Any, str]] = {
    "a peak below the sample": (
        {"owners": [{"owner": "a", "bytes": 10, "caches": 1, "peak_bytes": 9}]},
        "inconsistent",
    ),
    "not an object": ([1, 2], "wrong_type"),
    "unknown state": ({"state": "great"}, "unknown_enum"),
    "negative bytes": ({"owners": [{"owner": "a", "bytes": -1, "caches": 1, "peak_bytes": 0}]}, "out_of_range"),
    "a petabyte and more": (
        {"owners": [{"owner": "a", "bytes": (1 << 50) + 1, "caches": 1, "peak_bytes": 1}]},
        "out_of_range",
    ),
    "bytes as a string": ({"owners": [{"owner": "a", "bytes": "9", "caches": 1, "peak_bytes": 9}]}, "wrong_type"),
    "an owner twice": (
        {
            "owners": [
                {"owner": "a", "bytes": 1, "caches": 1, "peak_bytes": 1},
                {"owner": "a", "bytes": 2, "caches": 1, "peak_bytes": 2},
            ]
        },
        "duplicate_owner",
    ),
    "NaN-free but infinite interval": ({"interval_s": 1e300}, "out_of_range"),
    "a missing field": ({"taken_at": None}, "wrong_type"),
}


@pytest.mark.parametrize("case", sorted(BAD_OBSERVATIONS))
def test_a_bad_observation_costs_the_observation_not_the_declarations(case: str) -> None:
    change, reason = BAD_OBSERVATIONS[case]
    document = json.loads(observed_manifest().to_json())
    if isinstance(change, dict):
        document["observation"].update(change)
    else:
        document["observation"] = change
    manifest = parse_manifest(json.dumps(document).encode(), "m.json")
    assert manifest.observation is None
    assert manifest.observation_problem is not None and manifest.observation_problem.reason == reason
    assert manifest.declarations == observed_manifest().declarations
    if reason not in ("duplicate_owner", "inconsistent"):  # rules across items and fields, which JSON Schema cannot say
        with pytest.raises(jsonschema.ValidationError):  # the schema refuses it too, for other readers
            jsonschema.validate(document, SCHEMA)


def test_an_unreadable_reason_is_read_only_from_the_version_that_added_it() -> None:
    document = observed_manifest().to_dict()
    document["observation"]["unreadable"][0]["reason"] = "not_followed"
    newest = parse_manifest(json.dumps(document).encode(), "v5.json").observation
    assert newest is not None and newest.unreadable[0].reason is UnreadableReason.NOT_FOLLOWED
    older = version_4_document()  # a version 4 worker had no such reason to give
    older["observation"]["unreadable"][0]["reason"] = "not_followed"
    assert parse_manifest(json.dumps(older).encode(), "v4.json").observation is None
    assert "not_followed" not in json.dumps(json.loads(schema_path(4).read_text()))
