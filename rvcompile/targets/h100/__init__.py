"""H100 target: CUDA C++ kernels compiled to sm_90a cubins at build time, each with its numpy
reference (issue 3; so far the FP8 decode GEMV)."""
