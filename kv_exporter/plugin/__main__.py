"""`python -m kv_exporter.plugin --check`: whether the installed plugin will work here (extensions.py)."""

from __future__ import annotations

import sys

from kv_exporter.plugin.extensions import main

sys.exit(main())
