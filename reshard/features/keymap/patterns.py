"""Name patterns for key maps: a regex to match, a replacement to write, and the inverse of both.

A rename rule is a regex and a replacement (``layers\\.(\\d+)\\.wq`` -> ``model.layers.\\1.q``).
Its inverse can be derived, not written by hand, when the regex is *literal text around capture
groups*: the replacement's literal text becomes the new regex (escaped), the original groups'
sub-patterns become its groups, and the original literal text becomes the new replacement. A
regex with wildcards outside its groups (``.*``, an unescaped ``.``) could have matched many
names, so no inverse exists; those rules still work forwards and say so when inverted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from reshard.core.errors import UsageError

__all__ = ["Pattern", "Replacement", "template", "invert"]

_META = set(".^$*+?{}[]|()")


@dataclass(frozen=True)
class Replacement:
    """A replacement string: literal text and group references (``\\1`` or ``\\g<1>``)."""

    text: str

    @cached_property
    def parts(self) -> tuple[str | int, ...]:
        out: list[str | int] = []
        lit, i, s = "", 0, self.text
        while i < len(s):
            m = re.match(r"\\(\d+)|\\g<(\d+)>", s[i:])
            if m:
                out.extend([lit, int(m.group(1) or m.group(2))] if lit else [int(m.group(1) or m.group(2))])
                lit, i = "", i + m.end()
            elif s.startswith("\\\\", i):
                lit, i = lit + "\\", i + 2
            else:
                lit, i = lit + s[i], i + 1
        return tuple(out + [lit] if lit else out)

    def render(self, groups: tuple[str, ...]) -> str:
        return "".join(p if isinstance(p, str) else groups[p - 1] for p in self.parts)


@dataclass(frozen=True)
class Pattern:
    """A regex matched against a whole name (``^``/``$`` optional)."""

    regex: str

    @cached_property
    def compiled(self) -> re.Pattern[str]:
        try:
            return re.compile(self.regex)
        except re.error as e:
            raise UsageError(f"key map pattern {self.regex!r} is not a valid regex ({e})") from None

    def match(self, name: str) -> tuple[str, ...] | None:
        m = self.compiled.fullmatch(name)
        return None if m is None else tuple(g or "" for g in m.groups())

    @cached_property
    def pieces(self) -> tuple[str | tuple[str], ...] | str:
        """Literal strings and ``(sub_pattern,)`` groups in order, or why there are none."""
        s = self.regex.removeprefix("^")
        s = s[:-1] if s.endswith("$") and not s.endswith("\\$") else s
        out: list[str | tuple[str]] = []
        lit, i = "", 0
        while i < len(s):
            c = s[i]
            if c == "\\":
                if i + 1 >= len(s) or s[i + 1].isalnum():
                    return f"{s[i:i + 2]!r} outside a group matches more than one text"
                lit, i = lit + s[i + 1], i + 2
            elif c == "(":
                depth, j = 0, i
                while j < len(s):
                    depth += {"(": 1, ")": -1}.get(s[j], 0)
                    j += 2 if s[j] == "\\" else 1
                    if depth == 0:
                        break
                if depth:
                    return "its parentheses are unbalanced"
                inner = s[i + 1 : j - 1]
                if inner.startswith("?"):
                    return f"group {s[i:j]!r} is not a plain capture group"
                out.extend([lit, (inner,)] if lit else [(inner,)])
                lit, i = "", j
            elif c in _META:
                return f"{c!r} outside a group matches more than one text (escape a literal dot as '\\.')"
            else:
                lit, i = lit + c, i + 1
        return tuple(out + [lit] if lit else out)

    def groups(self) -> list[str]:
        return [p[0] for p in self._invertible() if isinstance(p, tuple)]

    def _invertible(self) -> tuple[str | tuple[str], ...]:
        pieces = self.pieces
        if isinstance(pieces, str):
            raise UsageError(f"key map pattern {self.regex!r} cannot be inverted: {pieces}")
        return pieces

    def render(self, groups: tuple[str, ...]) -> str:
        """The one name this pattern matches with these group values."""
        out, k = [], 0
        for p in self._invertible():
            if isinstance(p, tuple):
                out.append(groups[k])
                k += 1
            else:
                out.append(p)
        return "".join(out)


def template(text: str) -> tuple[Pattern, Replacement]:
    """A table entry such as ``layers.{}.attention.wq.weight``: ``{}`` is a number, all else
    literal. Returns the regex that matches it and the replacement that writes it."""
    chunks = text.split("{}")
    regex = r"(\d+)".join(re.escape(c) for c in chunks)
    repl = "".join(c.replace("\\", "\\\\") + (f"\\{i + 1}" if i < len(chunks) - 1 else "") for i, c in enumerate(chunks))
    return Pattern(regex), Replacement(repl)


def invert(pattern: Pattern, replacement: Replacement) -> tuple[Pattern, Replacement]:
    """The rule that maps every output of ``pattern -> replacement`` back to its input.

    Each group of ``pattern`` must appear exactly once in ``replacement``, or the input could
    not be recovered from the output.
    """
    subs = pattern.groups()
    refs = [p for p in replacement.parts if isinstance(p, int)]
    if sorted(refs) != list(range(1, len(subs) + 1)):
        raise UsageError(
            f"key map rule {pattern.regex!r} -> {replacement.text!r} cannot be inverted: "
            f"the replacement must use each of its {len(subs)} groups exactly once"
        )
    new_regex = "".join(re.escape(p) if isinstance(p, str) else f"({subs[p - 1]})" for p in replacement.parts)
    position = {g: i + 1 for i, g in enumerate(refs)}  # old group number -> new group number
    new_repl, k = [], 0
    for p in pattern._invertible():
        if isinstance(p, tuple):
            k += 1
            new_repl.append(f"\\{position[k]}")
        else:
            new_repl.append(p.replace("\\", "\\\\"))
    return Pattern(new_regex), Replacement("".join(new_repl))
