"""Container health check for the sidecar image: exit 0 when the exporter answers.

Standard library only (it runs inside the slim image). KV_EXPORTER_HEALTH_URL overrides the URL, for an
exporter started on another port or path.
"""

import os
import sys
import urllib.request

URL = os.environ.get("KV_EXPORTER_HEALTH_URL", "http://127.0.0.1:9477/healthz")

try:
    with urllib.request.urlopen(URL, timeout=4) as reply:
        sys.exit(0 if reply.status == 200 else 1)
except OSError as exc:
    print(f"unhealthy: {URL}: {exc}", file=sys.stderr)
    sys.exit(1)
