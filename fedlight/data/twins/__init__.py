"""Offline twins: procedural stand-ins for datasets that cannot be downloaded here, made to keep a paper's
protocol (classes, clients, styles) so that its table's orderings can be tried offline."""
