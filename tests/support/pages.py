"""The engine pages recorded from real servers (tests/fixtures), as the simulated engine serves them to tests."""

from __future__ import annotations

import asyncio

from kv_exporter.sidecar.engine_page import (
    DEFAULT_MAX_PAGE_BYTES,
    DEFAULT_TIMEOUT_S,
    EnginePage,
    EnginePageError,
    EngineTarget,
    fetch_page,
)
from kv_exporter.sidecar.inputs import EnginePages
from kv_exporter.transport.fetch import Client, timed_out
from tests.support.constants import FIXTURES

VLLM_PAGE = FIXTURES / "vllm-0.32-metrics.txt"
OMNI_PAGE = FIXTURES / "vllm-omni-0.30-metrics.txt"
VLLM_MODEL = "kvx-tiny"  # the served model name in the recorded vLLM page
OMNI_MODEL = "/tmp/tinyq"  # ... and in the recorded vllm-omni page


def vllm_page_with(running: int, model_name: str = VLLM_MODEL) -> bytes:
    """The recorded real vLLM page, its running count and model name changed (everything else as recorded)."""
    text = VLLM_PAGE.read_text()
    old = f'vllm:num_requests_running{{engine="0",model_name="{VLLM_MODEL}"}} 0.0'
    assert old in text, "the recorded page changed: update this helper"
    text = text.replace(old, f'vllm:num_requests_running{{engine="0",model_name="{model_name}"}} {running}.0')
    return text.replace(f'model_name="{VLLM_MODEL}"', f'model_name="{model_name}"').encode()


def fetch_once(
    target: EngineTarget, timeout_s: float = DEFAULT_TIMEOUT_S, max_bytes: int = DEFAULT_MAX_PAGE_BYTES
) -> bytes:
    """GET one page as the collection does (`engine_page.fetch_page` within the engine deadline), on a connection of
    its own; raises EnginePageError."""

    async def once() -> bytes:
        client = Client()
        try:
            return await asyncio.wait_for(fetch_page(client, target, max_bytes), timeout_s)
        except asyncio.TimeoutError:
            late = timed_out(timeout_s)
            raise EnginePageError(late.reason, late.detail) from None
        finally:
            client.close()

    return asyncio.run(once())


def read_once(
    target: EngineTarget, timeout_s: float = DEFAULT_TIMEOUT_S, max_bytes: int = DEFAULT_MAX_PAGE_BYTES
) -> EnginePage:
    """One engine page fetched and scanned by the collection's reader (`EnginePages`); raises its EnginePageError."""
    pages = EnginePages([target], timeout_s, max_bytes)
    try:
        (result,) = pages.read_all()
    finally:
        pages.close()
    if result.error is not None:
        raise result.error
    assert result.page is not None
    return result.page
