"""kv-exporter: live metrics for attention KV kept outside vLLM's paged KV manager.

Five rooms: the shared contract at the top (`protocol`, `dtypes`, `document`, `manifest`, `observation`, `procfs`,
`printable`, `gpu`, `filestat`, `cachebytes`, `reference`), the engine side in `plugin` (the vLLM general plugin),
the sidecar in `sidecar`, the exporter-toolkit web configuration in `web`, and HTTP/1.x bytes in `transport` (the
asyncio server, its connections and request heads, the engine-page client; docs/CONTRACTS.md). Importing this
package must stay cheap and must never import torch or vllm: the sidecar imports it, and vLLM imports the plugin in
every process it starts.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "register"]


def register() -> None:
    """The `vllm.general_plugins` entry point, kept here so that installed metadata stays valid across releases;
    the plugin itself is imported only when vLLM calls it (`kv_exporter.plugin`)."""
    from kv_exporter.plugin import register as register_plugin

    register_plugin()
