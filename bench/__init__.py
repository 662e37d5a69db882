"""Benchmarks, fault soaks and the harnesses they share, one folder per
concept (bench/README.md is the index). Not part of the installed
package: run a module from the repository root, `python -m
bench.<folder>.<module>`, so that its imports of the others resolve."""
