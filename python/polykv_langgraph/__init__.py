"""polykv-langgraph: LangChain / LangGraph building blocks for the PolyKV server."""

from .chat_model import ChatPolyKV
from .client import (
    AsyncPolyKVClient,
    CapacityError,
    PolyKVClient,
    PolyKVError,
    PoolNotFoundError,
    PoolSaturatedError,
    PrefixContractError,
)
from .compaction import CompactionNode
from .graph import capacity_gate, capacity_reducer
from .tools import make_pool_tools

__all__ = [
    "AsyncPolyKVClient",
    "CapacityError",
    "ChatPolyKV",
    "CompactionNode",
    "PolyKVClient",
    "PolyKVError",
    "PoolNotFoundError",
    "PoolSaturatedError",
    "PrefixContractError",
    "capacity_gate",
    "capacity_reducer",
    "make_pool_tools",
]
