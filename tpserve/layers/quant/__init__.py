"""Weight quantization: which format a checkpoint uses (config.py) and how a linear layer
holds and applies quantized weights (methods.py, packing.py)."""
