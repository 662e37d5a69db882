"""Development tools: how the run config travels through the code."""
