#!/usr/bin/env python
"""Serve a hybrid model over an OpenAI-compatible HTTP API (see docs/server.md).

    python scripts/serve_hybrid.py --host 127.0.0.1 --port 8000 [--model DIR | preset:NAME]
"""
import sys
from pathlib import Path

# Runnable from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_engine.server.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
