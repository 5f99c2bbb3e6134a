"""Parametrized kernels for the hot ops, built in the loop IR (see gemm.py)."""
