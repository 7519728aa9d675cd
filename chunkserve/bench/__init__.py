"""Load generation and measurement against an OpenAI-compatible server (`chunkserve bench ...`)."""
