"""``--quantize``: weights stored quantized for inference engines, computed while they stream.

``weights`` decides which weights are quantized (the same rules for every scheme) and builds the
export's catalog; each scheme (``scheme.Scheme``) is one module that says which shapes it takes,
the tensors it writes per weight and its ``quantization_config``; ``registry`` lists them. Reading
quantized releases back (dequantizing) is ``reshard.features.dequantize``.
"""
