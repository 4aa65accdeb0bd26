"""Framework adapters (LangChain, LlamaIndex), each behind its optional extra."""

__all__: list[str] = []
