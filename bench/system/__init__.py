"""Whole runs measured: beside upstream DreamerV3 (`e2e`), an agent's
start-up, the eval worker's cost and the Ray path's."""
