"""Readers of image and label files that several datasets share."""
