"""One reader of a JSON file written by vexact or handed to it (a map, a sweep's spec), with one error for a
damaged one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path, what: str) -> Any:
    """The parsed contents of ``path``. A file that is not UTF-8 text or not JSON is one ValueError that starts with
    ``what`` (how the caller names the file to its user, e.g. "map file 'x.json'"). A missing file is the caller's
    to word (it knows what the user should have given), so check ``path.is_file()`` first."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} is not valid JSON (not UTF-8 text)") from None
