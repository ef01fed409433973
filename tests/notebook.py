"""Run a Markdown page as a notebook: its ```python cells in order, in one namespace, in this
interpreter, each preceded on stdout by a line naming it (``CELL``), so that a test can hold
each cell's output to the ```text block the page shows under it.

    python tests/notebook.py PAGE.md
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

CELL = "\x1enotebook cell {}"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)


def cells(page: str) -> list[tuple[str, str | None]]:
    """The page's python cells, each with the text block right after it (None if the next
    block is not one)."""
    blocks = [(m.group(1), m.group(2)) for m in FENCE.finditer(page)]
    out = []
    for i, (lang, code) in enumerate(blocks):
        if lang == "python":
            nxt = blocks[i + 1] if i + 1 < len(blocks) else None
            out.append((code, nxt[1] if nxt and nxt[0] == "text" else None))
    return out


def main(path: str) -> None:
    namespace: dict = {"__name__": "__notebook__"}
    for n, (code, _) in enumerate(cells(Path(path).read_text())):
        print(CELL.format(n), flush=True)
        exec(compile(code, f"{path}, cell {n}", "exec"), namespace)  # noqa: S102 - the page's own cells
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
