"""The capture journal and its storage, usable without the gateway: the v2 line format
(``format``), the ordered off-loop writer (``writer``), the streaming reader (``reader``), the
seams a store implements (``protocols``: sink, source, both, and the opener), the file store
(``store``) and the memory store (``memory``)."""
