"""The actor's serving: env steps/s of a fleet under each batch cutoff, its
host time per batch, and an RPC server's CPU."""
