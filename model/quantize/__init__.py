"""`twinspark quantize`: quantized checkpoints (fp8, w4a16 here; EXL3 through exllamav3's converter on a GPU)."""
