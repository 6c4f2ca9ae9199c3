"""The floor: small modules that import nothing of dora_jax but one another."""
