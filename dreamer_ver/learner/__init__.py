"""The learner: trains the agent on replay's batches and publishes params."""
