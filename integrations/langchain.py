"""LangChain adapters: a chat model and an LLM that splice cached prompt modules, a retriever and a vector store.

A cached RAG chain in LCEL::

    retriever = PromptModuleRetriever(store=store, k=4)
    chain = (
        {"context": retriever | format_modules, "question": RunnablePassthrough()}
        | module_prompt_template(store)
        | PromptCacheLLM.from_store(store)
    )

Everything here needs ``pip install pc-rag[langchain]``. This module only
re-exports; it knows nothing of its own.
"""

from pc_rag.integrations.langchain_chat import ChatPromptCache
from pc_rag.integrations.langchain_llm import PromptCacheLLM
from pc_rag.integrations.langchain_vectorstore import PromptCacheVectorStore
from pc_rag.retrievers.langchain import PromptModuleRetriever, format_modules, module_prompt_template

__all__ = [
    "ChatPromptCache",
    "PromptCacheLLM",
    "PromptCacheVectorStore",
    "PromptModuleRetriever",
    "format_modules",
    "module_prompt_template",
]
