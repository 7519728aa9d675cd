"""How a benchmark that writes an output folder leaves its result: NAME.json (everything
measured) and NAME.md (the table for docs/performance.md), the table also printed."""
from __future__ import annotations

import json
import os
from typing import Any


def save_report(out_dir: str, name: str, data: Any, text: str, indent: int = 1) -> None:
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(data, f, indent=indent)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(text)
    print(text)
