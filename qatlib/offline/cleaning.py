"""Docstring text -> clean English paragraphs (the cleaning step of `qatlib.offline.corpus`).

Doctests, reST literal blocks, fenced code and code-like paragraphs are dropped, reST / Markdown
markup is stripped and whitespace normalised. `dedupe_key` makes near-duplicates (``Conv1d`` /
``Conv2d`` docstrings) share a key.
"""

from __future__ import annotations

import re

_ROLE = re.compile(r":[\w.+-]+(?::[\w.+-]+)?:`~?!?([^`<]*?)(?:\s*<[^>]*>)?`")
_DOUBLE_TICK = re.compile(r"``(.+?)``")
_SINGLE_TICK = re.compile(r"`([^`\n]+?)`_{0,2}")
_BOLD = re.compile(r"\*\*(\S(?:.*?\S)?)\*\*")
_ITALIC = re.compile(r"(?<![\w*])\*(\S(?:[^*]*?\S)?)\*(?![\w*])")
_UNDERLINE = re.compile(r"^\s*([-=~^*#+\"'`.])\1{2,}\s*$")
_CODE_START = re.compile(
    r"^(>>>|\.\.\.\s|\$ |% |#|@\w|def |class \w+[(:]|import \w|from [\w.]+ import "
    r"|(if|elif|for|while|with|try|except|else|finally)\b.*:$|\w+(\.\w+)*\s*=[^=]|[)\]}]+,?$)"
)
_FIELD = re.compile(r"^(?:[-*+•] |\d{1,2}[.)] |[\w.*\\]+(?: \([^)]*\))?\s?:(?:\s|$)|[A-Z][\w ]{0,30}:$)")
# reST directives whose body is kept as text; every other directive is dropped with its body.
_PROSE_DIRECTIVES = frozenset(
    {"note", "warning", "tip", "important", "hint", "caution", "attention", "seealso", "danger"}
)
_DIRECTIVE = re.compile(r"^\.\.\s+([\w:-]+)::(.*)$")
_SYMBOLS = set("=()[]{}<>_*/\\|#@$%^&~+;")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _symbol_ratio(s: str) -> float:
    chars = [c for c in s if not c.isspace()]
    if not chars:
        return 0.0
    return sum(c in _SYMBOLS for c in chars) / len(chars)


def _letter_ratio(s: str) -> float:
    chars = [c for c in s if not c.isspace()]
    if not chars:
        return 0.0
    return sum(c.isalpha() for c in chars) / len(chars)


def _code_like(line: str) -> bool:
    """A line that looks like code (counts towards a paragraph being dropped as code)."""
    s = line.strip()
    if _CODE_START.match(s):
        return True
    r = _symbol_ratio(s)
    return r > 0.12 or (r > 0.05 and s.endswith(("{", ";", "(", "[", ",")))


def _surely_code(line: str) -> bool:
    """A line dropped even from a prose paragraph."""
    s = line.strip()
    return s.startswith((">>>", "... ")) or _symbol_ratio(s) > 0.2


def strip_markup(text: str) -> str:
    """reST / Markdown inline markup to plain text (``:class:`~a.B``` -> ``a.B``, ```x``` -> ``x``)."""
    text = _ROLE.sub(r"\1", text)
    text = _DOUBLE_TICK.sub(r"\1", text)
    text = _SINGLE_TICK.sub(r"\1", text)
    text = _BOLD.sub(r"\1", text)
    text = _ITALIC.sub(r"\1", text)
    return text


def _drop_blocks(lines: list[str]) -> list[str]:
    """Remove fenced code, doctest blocks, reST literal blocks and non-prose directives."""
    out: list[str] = []
    i, n = 0, len(lines)
    while i < n:
        line = lines[i].expandtabs(4).rstrip()
        s = line.strip()
        if s.startswith(("```", "~~~")):  # fenced block: drop up to the closing fence
            fence = s[:3]
            i += 1
            while i < n and not lines[i].strip().startswith(fence):
                i += 1
            i += 1
            continue
        if s.startswith(">>>"):  # doctest: drop prompts, continuations and output up to a blank line
            while i < n and lines[i].strip():
                i += 1
            continue
        m = _DIRECTIVE.match(s)
        if m:
            ind = _indent(line)
            name = m.group(1).lower()
            i += 1
            if name in _PROSE_DIRECTIVES:
                rest = m.group(2).strip()
                if rest:
                    out.append(" " * ind + rest)
                continue  # the indented body stays as text
            while i < n and (not lines[i].strip() or _indent(lines[i].expandtabs(4)) > ind):
                i += 1
            continue
        if s.endswith("::"):  # reST literal block: keep the sentence, drop the indented block
            ind = _indent(line)
            keep = s[:-2].rstrip()
            if keep:
                out.append(" " * ind + keep + ("" if keep.endswith((":", ".")) else ":"))
            i += 1
            while i < n and (not lines[i].strip() or _indent(lines[i].expandtabs(4)) > ind):
                i += 1
            out.append("")
            continue
        out.append(line)
        i += 1
    return out


def _paragraphs(lines: list[str]) -> list[list[str]]:
    paras: list[list[str]] = []
    cur: list[str] = []
    for line in lines:
        if line.strip() and not _UNDERLINE.match(line):
            cur.append(line)
        else:
            if cur:
                paras.append(cur)
            cur = []
    if cur:
        paras.append(cur)
    return paras


def _join(para: list[str]) -> str:
    """Unwrap hard-wrapped lines: a line joins the previous one unless it starts a list item or
    field (``x (int): ...``, ``- item``, ``Returns:``)."""
    out: list[str] = []
    base = _indent(para[0])
    for line in para:
        s = " ".join(line.split())
        if out and not (_FIELD.match(s) and _indent(line) <= base + 4):
            out[-1] = out[-1] + " " + s
        else:
            out.append(s)
            base = _indent(line)
    return "\n".join(out)


def clean_text(text: str, *, min_paragraph_chars: int = 40) -> list[str]:
    """Cleaned paragraphs of one docstring / topic: code and markup removed, whitespace normalised."""
    lines = _drop_blocks(text.replace("\r\n", "\n").replace("\r", "\n").split("\n"))
    out = []
    for para in _paragraphs(lines):
        code = sum(_code_like(ln) for ln in para)
        if code * 3 > len(para):
            continue
        para = [ln for ln in para if not _surely_code(ln)]
        if not para:
            continue
        p = strip_markup(_join(para))
        if len(p) < min_paragraph_chars or len(p.split()) < 6 or _letter_ratio(p) < 0.75:
            continue
        out.append(p)
    return out


def dedupe_key(paragraph: str) -> str:
    """Letters only, lower case: near-duplicates (``Conv1d`` vs ``Conv2d``) share a key."""
    return re.sub(r"[^a-z]+", "", paragraph.lower())
