"""Packed quantized weights on CPU: GGUF Q8_0 / Q4_0 / Q4_1, Q5_0 / Q5_1, K-quant (Q4_K, Q5_K, Q6_K) and table
(IQ4_NL, IQ4_XS, MXFP4) blocks kept as stored, fused dequantizing kernels and column-tiled int8 copies."""
