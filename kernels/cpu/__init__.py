"""Compiled CPU kernels (C++ with OpenMP, loaded through ctypes) for the hot path."""
