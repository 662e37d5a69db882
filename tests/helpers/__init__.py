"""What tests in several folders share (tests/ is on sys.path: `from
helpers.agent import small_config`)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
