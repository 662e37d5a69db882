"""Test hosts on one machine: network namespaces joined by a bridge, and a
TCP proxy that delays or drops."""
