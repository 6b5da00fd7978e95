"""The OpenAI-compatible ingress: HTTP + SSE (and gRPC), tokenization and chat templates."""
