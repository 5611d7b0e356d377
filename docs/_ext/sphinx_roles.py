"""A griffe extension for the API reference: the docstrings are written with Sphinx roles
(``:class:`tensorx.Node```) and reST literal blocks (``text::``), which Markdown would show
verbatim. Roles become code spans (``~a.b.C`` shows ``C``) and ``::`` a plain colon."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):`(~?)([^`]+)`")
LITERAL = re.compile(r"(\S)::$", re.MULTILINE)


def _role(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def convert(text: str) -> str:
    return LITERAL.sub(r"\1:", ROLE.sub(_role, text))


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = convert(obj.docstring.value)
