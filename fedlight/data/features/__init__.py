"""Backbone feature caches and nearest-neighbour lists computed from them (FUSS)."""
