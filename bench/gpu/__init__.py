"""A GPU window in one bounded command (`gpu.sh`, `gpu.py`), its report,
and the wheels a machine without network needs."""
