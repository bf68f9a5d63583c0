"""Client keys' limits and budgets, and model prices, as the gateway enforces them.

``policy`` holds the frozen values the snapshot carries (no Django);
``limiter`` the in-process limiter of the embedded default and the shared
interface; ``redis_limiter`` the Redis limiter of production mode (one round
trip per admission, gateway-wide), with its parts: ``commands`` (a key's
commands, encoded once), ``reserve``, ``writes`` (settles and releases written
unanswered), ``redis_keys``, ``scripts`` (the Lua of ``lua/``) and ``resp``
(its connection); ``spend`` reads the budgets' truth from the usage tables and
reconciles the fast counters with it.
"""
