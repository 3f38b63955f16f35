"""The names both halves of STTFedRec (:mod:`protocols.sttfedrec`) share: the two servers, the clients'
stream tags, the item-id key of the item-side parameters, and the errors a malformed message raises.

Split out of :mod:`protocols.sttfedrec` so that its client half (:mod:`protocols.sttfedrec_device`) and its
FL baseline (:mod:`protocols.sttfedrec_fl`) can use them without importing it; every name stays importable
from :mod:`protocols.sttfedrec`.
"""

from __future__ import annotations

__all__ = ["ITEM_ID", "RS", "SAS", "ProtocolError", "RequestError"]

RS, SAS = "rs", "sas"
#: stream tags of a client's own draws (recmodels.streams): its request, its user-tower dropout masks
_REQUEST_STREAM, _MASK_STREAM = 0x5354_5251, 0x5354_544D
#: the key of the per-item-id vectors in the item-side parameters (``item_id_embedding``)
ITEM_ID = "item_id"


class ProtocolError(ValueError):
    """A message that does not fit the protocol; refused before any state changes."""


class RequestError(ProtocolError):
    """An item request RS refuses (wrong length, unknown id, replay)."""
