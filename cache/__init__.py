"""The image embedding cache: xxh3-keyed entries whose embeddings live in POSIX shared memory.

`key.py` names an image, `shm_store.py` holds the bytes (the visual process writes, the router maps them as tensor
views), `index.py` is the refcounted LRU bookkeeping of one owner process, and `coordinator.py` wraps the index for
the HTTP server's event loop (encode each new image once, wait for pending ones)."""
