"""Adapters between tierkv and the frameworks that run models.

Each adapter lives in its own module and imports its framework there, so ``import tierkv`` never
needs one: ``from tierkv.integrations.hf import TieredCache`` (Hugging Face transformers).
"""
