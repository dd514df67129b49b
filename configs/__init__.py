"""Configurations of the experiments (ml_collections `get_config` files)."""
