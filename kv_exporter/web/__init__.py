"""The exporter-toolkit web configuration (`--web.config.file`): config, TLS, basic auth, reloading."""
