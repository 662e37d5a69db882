"""How a stored structure and the one given to it differ in their keys:
the one wording a checkpoint that does not fit the agent and a batch that
does not fit replay both use."""


def key_problems(expected, given, limit=None):
  """['missing keys [...]', 'unexpected keys [...]'] for the keys of
  `expected` that `given` lacks and those it has beyond them, each list
  sorted and cut after `limit` names ('and N more'); empty when they
  match."""
  problems = []
  for what, names in (('missing', set(expected) - set(given)),
                      ('unexpected', set(given) - set(expected))):
    if names:
      names = sorted(names)
      shown = names if limit is None else names[:limit]
      more = len(names) - len(shown)
      problems.append(f'{what} keys {shown}' + (f' and {more} more' if more
                                                 else ''))
  return problems
