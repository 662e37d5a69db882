"""Process mechanics of a run: supervised child processes, Ray hosting, JAX
devices, graceful stops, the run token, and how components reach each other.
Nothing here knows what a component does."""
