"""Pieces the kernels of every architecture share (see the package docstring)."""
