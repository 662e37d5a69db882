"""Evaluation: the episode loop, and the eval worker (its handle and its
server) that scores params away from the actor."""
