"""A Griffe extension that rewrites fedlight's reST docstrings as Markdown (``rest_markdown.py``) once loaded.

Names in roles are resolved in the scope of the object whose docstring holds them (``:meth:`Strategy.check```
in ``fedlight.strategies.base`` is ``fedlight.strategies.base.Strategy.check``), as Sphinx resolves them.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path

import griffe

# Griffe loads an extension from its path alone, without its folder on the import path
_spec = spec_from_file_location("rest_markdown", Path(__file__).with_name("rest_markdown.py"))
rest_markdown = module_from_spec(_spec)
_spec.loader.exec_module(rest_markdown)


def resolve(obj: griffe.Object, target: str) -> str:
    """The full path of ``target`` as written in ``obj``'s docstring; ``target`` itself where it names nothing."""
    head, _, rest = target.partition(".")
    try:
        path = obj.resolve(head)
    except griffe.NameResolutionError:
        return target
    return f"{path}.{rest}" if rest else path


def defined_objects(obj: griffe.Object) -> Iterator[griffe.Object]:
    """``obj`` and every object defined inside it (not those imported into it, which their own module holds)."""
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from defined_objects(member)


class RestDocstrings(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        for obj in defined_objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = rest_markdown.rest_to_markdown(
                    obj.docstring.value, lambda target, obj=obj: resolve(obj, target)
                )
