"""langchain-tests' standard unit suite for ChatPolyKV."""
from typing import Type

from langchain_tests.unit_tests import ChatModelUnitTests

from polykv_langgraph import ChatPolyKV


class TestChatPolyKVUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> Type[ChatPolyKV]:
        return ChatPolyKV

    @property
    def chat_model_params(self) -> dict:
        return {"base_url": "http://127.0.0.1:9", "model": "smollm2", "temperature": 0}

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True
