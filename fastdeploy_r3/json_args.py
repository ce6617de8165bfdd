"""A command-line JSON object: the text itself, or the path of a file holding it (a leaf module, as
errors.py: every room may import it)."""

from __future__ import annotations

import json
import os
from typing import Any

from fastdeploy_r3.errors import ConfigError


def json_object_arg(value: str, flag: str, example: str) -> Any:
    """Parse `value` (JSON text, or a path to a file of it) for `flag`; a clear ConfigError naming an
    `example` object when it is not JSON. The caller checks that the result is an object."""
    text = value.strip()
    if not text.startswith("{") and os.path.isfile(text):
        with open(text) as f:
            text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag} is not valid JSON ({e}); pass a JSON object such as '{example}' or the "
                          "path of a file holding one") from e
