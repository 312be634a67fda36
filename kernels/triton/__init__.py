"""Triton implementations of the ops in kernels/; each registers itself with its op's dispatcher."""
