"""A decoder's building blocks: linear layers in each weight format (dense, int8, int4), the
small ops between the GEMMs (layer_ops.py) and rotary embeddings (rotary.py)."""
