"""One warning per kind of failure per process: a broken folder must not repeat itself at every phase."""

from __future__ import annotations

import logging

# A child of vLLM's logger: inside vLLM our lines get its handler, format and VLLM_LOGGING_LEVEL; outside
# vLLM it is an ordinary logger.
logger = logging.getLogger("vllm.kv_exporter")

_warned: set[str] = set()


def warn_once(key: str, message: str, *args: object) -> bool:
    """Log `message` as a warning the first time `key` is seen; later ones go to debug. True if logged."""
    if key in _warned:
        logger.debug(message, *args)
        return False
    _warned.add(key)
    logger.warning(message, *args)
    return True
