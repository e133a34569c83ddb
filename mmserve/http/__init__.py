"""The HTTP process's API: routes (LightLLM's and OpenAI's), request and response formats, slow clients."""
