"""memkv's protocol: the types every process agrees on, import-light (numpy + msgpack).

Layouts, chained block hashes, the dtype table, the shared enums, the session
id rule and the binary wire format. Nothing here imports torch or ray, so a
client (``memkv.client``) or a gateway can use it cheaply.
"""

from memkv.protocol.dtypes import DTYPES, StorageDType, dtype_info
from memkv.protocol.enums import Priority, SessionState, Tier
from memkv.protocol.hashing import HASH_BYTES, ROOT_HASH, BlockHash, chain_hashes, token_array
from memkv.protocol.ids import check_session_id
from memkv.protocol.layout import KVLayout

__all__ = [
    "DTYPES",
    "HASH_BYTES",
    "ROOT_HASH",
    "BlockHash",
    "KVLayout",
    "Priority",
    "SessionState",
    "StorageDType",
    "Tier",
    "chain_hashes",
    "check_session_id",
    "dtype_info",
    "token_array",
]
