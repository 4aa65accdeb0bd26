"""The retrieval query of a conversation: its last user turn, made standalone from the history when it refers back.

A follow-up ("When was he born?") names nothing a retriever can find; LlamaIndex's ``CondensePlusContextChatEngine``
asks the LLM to rewrite it. A 135M model rewrites poorly and the rewrite costs a generation per turn, so this
condenses without the model: a turn that refers back (a pronoun or demonstrative, or four words or fewer) is
searched with the previous user turn and the reply to it, where the entity it refers to was named. Measured on the
bundled follow-ups (``pc_rag.bench.condense``). This module knows nothing about models or stores.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

REFERS_BACK = re.compile(
    r"\b(it|its|he|him|his|she|her|hers|they|them|their|this|that|these|those|there|then|the same)\b", re.IGNORECASE
)
SHORT_TURN = 4  # words: "And the second?" names nothing either


def refers_back(text: str) -> bool:
    """Whether ``text`` leans on an earlier turn for what it is about."""
    return bool(REFERS_BACK.search(text)) or len(text.split()) <= SHORT_TURN


def standalone_query(turns: Sequence[tuple[str, str]], *, condense: bool = True) -> str:
    """The query to retrieve for the last user turn of ``(role, text)`` ``turns``: the turn itself, or (``condense``
    and it refers back) the previous user turn, the reply to it, then the turn."""
    users = [i for i, (role, _) in enumerate(turns) if role == "user"]
    assert users and users[-1] == len(turns) - 1, "a conversation ends with a user turn"
    question = turns[-1][1]
    if not condense or len(users) < 2 or not refers_back(question):
        return question
    previous = users[-2]
    context = [text for role, text in turns[previous:-1] if role in ("user", "assistant")]
    return " ".join([*context, question])
