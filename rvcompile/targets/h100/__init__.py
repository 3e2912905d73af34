"""H100 target: CUDA C++ kernels compiled to sm_90a cubins at build time, each module declaring
its kernel entries with their numpy references (contract.py, registry.py); lower.py turns the
IR into a kernel schedule."""
