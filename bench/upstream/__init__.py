"""Upstream DreamerV3 on this project's interpreter and JAX: its
environment, its learner at the learner bench's configuration, and the
start-up shim."""
