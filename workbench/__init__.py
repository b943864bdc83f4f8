"""Kernel workbench: tooling for studying Triton GPU kernels.

Sub-modules are imported on demand; importing `workbench` itself is cheap and
pulls in neither torch nor triton.
"""
__version__ = "0.1.0"
