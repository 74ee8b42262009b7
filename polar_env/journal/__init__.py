"""The capture journal and its storage, usable without the gateway: the v2 line format
(``format``), the ordered off-loop writer (``writer``), the streaming reader (``reader``), the
file store (``store``) and the two seams a store implements (``protocols``: sink and source)."""
