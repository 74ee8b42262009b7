"""The gateway: harnesses talk to it as their model provider; every call is captured token-exactly.

``app`` builds the aiohttp application from the provider table; ``sessions`` ties requests to
sessions by key; ``capture`` journals every completion before it is answered; ``gate`` pauses
upstream calls for weight syncs; ``providers/`` translates each wire format to and from OpenAI Chat.
"""
