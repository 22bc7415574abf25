"""``tierkv demo``: a small Llama-style decoder whose KV does not fit the device tier."""
