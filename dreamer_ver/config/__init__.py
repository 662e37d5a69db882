"""The run's configuration: YAML blocks composed with flags (`loading`),
the checks of its values (`validation`), and the checks made once before
anything starts (`preflight`)."""
