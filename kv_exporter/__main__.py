"""`python -m kv_exporter serve | report | demo`."""

from __future__ import annotations

import sys

from kv_exporter.sidecar.cli import main

sys.exit(main())
