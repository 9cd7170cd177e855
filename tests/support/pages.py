"""The engine pages recorded from real servers (tests/fixtures), as the simulated engine serves them to tests."""

from __future__ import annotations

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
