"""kvwire's sans-IO protocol cores: one object per role and mode, ``(now, input) -> actions``.

See ``docs/cores.md`` for the theory of operation; ``kvwire.connector`` drives them with threads and
NIXL, ``kvwire.testing.sim`` in virtual time.
"""
