"""Reading a checkpoint: safetensors headers, every expert's byte ranges, the families edge0 runs."""
