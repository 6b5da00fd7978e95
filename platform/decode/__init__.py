"""The decode pool: imports prefilled KV (or prefills short prompts itself) and streams tokens."""
