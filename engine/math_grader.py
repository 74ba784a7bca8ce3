"""Math answers as slime's `--rm-type math` reads them, plus rollflow's numeric and sympy equivalence on top.

slime (`slime/rollout/rm_hub/math_utils.py`, `grade_answer_verl`) takes the last `\\boxed{…}` of the response and
of the label (when the label is boxed), and calls them equal when the MATH dataset's answer normalisation
(Hendrycks et al., "mathd") makes them the same string, or when a sympy check says so. That normalisation is
re-implemented here (`normalize`):

    an enclosing \\text{…} is dropped               \\text{Evelyn} → Evelyn
    \\tfrac, \\dfrac → \\frac; \\left, \\right, \\!, line breaks, spaces, \\$ and \\% are dropped
    degrees are dropped                             45^\\circ, 45^{\\circ} → 45
    units after "\\text{ " are dropped               5 \\text{ cm} → 5
    a leading "." gets its 0                        .5 → 0.5,  {.5} → {0.5}
    a short left-hand side is dropped               x = 3 → 3  (at most 2 characters before "=")
    braces are added                                \\sqrt3 → \\sqrt{3},  \\frac12 → \\frac{1}{2},  \\frac1{72} → \\frac{1}{72}
    simple fractions are written one way            0.5 → \\frac{1}{2},  3/4 → \\frac{3}{4}

Where rollflow is deliberately more lenient than slime (`engine/rewards.py:math_reward`): a response without
`\\boxed{}` is graded on its last number (slime gives 0); after normalisation, numbers equal within 1e-9 and
sympy-equal expressions count (slime insists on the same unreduced fraction, 2/4 ≠ 1/2, and on integer answers
matching as integers).
"""
from __future__ import annotations

import re

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{…} (or \\fbox{…}) of `text`, braces balanced; None without one."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, i = 1, starts[-1]
    while i < len(text):
        depth += (text[i] == "{") - (text[i] == "}")
        if depth == 0:
            return text[starts[-1]:i]
        i += 1
    return None


def _braced_args(s: str, command: str, nargs: int) -> str:
    """Add the braces a LaTeX command's single-character arguments were written without:
    \\frac12 → \\frac{1}{2}, \\frac1{72} → \\frac{1}{72}, \\sqrt3 → \\sqrt{3}."""
    head, *rest = s.split(command)
    out = [head]
    for part in rest:
        out.append(command)
        for _ in range(nargs):
            if not part or part[0] == "{":
                break
            out.append("{" + part[0] + "}")
            part = part[1:]
        out.append(part)
    return "".join(out)


def _slash_fraction(s: str) -> str:
    """"3/4" (two integers, nothing else) → \\frac{3}{4}."""
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    return f"\\frac{{{int(m.group(1))}}}{{{int(m.group(2))}}}" if m and s == f"{int(m.group(1))}/{int(m.group(2))}" \
        else s


def normalize(answer: str) -> str:
    """The MATH dataset's answer normalisation (see the module docstring)."""
    s = str(answer).strip()
    m = re.fullmatch(r"\\text\{(.+?)\}", s)
    if m:
        s = m.group(1).strip()
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"), ("\\left", ""),
                     ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        s = s.replace(old, new)
    if "\\text{ " in s:  # "5 \text{ cm}": a unit on the right
        s = s.split("\\text{ ")[0]
    s = s.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    lhs, eq, rhs = s.partition("=")
    if eq and "=" not in rhs and len(lhs) <= 2:
        s = rhs
    s = _braced_args(s, "\\sqrt", 1).replace(" ", "")
    s = _braced_args(s, "\\frac", 2)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_fraction(s)


def label_answer(label) -> str:
    """The answer a label states: its last \\boxed{…} when it has one (slime grades boxed labels the same way)."""
    text = str(label)
    boxed = last_boxed(text) if "\\boxed" in text or "\\fbox" in text else None
    return boxed if boxed is not None else text
