"""The ahead-of-time kernel build: `python -m jax_padsafe.kernels.build --out DIR` (see __main__.py).

- variants.py: the variant matrix (forward and backward) and the tuning table
- families.py: what each kernel family compiles (kernel objects, fake arguments, exported parameter lists)
- registry.py: the C++ registry headers and object lists for ffi/
- cache.py:    hash-keyed reuse of exported objects
"""
