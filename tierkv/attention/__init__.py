"""Attention over tiered pages: exact partial attention with a log-sum-exp merge
(:mod:`.partial`), per-page key summaries and top-k page selection (:mod:`.summaries`), host-side
attention over host-resident pages (:mod:`.host`) and the transformers attention function that
routes a :class:`~tierkv.integrations.hf.TieredCache`'s layers through them (:mod:`.hf`)."""
