"""The prefill pool: prompts to their first token, KV exported under a lease."""
