"""The architectures: the Llama decoder (llama.py), each variant in a file of its own that
declares what differs from it, and the registry that maps checkpoint names to them."""
