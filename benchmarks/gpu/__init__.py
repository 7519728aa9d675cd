"""The one check to run on a CUDA machine."""
