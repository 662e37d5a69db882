"""The library surface for users of a batched policy without the CLI:
`InferenceServer` (`server`), its callers' side (`client`) and the
`Collector` of transitions from N envs."""
