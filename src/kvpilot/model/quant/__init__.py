"""Packed quantized weights on CPU: GGUF Q8_0 / Q4_0 / Q4_1 blocks kept as stored, fused dequantizing kernels."""
