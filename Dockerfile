# syntax=docker/dockerfile:1
# kv-exporter images. Targets:
#   sidecar (default)  the exporter alone: slim, non-root, read-only-root friendly, no torch or vllm
#   vllm-plugin        an upstream vLLM image plus the kv-exporter plugin (set VLLM_IMAGE for vllm-omni)
#
#   docker build --build-arg REVISION="$(git rev-parse HEAD)" -t kv-exporter .
#   docker build --target vllm-plugin -t kv-exporter-vllm .
#   docker build --target vllm-plugin --build-arg VLLM_IMAGE=<vllm-omni image> -t kv-exporter-vllm-omni .
# The install steps live in deploy/docker/*.sh; tests/deploy runs the same scripts.

ARG PYTHON_IMAGE=python:3.12-slim-bookworm
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

FROM ${PYTHON_IMAGE} AS build
# The source revision the image is built from, for --version and model_local_kv_exporter_build_info (an image has
# no git checkout to read it from).
ARG REVISION=unknown
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kv_exporter/ kv_exporter/
COPY deploy/docker/install-sidecar.sh /usr/local/bin/
RUN install-sidecar.sh /src /opt/kv-exporter /wheels

FROM ${VLLM_IMAGE} AS vllm-plugin
# The source, not the build stage's wheel: the plugin's cache tracker is a C extension built by the image's Python.
COPY --from=build /src/ /tmp/kv-exporter-src/
COPY deploy/docker/install-plugin.sh /usr/local/bin/
RUN install-plugin.sh /tmp/kv-exporter-src && rm -rf /tmp/kv-exporter-src

FROM ${PYTHON_IMAGE} AS sidecar
LABEL org.opencontainers.image.title="kv-exporter" \
      org.opencontainers.image.description="Prometheus exporter for model-local attention KV in vLLM / vllm-omni" \
      org.opencontainers.image.licenses="Apache-2.0"
ARG REVISION=unknown
LABEL org.opencontainers.image.revision="${REVISION}"
COPY --from=build /opt/kv-exporter /opt/kv-exporter
COPY deploy/docker/healthcheck.py /opt/kv-exporter/healthcheck.py
# Nothing is written at run time: no .pyc (compiled at build), no temp files, logs to stdout.
# MALLOC_MMAP_THRESHOLD_: large exposition buffers go to mmap and back to the OS, so resident memory stays flat
# instead of stepping up at glibc's adaptive threshold (docs/benchmarks.md, target 3).
ENV PATH=/opt/kv-exporter/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MALLOC_MMAP_THRESHOLD_=131072
# A numeric user, so that runAsNonRoot can verify it without a passwd entry.
USER 65532:65532
EXPOSE 9477
HEALTHCHECK --interval=30s --timeout=5s --start-period=15s --retries=3 \
    CMD ["/opt/kv-exporter/bin/python", "/opt/kv-exporter/healthcheck.py"]
ENTRYPOINT ["kv-exporter"]
CMD ["serve", "--manifest-dir=/run/kv-exporter", "--engine-url=http://127.0.0.1:8000/metrics"]
