"""The stage worker (``python -m pp_worker``, ``pp-worker``): one pipeline stage served as JSON lines.

Data flows one way: cli -> loop -> protocol -> dispatch -> engine -> loop. Importing this package prints nothing
and imports no tinygrad (stub mode starts fast; the tinygrad engine is imported only in real mode).
"""
