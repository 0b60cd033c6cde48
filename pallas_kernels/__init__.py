"""Pallas kernel library for mla_jax. Imports jax only, never mla_jax."""
