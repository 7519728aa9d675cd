"""Paged attention backends behind one interface (backend.py), and which one a model runs with
(select.py): `torch` (the reference), `cpu` (C kernels), `triton` (the GPU path)."""
