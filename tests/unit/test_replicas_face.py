"""replicas/face.py: the one face the core holds, in two forms. Both answer every method of it, with its
signature; `Solo` answers as a replica alone (nothing shared, claimed, bound or waited for). `Shared` against a
real Redis: tests/unit/test_cache_redis.py, test_cache_directory.py, and the core's tests."""

from __future__ import annotations

import inspect

import pytest
import torch

from encoder_service import errors
from encoder_service.cache import EmbeddingStore, Entry, make_key
from encoder_service.replicas import Marked, Replicas, Settled, Shared, Solo
from encoder_service.timeouts import Deadline


def face_members() -> dict[str, object]:
    return {name: value for name, value in vars(Replicas).items() if not name.startswith("_")}


@pytest.mark.parametrize("form", [Solo, Shared])
def test_each_form_answers_every_method_of_the_face(form):
    for name, member in face_members().items():
        assert hasattr(form, name), f"{form.__name__} has no {name}"
        mine = getattr(form, name)
        if inspect.isfunction(member):
            assert inspect.signature(mine).parameters.keys() == inspect.signature(member).parameters.keys(), name
            assert inspect.iscoroutinefunction(mine) == inspect.iscoroutinefunction(member), name


async def test_solo_is_the_store_alone():
    store = EmbeddingStore(1 << 20)
    solo = Solo(store)
    key = make_key(b"image bytes", "f" * 24, "blake3")
    entry = Entry.from_rows(torch.zeros(4, 8), (1, 4, 4), "main")
    assert await solo.get(key) is None and await solo.header(key) is None
    solo.put(key, entry)
    assert await solo.get(key) is entry and store.peek(key) is entry and await solo.header(key) == entry.header
    await solo.start()
    assert solo.readiness() == {"redis": "off"} and solo.owner is None and solo.owner_url is None
    assert solo.stats() == store.stats()
    assert await solo.bind_tags({key: 7}) == {} and solo.mark([], [key]) is None
    assert await solo.mark_pending([key]) == Marked(False)
    assert await solo.wait_for(key, None) is Settled.NOT_PENDING  # at once: nobody else encodes anything
    assert await solo.locate(key) is None and await solo.pull(key) is None and await solo.input(key) is None
    with pytest.raises(errors.NotFound, match="without Redis a fetch must reach the replica that encoded"):
        await solo.num_tokens_elsewhere(key, Deadline(None), take_over=None)
    assert await solo.rows_elsewhere(key, 0, 4, take_over=None) is None
    await solo.close()
