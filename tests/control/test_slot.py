"""The slot without HTTP: names, switches, drafts, cut-off streams, failed loads, on-demand off, unload."""

from __future__ import annotations

import gc
import weakref

import attrs
import pytest
import trio

from spark.actors.messages import GenerateRequest
from spark.control.slot import Refusal, Slot
from spark.engine.sampling import SamplingParams
from spark.recipes import load_recipes
from spark.serve_config import ServeConfig

CONFIG = ServeConfig(device="cpu", kv_cache_bytes=4 << 20, switch_grace_s=5.0, max_batch_size=8)
_TINY = "engine: spark\nmodel: dummy\ndummy:\n  preset: tiny-llama\n  config: {max_position_embeddings: 4096}\n"


@pytest.fixture
def catalog(tmp_path):
    def write(name: str, body: str, folder: str = "") -> None:
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / f"{name}.yaml").write_text(f"id: {name}\n{body}")

    write("tiny-a", "served_name: tiny-a\naliases: [ta]\n" + _TINY)
    write("tiny-b", "served_name: tiny-b\n" + _TINY)
    write("tiny-d", "served_name: tiny-d\nlifecycle: draft\n" + _TINY, "drafts")
    write("missing", "served_name: missing\nengine: spark\nmodel: /nowhere/model.gguf\n")
    (tmp_path / "garbage.gguf").write_bytes(b"not a gguf file at all")
    write("broken", f"served_name: broken\nengine: spark\nmodel: {tmp_path / 'garbage.gguf'}\n")
    write("remote", "served_name: remote\nengine: upstream\nmodel: m\nupstream:\n  base_url: http://127.0.0.1:1/v1\n")
    catalog = load_recipes(tmp_path)
    assert catalog.problems == ()
    return catalog


def _refusal(slot: Slot, name) -> Refusal:
    with pytest.raises(Refusal) as info:
        slot.route(name)
    return info.value


async def test_names_and_switching_on_demand(catalog):
    published = []
    slot = Slot(catalog, CONFIG, publish=published.append)
    a, b = catalog.get("tiny-a"), catalog.get("tiny-b")
    async with trio.open_nursery() as nursery:
        await nursery.start(slot.run, a)
        assert slot.state == "active" and published[-1].recipe is a
        assert slot.route(None) is slot.route("sparky") is slot.route("ta") is slot.route("tiny-a") is a
        assert _refusal(slot, "nope").status == 404
        assert _refusal(slot, "tiny-d").status == 404  # a draft is not served by name
        assert slot.route("remote") is catalog.get("remote") and slot.state == "active"  # proxied: no switch
        missing = _refusal(slot, "missing")
        assert (missing.status, missing.code) == (503, "model_unavailable") and "/nowhere" in missing.message
        loading = _refusal(slot, "tiny-b")
        assert (loading.status, loading.code) == (503, "model_loading") and loading.retry_after >= 1
        assert slot.switching and published[-1] is None  # the routes lost the old model at once
        assert slot.status()["target"] == "tiny-b" and slot.status()["eta_s"] >= 1  # the portal's progress
        assert _refusal(slot, "tiny-b").code == "model_loading"  # no second switch
        assert "busy switching to tiny-b" in _refusal(slot, "ta").message
        assert _refusal(slot, "sparky").status == 503
        with pytest.raises(Refusal, match="in progress"):
            slot.switch_to(a)
        await slot.switch_to(b).wait()  # the switch in progress
        assert slot.route("tiny-b") is slot.route("sparky") is b and published[-1].recipe is b
        assert slot.status()["eta_s"] is None
        assert slot.last_unload["recipe"] == "tiny-a" and slot.last_unload["kv_pages_in_use"] == 0
        draft = catalog.get("tiny-d")
        await slot.switch_to(draft).wait()  # by id it comes up, and then answers to its name
        assert slot.route("tiny-d") is draft
        assert [c["id"] for c in slot.model_cards(0) if c["state"] == "active"] == ["tiny-d", "sparky", "sparky-think",
                                                                                        "sparky-fast"]
        down = slot.take_down()
        # while it goes down (no target): refusals, not an AttributeError (issue 27.8)
        assert "taking the model down" in _refusal(slot, "ta").message and _refusal(slot, "ta").status == 503
        assert _refusal(slot, None).code == "model_loading"
        for again in (lambda: slot.switch_to(a), slot.take_down):
            with pytest.raises(Refusal, match="taking the model down is in progress") as busy:
                again()
            assert busy.value.status == 409
        await down.wait()
        assert slot.state == "idle" and slot.model is None and published[-1] is None
        assert _refusal(slot, None).code == "no_active_model"
        slot.stop()


async def test_a_failed_load_leaves_the_slot_empty_and_serving_goes_on(catalog):
    slot = Slot(catalog, CONFIG)
    async with trio.open_nursery() as nursery:
        await nursery.start(slot.run, catalog.get("tiny-a"))
        await slot.switch_to(catalog.get("broken")).wait()
        assert slot.state == "failed" and "ModelLoadError" in slot.error and slot.model is None
        assert "the last load failed" in _refusal(slot, "sparky").message
        assert slot.recipe_state(catalog.get("broken")) == ("available", None)  # the file exists; a retry may work
        assert _refusal(slot, "ta").code == "model_loading"  # names still switch
        await slot.switch_to(catalog.get("tiny-a")).wait()
        assert slot.state == "active" and slot.error is None
        slot.stop()


async def test_switching_on_demand_off(catalog):
    slot = Slot(catalog, attrs.evolve(CONFIG, switch_on_demand=False))
    async with trio.open_nursery() as nursery:
        await nursery.start(slot.run, catalog.get("tiny-a"))
        refusal = _refusal(slot, "tiny-b")
        assert (refusal.status, refusal.code) == (400, "model_not_active") and "spark inference up tiny-b" in \
            refusal.message
        assert slot.state == "active" and slot.active is catalog.get("tiny-a")
        slot.stop()


async def test_streams_past_the_grace_period_end_with_an_error_piece(catalog):
    slot = Slot(catalog, CONFIG)
    async with trio.open_nursery() as nursery:
        await nursery.start(slot.run, catalog.get("tiny-a"))
        model = slot.model
        params = SamplingParams(temperature=1.0, max_tokens=3000, ignore_eos=True)
        streams = [model.submit(GenerateRequest(f"r{i}", (1, 2, 3), params)) for i in range(3)]
        finished = []

        async def read(stream) -> None:
            async with stream:
                async for piece in stream:
                    if piece.finish_reason is not None:
                        finished.append(piece)

        for stream in streams:
            nursery.start_soon(read, stream)
        while model.kv_pages_used() == 0:
            await trio.sleep(0.01)
        with trio.fail_after(30):
            await slot.switch_to(catalog.get("tiny-b"), grace_s=0.2).wait()
        assert [p.finish_reason for p in finished] == ["error"] * 3
        assert all("tiny-a was unloaded (switching to tiny-b)" in p.error for p in finished)
        assert slot.last_unload == {**slot.last_unload, "cut_off": 3, "still_open": 0, "kv_pages_in_use": 0}
        slot.stop()


def test_engine_close_frees_the_weights_even_while_referenced():
    from spark.engine.engine import Engine

    engine = Engine.load("dummy:tiny-llama", device="cpu", kv_cache_bytes=1 << 20, progress=False)
    model, cache = weakref.ref(engine.model), weakref.ref(engine.kv_cache)
    engine.close()
    gc.collect()
    assert model() is None and cache() is None
