"""The HTTP side of multimodal requests: image input checks and fetching, and per-family prompt expansion."""
