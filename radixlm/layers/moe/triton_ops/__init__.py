"""Triton kernels of the fused MoE (GPU, or the Triton interpreter; import needs triton).

The entry point is `fused_moe.fused_experts`."""
