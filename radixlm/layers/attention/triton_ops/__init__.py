"""Triton kernels for attention over the token-level KV pool (GPU only; import needs triton)."""
