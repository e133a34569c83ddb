"""The router process: tokenized requests in, the engine's steps, token outputs out."""
