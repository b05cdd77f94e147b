"""The ``fedlight`` command (and ``python -m fedlight``).

A help page shipped with the package (:mod:`fedlight.help_pages`) or already written on this installation
(:mod:`fedlight.help_cache`) is printed without importing torch or Lightning; everything else is
:func:`fedlight.cli.main`.
"""

from __future__ import annotations

import sys

from fedlight import help_cache, help_pages


def main(args: list[str] | None = None) -> None:
    args = sys.argv[1:] if args is None else list(args)
    page = help_pages.shipped(args) or help_cache.lookup(args)
    if page is not None:
        sys.stdout.write(page)
        return
    from fedlight.cli import main as run

    if not help_cache.is_help_request(args):
        return run(args)
    with help_cache.recording(args):
        run(args)


if __name__ == "__main__":
    main()
