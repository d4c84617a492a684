"""tandem.kernels"""
