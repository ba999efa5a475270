"""Our Triton kernels for quantized weights (CUDA; tests also run them under the
Triton interpreter): `fp8.py` (activation quantization, the FP8 GEMV, the W8A8
GEMM), `int4.py` (the int4 GEMV and GEMM of AWQ / GPTQ weights)."""
