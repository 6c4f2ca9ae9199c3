"""Rewards: everything that turns a finished response into the number the trainer sees.

- tokens.py: rewards of response tokens, by name (the built-in token tasks);
- verifiers.py: rewards of decoded text (answer extraction and checkers that never
  execute the response), and the adapter to a token reward;
- shaping.py: what is added to a reward before training (DAPO's overlong punishment)
  and the zero-variance rule of dynamic sampling;
- pool.py: the killable worker processes every reward runs in (model text is
  untrusted input).

Nothing here imports the runtime, the rollout or the scheduler.
"""
