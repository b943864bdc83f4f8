"""Pieces every kernel family shares: interpreter fixes, CUDA context."""
