"""The capture journal, readable without the gateway: the v2 line format (``format``), the
ordered off-loop writer (``writer``) and the streaming reader (``reader``) for v1 and v2."""
