"""``tierkv plan``: a capacity planner for tiered KV."""
