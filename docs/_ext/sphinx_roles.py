"""A griffe extension for the API reference: the docstrings are written with Sphinx roles
(``:class:`tensorx.Node```) and reST literal blocks (``text::``), which Markdown would show
verbatim. A role becomes an optional cross-reference (a link where the target is documented,
plain code where it is not; ``~a.b.C`` shows ``C``; a bare name is looked up in the
object's class, then its module) and a trailing ``::`` a plain colon."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):`(~?)([^`]+)`")
LITERAL = re.compile(r"(\S)::$", re.MULTILINE)


def convert(text: str, scope: str, module: str) -> str:
    def role(match: re.Match[str]) -> str:
        short, target = match.group(1), match.group(2).removesuffix("()")
        shown = target.rsplit(".", 1)[-1] if short else target
        if "." in target:
            return f'<autoref identifier="{target}" optional><code>{shown}</code></autoref>'
        return (f'<autoref identifier="{scope}.{target}" slug="{module}.{target}" optional>'
                f"<code>{shown}</code></autoref>")

    return LITERAL.sub(r"\1:", ROLE.sub(role, text))


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None:
            return
        scope = obj if obj.is_class or obj.is_module or obj.parent is None else obj.parent
        obj.docstring.value = convert(obj.docstring.value, scope.path, obj.module.path)
