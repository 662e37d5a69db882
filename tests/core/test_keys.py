"""The one wording of a key mismatch (core/keys.py)."""

from dreamer_ver.core.keys import key_problems


def test_missing_and_unexpected_keys_are_named_sorted():
  assert key_problems({'b': 1, 'a': 2, 'c': 3}, {'c': 0, 'z': 0}) == [
      "missing keys ['a', 'b']", "unexpected keys ['z']"]
  assert key_problems({'a': 1}, {'a': 0}) == []


def test_a_long_list_is_cut_after_the_limit():
  expected = {f'k{i}': 0 for i in range(7)}
  assert key_problems(expected, {}, limit=3) == [
      "missing keys ['k0', 'k1', 'k2'] and 4 more"]
  assert key_problems(expected, {f'k{i}': 0 for i in range(4)},
                      limit=3) == ["missing keys ['k4', 'k5', 'k6']"]
