"""Contracts every layer shares: what a transition batch is
(`transitions`) and how state files are written (`atomic`)."""
