"""polykv-langgraph: LangChain / LangGraph building blocks for the PolyKV server."""

from .chat_model import ChatPolyKV
from .client import (
    AsyncPolyKVClient,
    AuthenticationError,
    CapacityError,
    InvalidRequestError,
    PolyKVClient,
    PolyKVConnectionError,
    PolyKVContextOverflowError,
    PolyKVError,
    PolyKVTimeoutError,
    PoolNotFoundError,
    PoolSaturatedError,
    PrefixContractError,
    ServerError,
)
from .compaction import CompactionNode
from .graph import capacity_gate, capacity_reducer
from .local_server import LocalServer, find_polykv
from .tools import bound_tools, create_model_pool, make_pool_tools

__all__ = [
    "AsyncPolyKVClient",
    "AuthenticationError",
    "CapacityError",
    "ChatPolyKV",
    "CompactionNode",
    "InvalidRequestError",
    "LocalServer",
    "PolyKVClient",
    "PolyKVConnectionError",
    "PolyKVContextOverflowError",
    "PolyKVError",
    "PolyKVTimeoutError",
    "PoolNotFoundError",
    "PoolSaturatedError",
    "PrefixContractError",
    "ServerError",
    "bound_tools",
    "capacity_gate",
    "capacity_reducer",
    "create_model_pool",
    "find_polykv",
    "make_pool_tools",
]
