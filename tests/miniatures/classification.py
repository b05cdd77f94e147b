"""Placeholder: filled in by its writer module."""

from miniatures import Miniature

MINIATURES: list[Miniature] = []
