"""The run's summary file (``OUTPUT/summary.json``), written atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json_atomically(path: Path, obj: Any) -> None:
    """Write, then rename over ``path``: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)
