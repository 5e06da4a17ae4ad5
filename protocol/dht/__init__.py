"""The network-free core of the Kademlia DHT (docs/architecture.md §4): routing table, signed records, value storage.

The networked node (RPC handlers, iterative lookups) is built on these three modules and adds all I/O.
"""

from .records import ForgedSubkey, NodeInfo, ValueRecord
from .routing import ID_BITS, Contact, RoutingTable, bucket_index, key_id
from .storage import DHTStorage, StoredValue

__all__ = [
    "ID_BITS",
    "Contact",
    "DHTStorage",
    "ForgedSubkey",
    "NodeInfo",
    "RoutingTable",
    "StoredValue",
    "ValueRecord",
    "bucket_index",
    "key_id",
]
