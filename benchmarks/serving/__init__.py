"""The HTTP server under a load generator, beside llama.cpp's llama-server."""
