"""Fault soaks: runs whose processes, hosts and disks keep failing, and the
checks of what they stored; `watch` reads a run from outside."""
