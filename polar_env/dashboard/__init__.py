"""``polar-env dashboard``: a read-only web view of what the agents did.

``runs`` finds and indexes run folders and capture stores (through the trajectory reader and the
capture store's public API, never the journal format); ``session`` turns one session into pages
(transcript, merged traces token by token, raw journal records); ``research`` the figures a
researcher starts from (per task, per GRPO group, the evaluator's tests and integrity verdict,
what the trainer gets); ``server`` is the aiohttp app
(JSON API, server-sent live events, the shipped assets in ``static/``); ``command`` is the CLI.
"""
