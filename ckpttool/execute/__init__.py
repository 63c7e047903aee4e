"""Execution: a Plan in, its output files' bytes in DST/.ckpttool-partial out, with memory bounded by
chunks in flight, every finished piece journalled for --resume, on the CPU (numpy) or CUDA (Triton),
in one process or across torchrun ranks."""
