"""Markdown reference of every flag, generated from RunConfig (docs/flags.md embeds it; a test keeps them equal)."""
from __future__ import annotations

import sys

from engine.config import SECTIONS
from engine.config.cli import flag

START, END = "<!-- flags:start -->", "<!-- flags:end -->"


def _default(field) -> str:
    d = field.default
    if (isinstance(d, str) and "/examples/" in d) or (isinstance(d, list) and any("/examples/" in str(x) for x in d)):
        return "bundled (`examples/…`)"
    return f"`{d!r}`" if d not in (None, [], {}) else ("—" if d is None else f"`{d!r}`")


def flags_markdown() -> str:
    out = []
    for section in SECTIONS:
        doc = (sys.modules[section.__module__].__doc__ or "").strip().splitlines()
        out.append(f"**{section.__name__.removesuffix('Args').lower()}** — {doc[0] if doc else ''}\n")
        out.append("| flag | default | meaning |\n|---|---|---|")
        for name, field in section.model_fields.items():
            text = (field.description or "").replace("|", "\\|").replace("\n", " ")
            shown = "`--sglang-<flag> [value]`" if name == "sglang_args" else f"`{flag(name)}`"
            out.append(f"| {shown} | {_default(field)} | {text} |")
        out.append("")
    from engine.config.slime_flags import markdown

    out.append(markdown())
    return "\n".join(out).rstrip() + "\n"


def embed(text: str, block: str, start: str = START, end: str = END) -> str:
    """Replace what lies between the start and end markers of `text` with `block`."""
    head, sep, rest = text.partition(start)
    _, sep2, tail = rest.partition(end)
    if not (sep and sep2):
        raise ValueError(f"markers {start} … {end} not found")
    return f"{head}{start}\n{block}{end}{tail}"


if __name__ == "__main__":
    # python -m engine.config.docs [--write docs/flags.md]
    if len(sys.argv) == 3 and sys.argv[1] == "--write":
        from pathlib import Path

        p = Path(sys.argv[2])
        p.write_text(embed(p.read_text(), flags_markdown()))
    else:
        print(flags_markdown())
