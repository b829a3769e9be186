"""Pallas GPU kernels (Triton lowering; interpret=True on CPU). Each file: BlockSizes, kernel, jitted wrapper, *_reference."""
