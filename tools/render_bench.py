"""Re-render a `jaxsync bench` JSON file as markdown + PNG chart.

Usage: python tools/render_bench.py RESULT.json OUT_DIR
"""

import json
import sys
from pathlib import Path

from jaxsync.harness.bench._render import render


if __name__ == "__main__":
    result = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    render(result, out)
