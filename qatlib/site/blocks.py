"""Generated blocks inside hand-written markdown: the text between

    <!-- generated:NAME (python -m qatlib.site) -->
    ...
    <!-- /generated:NAME -->

is a generator's output; everything around it is written by hand. `replace` swaps a block's body
and `body` reads it, so the README and the docs pages keep their prose while their tables come
from the code and the committed JSON.
"""

from __future__ import annotations

import re

HINT = "python -m qatlib.site"


class BlockError(ValueError):
    """A file lacks a block, or has it twice, or its markers are unbalanced."""


def _pattern(name: str) -> re.Pattern[str]:
    n = re.escape(name)
    return re.compile(rf"(<!-- generated:{n}\b[^>]*-->\n)(.*?)(<!-- /generated:{n} -->)", re.S)


def open_marker(name: str) -> str:
    return f"<!-- generated:{name} ({HINT}) -->"


def close_marker(name: str) -> str:
    return f"<!-- /generated:{name} -->"


def names(text: str) -> list[str]:
    """The names of the blocks in ``text``, in order."""
    return re.findall(r"<!-- generated:([\w.-]+)\b", text)


def _match(text: str, name: str, where: str) -> re.Match[str]:
    found = list(_pattern(name).finditer(text))
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        raise BlockError(
            f"{where}: {what} generated block {name!r} ({open_marker(name)} ... {close_marker(name)})"
        )
    return found[0]


def body(text: str, name: str, where: str = "<text>") -> str:
    """The body of block ``name`` (without its trailing newline)."""
    return _match(text, name, where).group(2).rstrip("\n")


def replace(text: str, name: str, new_body: str, where: str = "<text>") -> str:
    """``text`` with block ``name``'s body replaced by ``new_body``."""
    m = _match(text, name, where)
    return text[: m.start(2)] + new_body.rstrip("\n") + "\n" + text[m.end(2) :]
