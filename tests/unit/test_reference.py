"""The design notes' table, to the byte."""

from __future__ import annotations

import pytest

from kv_exporter.manifest import Declaration
from kv_exporter.reference import (
    MIMO_AUDIO,
    MING_FLASH_OMNI,
    MINICPM_O,
    QWEN3_TTS,
    QWEN3_TTS_EXAMPLE_CAPTURE_SIZES,
    REFERENCE_MODELS,
)

MIB = 1 << 20


def by_name(model: object) -> dict[str, object]:
    return {spec.name: spec for _, spec in model.declarations}  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("model", "cache", "bytes_per_row", "mib_text", "rows_at_256"),
    [
        (QWEN3_TTS, "codec_decoder_request_cache", 4_653_056, "4.44", 256),
        (QWEN3_TTS, "codec_decoder_working_copy", 4_653_056, "4.44", 256),
        (QWEN3_TTS, "codec_decoder_graph_pool", 4_653_056, "4.44", sum(QWEN3_TTS_EXAMPLE_CAPTURE_SIZES)),
        (MIMO_AUDIO, "local_transformer_cache", 720_896, "0.69", 256),
        (MIMO_AUDIO, "local_transformer_graph_pool", 720_896, "0.69", 261),
        (MINICPM_O, "whisper_encoder_cache", 147_456_000, "140.62", 1),
        (MING_FLASH_OMNI, "talker_static_cache", 25_165_824, "24.00", 1),
    ],
)
def test_reference_table(model: object, cache: str, bytes_per_row: int, mib_text: str, rows_at_256: int) -> None:
    spec = by_name(model)[cache]
    assert spec.bytes_per_row == bytes_per_row  # type: ignore[attr-defined]
    assert f"{spec.bytes_per_row / MIB:.2f}" == mib_text  # type: ignore[attr-defined]
    assert spec.row_count(256) == rows_at_256  # type: ignore[attr-defined]


def test_headline_figures() -> None:
    codec = by_name(QWEN3_TTS)["codec_decoder_request_cache"]
    assert codec.peak_bytes(256) == 256 * 4_653_056 == 1_191_182_336  # type: ignore[attr-defined]
    gib = codec.peak_bytes(256) / (1 << 30)  # type: ignore[attr-defined]
    assert round(gib, 1) == 1.1  # the design notes' "~1.1 GiB"
    assert by_name(MIMO_AUDIO)["local_transformer_graph_pool"].peak_bytes(256) == 261 * 720_896  # type: ignore[attr-defined]
    assert f"{261 * 720_896 / MIB:.2f}" == "179.44"
    assert 704 * 1024 == 720_896  # "704 KiB"


def test_qwen3_tts_declares_two_max_num_seqs_entries_with_different_lifetimes() -> None:
    per_seq = [spec for _, spec in QWEN3_TTS.declarations if spec.rows.value == "max_num_seqs"]
    assert {spec.scope.value for spec in per_seq} == {"request", "invocation"}


def test_fixed_entries_explain_themselves() -> None:
    for model in REFERENCE_MODELS:
        for _, spec in model.declarations:
            if spec.rows.value == "fixed":
                assert spec.rows_reason.strip()


def test_reference_declarations_survive_the_manifest_form() -> None:
    for model in REFERENCE_MODELS:
        for owner, spec in model.declarations:
            declaration = Declaration.from_spec(owner, spec)
            assert declaration.bytes_per_row == spec.bytes_per_row
            assert declaration.peak_bytes(256) == spec.peak_bytes(256)
