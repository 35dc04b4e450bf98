"""The book's prose rules, measured on a chapter's markdown cells (tests/test_book_prose.py).

A sentence ends at ``.``, ``!`` or ``?`` followed by a space, or at the end of a paragraph, a
list item, a heading or a table row. Code spans, math and a link's target count as one word;
code blocks, boxes (admonitions, in either fence), directives' option lines and figures' alt text
are not prose.
"""

from __future__ import annotations

import json
import re
from pathlib import Path


def markdown(nb: Path) -> str:
    cells = json.loads(nb.read_text())["cells"]
    return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def _plain(md: str) -> str:
    # fenced blocks: code, and boxes (admonitions) in either fence, measured alike
    md = re.sub(r"^(```|~~~|:::).*?^\1\s*$", "\n\n", md, flags=re.S | re.M)
    md = re.sub(r"^:::?\{?[a-z-]*\}?.*$|^:[a-z-]+:.*$|^```\{.*$|^```\s*$", "\n\n", md, flags=re.M)
    md = re.sub(r"\$\$.*?\$\$", " X ", md, flags=re.S)
    md = re.sub(r"\$[^$\n]+\$", "X", md)
    md = re.sub(r"\{[a-z:]+\}`[^`]*`", "X", md)
    md = re.sub(r"`[^`\n]*`", "X", md)
    md = re.sub(r"!\[[^\]]*\]\([^)]*\)", " ", md)
    md = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", md)
    md = re.sub(r"<[^>]+>", " ", md)
    return md


def blocks(md: str) -> list[str]:
    """Paragraphs, list items, headings and table rows, each on one line."""
    out: list[str] = []
    for para in re.split(r"\n\s*\n", _plain(md)):
        cur: list[str] = []
        for line in para.splitlines():
            s = line.strip()
            if re.match(r"^(#+\s|[-*+]\s|\d+\.\s|\|)", s):
                if cur:
                    out.append(" ".join(cur))
                cur = [re.sub(r"^(#+|[-*+]|\d+\.|\|)\s*", "", s).replace("|", " ")]
                if s.startswith(("#", "|")):
                    out.append(cur.pop())
            elif s:
                cur.append(s)
        if cur:
            out.append(" ".join(cur))
    return [b for b in out if b.strip()]


def sentences(md: str) -> list[str]:
    out = []
    for b in blocks(md):
        b = re.sub(r"\b(e\.g|i\.e|etc|vs|cf|Fig|Eq)\.", r"\1", b)
        out += [s for s in re.split(r"(?<=[.!?])\s+", b) if s.split()]
    return out


def words(sentence: str) -> int:
    return len(sentence.split())


#: a date, a weekday or a named machine in prose (records live in results/)
DATED = re.compile(
    r"\b(20\d\d-\d\d-\d\d|(Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day|yesterday|a day earlier|"
    r"Xeon|EPYC|Zen ?4|Sapphire Rapids|H100 record|this morning)\b"
)
