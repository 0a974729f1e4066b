"""The Python face of csrc/: building the fused kernels (build.py), the torch custom operators
over them (ops.py), their pure-torch references (reference.py) and the one-time choice between
the two (dispatch.py)."""
