"""Sans-I/O wire layer: envelope, message schemas, sealing, replay protection, identities."""

from .envelope import HEADER_SIZE, Header, parse_header
from .errors import WireError
from .identity import Identity, KeyFileError, node_id_of
from .messages import MsgType, decode, encode
from .seal import TAG_SIZE, Opener, Sealer

__all__ = [
    "HEADER_SIZE",
    "TAG_SIZE",
    "Header",
    "Identity",
    "KeyFileError",
    "MsgType",
    "Opener",
    "Sealer",
    "WireError",
    "decode",
    "encode",
    "node_id_of",
    "parse_header",
]
