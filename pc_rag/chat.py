"""Split a tokenizer's chat template into per-role wrapper texts.

``<system>x</system>`` in PML becomes ``open + x + close`` where the wrappers are
read off the tokenizer's own chat template, so any chat model renders its turns
the way it was trained. The split is verified by re-rendering a conversation;
templates that cannot be split this way (e.g. ones that merge the system turn
into the first user turn) get a clear error. This module knows nothing about
modules, positions or KV.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from pc_rag.errors import PMLError
from pc_rag.pml.nodes import RoleName

_MARK = {"system": "\ue000S\ue000", "user": "\ue000U\ue000", "assistant": "\ue000A\ue000"}


@dataclass(frozen=True)
class ChatWrappers:
    """Texts around each role's content, and the prompt that opens the assistant's reply."""

    open: dict[RoleName, str]
    close: dict[RoleName, str]
    generation_prompt: str
    stop: tuple[str, ...] = ()  # texts that end a reply when the model has no end-of-turn token for it

    @classmethod
    def plain(cls) -> ChatWrappers:
        """For a base model without a chat template: turns as plain text (the system text, then a blank line), and
        a reply ends at its first line break, as LongBench runs base models on prompts that end in ``Answer:``."""
        return cls(
            open={"system": "", "user": "", "assistant": ""},
            close={"system": "\n\n", "user": "", "assistant": "\n"},
            generation_prompt="",
            stop=("\n",),
        )

    def wrap(self, role: RoleName, content: str) -> str:
        return self.open[role] + content + self.close[role]


def chat_wrappers(tokenizer: PreTrainedTokenizerBase) -> ChatWrappers:
    """Derive role wrappers from ``tokenizer.chat_template``; raise ``PMLError`` if it has none or cannot be split."""
    if not getattr(tokenizer, "chat_template", None):
        msg = "this tokenizer has no chat template, so <system>/<user>/<assistant> cannot be rendered"
        raise PMLError(msg)

    def render(roles: list[RoleName], generation: bool = False) -> str:
        messages = [{"role": r, "content": _MARK[r]} for r in roles]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)

    try:
        conversation = render(["system", "user", "assistant"])
        with_system = render(["system"])
        up_to_user = render(["system", "user"])
        prompt = render(["system", "user"], generation=True)
    except Exception as e:
        msg = f"the chat template cannot render a system/user/assistant conversation: {e}"
        raise PMLError(msg) from e
    parts = _split(conversation)
    if parts is None or not up_to_user.startswith(with_system) or not prompt.startswith(up_to_user):
        msg = "the chat template does not render each role as a separate turn; use plain text instead of role tags"
        raise PMLError(msg)
    before_s, s_to_u, u_to_a, after_a = parts
    system_close = with_system.split(_MARK["system"], 1)[1]
    user_close = up_to_user.split(_MARK["user"], 1)[1]
    if not s_to_u.startswith(system_close) or not u_to_a.startswith(user_close):
        msg = "the chat template's turn boundaries are inconsistent; use plain text instead of role tags"
        raise PMLError(msg)
    wrappers = ChatWrappers(
        open={"system": before_s, "user": s_to_u[len(system_close) :], "assistant": u_to_a[len(user_close) :]},
        close={"system": system_close, "user": user_close, "assistant": after_a},
        generation_prompt=prompt[len(up_to_user) :],
    )
    rebuilt = "".join(wrappers.wrap(r, _MARK[r]) for r in ("system", "user", "assistant"))
    if rebuilt != conversation:
        msg = "the chat template could not be split into per-role wrappers"
        raise PMLError(msg)
    return wrappers


def _split(conversation: str) -> tuple[str, str, str, str] | None:
    """Cut the rendered conversation at the three content marks, or None if they are not in order."""
    pieces: list[str] = []
    rest = conversation
    for role in ("system", "user", "assistant"):
        if rest.count(_MARK[role]) != 1:
            return None
        head, rest = rest.split(_MARK[role])
        pieces.append(head)
    return pieces[0], pieces[1], pieces[2], rest
