"""Write docs/config.md from the config dataclasses: ``python scripts/config_reference.py`` (``--check``: exit 1
if docs/config.md is out of date, without writing it)."""

from __future__ import annotations

import sys
from pathlib import Path

from kvstream.config import reference_markdown

DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"

if __name__ == "__main__":
    text = reference_markdown()
    if "--check" in sys.argv[1:]:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is out of date: run python scripts/config_reference.py", file=sys.stderr)
            sys.exit(1)
        sys.exit(0)
    DOC.write_text(text)
    print(f"wrote {DOC}")
