"""`twinspark quantize`: quantized checkpoints (fp8, w4a16, int2 / int3 / int4 / int8 and EXL3 here; EXL3 also
through exllamav3's converter on a GPU)."""
