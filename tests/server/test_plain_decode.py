"""The plain model (chat without ``+rag``, text completions) decodes as ``+rag`` does: through the scheduler's batched
step, with torch's threads following the free cores at the pace of a request decoded alone, and the same greedy
tokens as served alone whatever the thread count in between (issue 38, item 4: the batched step never looked at the
free cores, so on a busy machine plain decoding kept a thread another process had taken)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from conftest import tiny_model
from test_document_store import make_store

from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.runtime import threads
from pc_rag.runtime.generate import collect
from pc_rag.runtime.model_call import ModelCall
from pc_rag.runtime.prefix_cache import PrefixCache
from pc_rag.runtime.request import Request
from pc_rag.runtime.scheduler import Scheduler
from pc_rag.server.prompt_server import PromptServer

QUESTION = "Where does the Danube end?"
NEW = 20  # decode steps past two ADAPT_EVERY marks


class _Flipping:
    """A thread policy that counts its looks and flips torch between one and two threads at each."""

    def __init__(self) -> None:
        self.looks = 0

    def adapt(self) -> int:
        self.looks += 1
        torch.set_num_threads(1 + self.looks % 2)
        return torch.get_num_threads()


class _AloneCalls:
    """Query calls with an attention keyword, as attention calibration's (``+ape``): the scheduler serves such a
    request alone (``output_attentions=False`` changes nothing in the forward)."""

    def first(self, recomputed: object) -> ModelCall:
        return ModelCall(kwargs={"output_attentions": False})

    def later(self, recomputed: object) -> ModelCall:
        return ModelCall(kwargs={"output_attentions": False})


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tokenizer) -> Iterator[tuple[PromptServer, PromptServer]]:
    engine = RagEngine(tiny_model("llama", tokenizer), RagPrompt())
    store = make_store(tmp_path_factory.mktemp("plain"), engine)
    scheduler = Scheduler(engine.lm, max_batch=4)
    before = torch.get_num_threads()
    yield PromptServer(store=store, scheduler=scheduler, prefix_cache=PrefixCache()), PromptServer(store=store)
    scheduler.close()
    torch.set_num_threads(before)


PLAIN: dict[str, Callable[[PromptServer], Request]] = {
    "chat": lambda s: s.request_chat([("user", QUESTION)], max_new_tokens=NEW),
    "chat-with-system": lambda s: s.request_chat([("user", QUESTION)], "Be brief.", max_new_tokens=NEW),
    "completion": lambda s: s.request_text(QUESTION, max_new_tokens=NEW),
}


def _served(server: PromptServer, build: Callable[[PromptServer], Request], monkeypatch) -> tuple[list[int], int]:
    """The reply's token ids through ``server``'s scheduler and the thread policy's looks meanwhile."""
    policy = _Flipping()
    monkeypatch.setattr(threads, "_POLICY", policy)
    scheduler = server.scheduler
    assert scheduler is not None
    result = collect(scheduler.submit(scheduler.call(lambda: build(server))))
    monkeypatch.setattr(threads, "_POLICY", None)
    return result.token_ids, policy.looks


@pytest.mark.parametrize("kind", sorted(PLAIN))
def test_plain_requests_decode_batched_at_the_thread_pace_of_a_request_alone(kind, servers, monkeypatch) -> None:
    served, alone = servers
    scheduler = served.scheduler
    assert scheduler is not None
    steps_before = scheduler.batch_steps
    tokens, batched_looks = _served(served, PLAIN[kind], monkeypatch)
    steps = scheduler.batch_steps - steps_before
    assert steps == len(tokens) - 1 > 2 * threads.ADAPT_EVERY  # every token after the first: one batched step
    assert batched_looks >= 1 + steps // threads.ADAPT_EVERY  # at admission, then every ADAPT_EVERY steps

    def served_alone(server: PromptServer) -> Request:
        request = PLAIN[kind](server)
        request.calls = _AloneCalls()  # as a calibrated +rag mode: decoded alone
        return request

    alone_tokens, alone_looks = _served(served, served_alone, monkeypatch)
    assert scheduler.batch_steps - steps_before == steps  # that one was not batched
    assert batched_looks >= alone_looks  # a plain request suffers a busy machine no more than one alone
    # nothing lost: the same greedy tokens as served alone without the scheduler, whatever the threads did
    reference = alone._backend.serve(PLAIN[kind](alone))
    "".join(reference)
    assert reference.result is not None
    assert tokens == alone_tokens == reference.result.token_ids


def test_model_work_run_for_callers_looks_at_the_free_cores_first(servers, monkeypatch) -> None:
    scheduler = servers[0].scheduler
    assert scheduler is not None
    policy = _Flipping()
    monkeypatch.setattr(threads, "_POLICY", policy)
    looked = scheduler.call(lambda: policy.looks)  # building a request (a prefix's KV, retrieval) runs here
    assert looked == 1
