"""The one slot: at most one spark-engine recipe loaded at a time, many model names in front of it.

States: ``idle`` (nothing loaded), ``draining`` (a switch waits for the old model's
streams), ``loading`` (the new model loads and runs its preflight), ``active``,
``failed`` (the last load failed; nothing is loaded).

A switch, step by step (one at a time, in the slot's nursery):

  1. the old model stops admitting: the routes lose it at once (``publish(None)``) and
     a request that already holds it gets 503 at submit;
  2. its open streams get ``grace_s`` to finish; the rest are cut off with an error
     piece naming the switch, and their requests are cancelled;
  3. the actor system closes once the scheduler has freed their KV pages, and the
     engine is released (references dropped, ``torch.cuda.empty_cache()``);
  4. the new recipe loads in a worker thread and runs its preflight (one real
     generation for spark, ``GET /models`` for upstream), then is published.

Upstream recipes need no slot: a request naming one is proxied at once. Bringing
one *up* makes it the active profile (``sparky`` goes there) and unloads the local
model, so that the external engine has the GPU.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from typing import Callable

import attrs
import trio

from spark.actors.ingress import SubmitError
from spark.control.activity import ActivityLog
from spark.control.local import LocalModel
from spark.control.upstream import Upstreams
from spark.control.usage import UsageCounters
from spark.core.interfaces import LoadedEngine
from spark.recipes.loading import Catalog
from spark.recipes.schema import RESERVED_NAMES, Recipe, Sampling
from spark.recipes.serving import unavailable_reason
from spark.serve_config import ServeConfig

log = logging.getLogger("spark.control")

CUT_OFF_WAIT_S = 5.0  # for cut-off streams to be closed by their readers
PAGES_FREE_WAIT_S = 2.0  # for the scheduler to free the pages of cancelled requests
DEFAULT_LOAD_S = {"spark": 5.0, "upstream": 1.0}  # Retry-After guess before a recipe's first load


#: A request the slot cannot serve now (``status``, ``code``, ``message``, ``retry_after``): the refusal
#: the actor system gives, so that the HTTP layer turns both into its error the same way.
Refusal = SubmitError


class Slot:
    """Owns the loaded model and every switch.

    Args:
      catalog: the recipes it may serve.
      config: the server's config (a recipe's fields override it per model).
      publish: told the model the routes should use now, or None.
      engine: an engine already loaded for the recipe active at start (tests, ``spark serve --model``).
      activity: where request lines go (None: nowhere).
      usage: token counters per recipe.
    """

    def __init__(self, catalog: Catalog, config: ServeConfig, *,
                 publish: Callable[[LocalModel | None], None] = lambda model: None,
                 engine: LoadedEngine | None = None,
                 activity: ActivityLog | None = None, usage: UsageCounters | None = None):
        self.catalog, self.config = catalog, config
        self.activity, self.usage = activity, usage or UsageCounters()
        self.upstreams = Upstreams()
        self.state = "idle"
        self.active: Recipe | None = None  # the profile in the slot
        self.model: LocalModel | None = None  # its loaded engine, for a spark recipe
        self.target: Recipe | None = None  # where a switch in progress goes
        self.error: str | None = None
        self.since = time.time()  # of the current state
        self.last_unload: dict | None = None
        self.load_seconds: dict[str, float] = {}
        self.events: collections.deque[dict] = collections.deque(maxlen=200)
        self._publish, self._preloaded = publish, engine
        self._nursery: trio.Nursery | None = None
        self._switch_started = 0.0
        self._switch_grace = 0.0
        self._grace_scope: trio.CancelScope | None = None  # an unload's wait for its streams
        self._switched = trio.Event()
        self._switched.set()
        self._stop = trio.Event()

    # -- lifetime ---------------------------------------------------------------------------------
    async def run(self, initial: Recipe | None, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Bring ``initial`` up, report started, and serve until ``stop``.

        Raises:
            Exception: ``initial`` failed to load (start-up fails with it).
        """
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if initial is not None:
                    self._begin(initial, grace_s=0.0)
                    try:
                        await self._bring_up(initial, engine=self._preloaded)
                    finally:
                        self._preloaded = None
                        self._switched.set()
                task_status.started()
                await self._stop.wait()
                if self.model is not None:
                    self.model.evict("the server is shutting down")
                nursery.cancel_scope.cancel()
        finally:
            self._publish(None)
            self.usage.flush()
            with trio.CancelScope(shield=True):
                await self.upstreams.aclose()
                if self.model is not None:
                    await self.model.release()
                    self.model = None

    def stop(self) -> None:
        self._stop.set()

    # -- switching --------------------------------------------------------------------------------
    @property
    def switching(self) -> bool:
        return self.state in ("draining", "loading")

    def switch_to(self, recipe: Recipe, *, grace_s: float | None = None) -> trio.Event:
        """Start a switch to ``recipe`` (no-op if it is active or already the target).

        Returns:
            An event set when the switch is over (``state`` and ``error`` tell how it went).

        Raises:
            Refusal: 409 while a switch to another recipe runs; 503 when its weights are missing.
        """
        if self.switching:
            if self.target is recipe:
                return self._switched
            raise Refusal(409, "switch_in_progress", f"{self._under_way()} is in progress",
                          retry_after=self.eta())
        if self.state == "active" and self.active is recipe:
            done = trio.Event()
            done.set()
            return done
        reason = unavailable_reason(recipe)
        if reason is not None:
            raise Refusal(503, "model_unavailable",
                          f"model {recipe.served_name!r} (recipe {recipe.id}) is unavailable here: {reason}")
        self._begin(recipe, grace_s=self.config.switch_grace_s if grace_s is None else grace_s)
        self._nursery.start_soon(self._switch, recipe)
        return self._switched

    def take_down(self, *, grace_s: float | None = None) -> trio.Event:
        """Unload whatever is active (``spark inference down``); returns an event set when done.

        Raises:
            Refusal: 409 while a switch runs.
        """
        if self.switching:
            raise Refusal(409, "switch_in_progress", f"{self._under_way()} is in progress",
                          retry_after=self.eta())
        self._begin(None, grace_s=self.config.switch_grace_s if grace_s is None else grace_s)
        self._nursery.start_soon(self._switch, None)
        return self._switched

    def shut_down(self, *, grace_s: float) -> trio.Event:
        """Stop admitting and unload for the server's exit: open streams get ``grace_s`` to finish,
        the rest end with an error event saying the server is shutting down. Returns an event set
        when done; a switch under way is waited for first."""
        done = trio.Event()

        async def drain() -> None:
            await self._switched.wait()
            self._begin(None, grace_s=grace_s)
            await self._switch(None, why="the server is shutting down")
            done.set()

        self._nursery.start_soon(drain)
        return done

    def cut_short(self) -> None:
        """End the grace period of an unload under way now (a second Ctrl-C)."""
        self._switch_grace = 0.0
        if self._grace_scope is not None:
            self._grace_scope.cancel()

    def _begin(self, recipe: Recipe | None, *, grace_s: float) -> None:
        """The synchronous half of a switch: from here on no request reaches the old model."""
        self.target, self._switch_grace = recipe, grace_s
        self._switch_started = time.monotonic()
        self._switched = trio.Event()
        self._set_state("draining" if self.model is not None else "loading")
        self._publish(None)
        if self.model is not None:
            self.model.admitting = False
        self._event("switch", recipe.id if recipe else None, f"from {self.active.id if self.active else 'nothing'}")

    async def _switch(self, recipe: Recipe | None, *, why: str | None = None) -> None:
        try:
            await self._unload(why or (f"switching to {recipe.served_name}" if recipe else "taken down"))
            if recipe is None:
                self._set_state("idle")
            else:
                await self._bring_up(recipe)
        except Exception as exc:  # a load that fails leaves the slot empty, and the server up
            log.exception("switch to %s failed", recipe.id if recipe else None)
            self.active, self.error = None, f"{type(exc).__name__}: {exc}"
            self._set_state("failed")
            self._event("failed", recipe.id if recipe else None, self.error)
        finally:
            self.target = None
            self._switched.set()

    async def _unload(self, why: str) -> None:
        model, old = self.model, self.active
        self.active = None
        if model is None:
            return
        with trio.move_on_after(self._switch_grace) as self._grace_scope:
            await model.drained()
        self._grace_scope = None
        cut = model.open_streams
        if cut:
            model.evict(f"{old.served_name} was unloaded ({why}) before this generation finished; retry the request")
            with trio.move_on_after(CUT_OFF_WAIT_S):
                await model.drained()
        with trio.move_on_after(PAGES_FREE_WAIT_S):
            while model.kv_pages_used() > 0:  # cancels of the cut-off requests are still on their way
                await trio.sleep(0.01)
        pages = model.kv_pages_used()
        await model.close()
        self.model = None
        await model.release()
        self.last_unload = {"recipe": old.id, "time": time.time(), "cut_off": cut,
                            "still_open": model.open_streams, "kv_pages_in_use": pages}
        self._event("unloaded", old.id, f"{cut} generation(s) cut off, {int(pages)} KV page(s) in use at close")

    async def _bring_up(self, recipe: Recipe, *, engine: LoadedEngine | None = None) -> None:
        self.target = recipe
        self._set_state("loading")
        t0 = time.monotonic()
        if recipe.engine == "spark":
            model = await LocalModel.load(recipe, self.config, engine=engine)
            try:
                await self._nursery.start(model.host, self._on_model_failure)
            except BaseException:
                await model.release()
                raise
            self.model = model
        else:
            await self.upstreams.preflight(recipe)
        self.load_seconds[recipe.id] = time.monotonic() - t0
        self.active, self.error, self.target = recipe, None, None
        self._set_state("active")
        self._publish(self.model)
        self._event("active", recipe.id, f"up in {self.load_seconds[recipe.id]:.2f}s")

    def _on_model_failure(self, model: LocalModel, exc: BaseException) -> None:
        if self.model is not model:
            return
        self._publish(None)
        self.model, self.active, self.error = None, None, f"the actor system failed: {type(exc).__name__}: {exc}"
        self._set_state("failed")
        self._event("failed", model.recipe.id, self.error)
        self._nursery.start_soon(model.release)

    # -- names ------------------------------------------------------------------------------------
    def route(self, name: str | None) -> Recipe:
        """The recipe that answers a request for model ``name`` (None or ``sparky``: the active one).

        A name of another spark recipe starts a switch to it (when switching on demand is on).

        Raises:
            Refusal: 404 unknown name; 503 + Retry-After while a switch runs or after one started;
              400 when switching on demand is off; 503 when nothing is active.
        """
        recipe = self.lookup(name)
        if recipe is self.active and self.state == "active":
            return recipe
        if recipe.engine == "upstream":
            return recipe  # proxied at once: the slot is not involved
        if self.switching:
            what = "loading" if self.target is recipe else f"busy {self._under_way()}"
            raise Refusal(503, "model_loading", f"model {name!r} is not ready: the server is {what}; retry shortly",
                          retry_after=self.eta())
        if not self.config.switch_on_demand:
            active = self.active.served_name if self.active else "none"
            raise Refusal(400, "model_not_active",
                          f"model {name!r} is not active (the active model is {active!r}) and switching on "
                          f"demand is off: an admin can run `spark inference up {recipe.id}`")
        self.switch_to(recipe)
        raise Refusal(503, "model_loading", f"model {name!r} is loading (switching from "
                      f"{self.active.served_name if self.active else 'nothing'}); retry shortly",
                      retry_after=self.eta())

    def lookup(self, name: str | None) -> Recipe:
        """The recipe ``name`` means now, starting nothing (a route only an upstream serves asks this).

        Raises:
            Refusal: 404 unknown name; 503 when a reserved name finds nothing active.
        """
        if name is None or name in RESERVED_NAMES:
            if self.state == "active":
                return self.active
            raise self._not_ready()
        if self.state == "active" and name in self.active.names:
            return self.active
        recipe = self.catalog.by_name(name)
        if recipe is None and self.target is not None and name in self.target.names:
            recipe = self.target  # a draft brought up by id answers to its names
        if recipe is None:
            raise Refusal(404, "model_not_found",
                          f"model {name!r} does not exist; known: {', '.join(self.known_names()) or 'none'}")
        return recipe

    def _not_ready(self) -> Refusal:
        if self.switching:
            return Refusal(503, "model_loading", f"the server is {self._under_way()}; retry shortly",
                           retry_after=self.eta())
        why = f" (the last load failed: {self.error})" if self.state == "failed" else ""
        return Refusal(503, "no_active_model", f"no model is active{why}: name one, or run `spark inference up <id>`")

    def _under_way(self) -> str:
        """What the switch in progress does: a switch to a recipe, or taking the model down (no target)."""
        return "taking the model down" if self.target is None else f"switching to {self.target.served_name}"

    def known_names(self) -> list[str]:
        return [n for r in self.catalog.enabled for n in r.names]

    def eta(self) -> float:
        """Seconds until the switch in progress is likely done (at least 1)."""
        if not self.switching or self.target is None:
            return 1.0
        elapsed = time.monotonic() - self._switch_started
        expected = self.load_seconds.get(self.target.id, DEFAULT_LOAD_S[self.target.engine])
        if self.state == "draining" and self.model is not None and self.model.open_streams:
            expected += self._switch_grace  # streams may take the whole grace period
        return float(max(1, math.ceil(expected - elapsed)))

    def recipe_state(self, recipe: Recipe) -> tuple[str, str | None]:
        """(active | loading | available | unavailable, why unavailable)."""
        if self.active is recipe and self.state == "active":
            return "active", None
        if self.target is recipe and self.switching:
            return "loading", None
        reason = unavailable_reason(recipe)
        return ("unavailable", reason) if reason else ("available", None)

    def model_cards(self, created: int) -> list[dict]:
        """``/v1/models``: every enabled recipe's served name and aliases (and an active draft's), with state."""
        recipes = list(self.catalog.enabled)
        for extra in (self.active, self.target):
            if extra is not None and extra not in recipes:
                recipes.append(extra)
        cards = []
        for recipe in recipes:
            state, reason = self.recipe_state(recipe)
            for name in recipe.names:
                card = {"id": name, "object": "model", "created": created, "owned_by": "spark",
                        # Anthropic's ModelInfo beside OpenAI's fields: either SDK reads the same card
                        "type": "model", "display_name": recipe.display_name, "created_at": _rfc3339(created),
                        "recipe": recipe.id, "state": state, "engine": recipe.engine}
                if name != recipe.served_name:
                    card["alias_of"] = recipe.served_name
                if recipe.catalog_id:
                    card["catalog_id"] = recipe.catalog_id
                if state == "active" and self.model is not None:
                    card["max_model_len"] = self.model.max_model_len
                elif recipe.context.default:
                    card["max_model_len"] = recipe.context.default
                if recipe.sampling != Sampling():  # what a request that names no sampling field gets
                    card["sampling_defaults"] = {k: v for k, v in attrs.asdict(recipe.sampling).items() if v is not None}
                if reason:
                    card["unavailable_reason"] = reason
                cards.append(card)
        if self.state == "active" and self.active is not None:  # the reserved names: the active model's
            active = next(c for c in cards if c["id"] == self.active.served_name)
            cards += [{**active, "id": name, "alias_of": self.active.served_name} for name in RESERVED_NAMES]
        return cards

    def model_card(self, name: str, created: int) -> dict | None:
        """The card of ``name`` as ``/v1/models`` lists it, or None when there is none. An alias's card has
        its own id and says ``alias_of`` (as OpenAI and gateways answer: the id asked for)."""
        return next((card for card in self.model_cards(created) if card["id"] == name), None)

    # -- reporting --------------------------------------------------------------------------------
    def status(self) -> dict:
        recipes = []
        for recipe in self.catalog.recipes:
            state, reason = self.recipe_state(recipe)
            recipes.append({"id": recipe.id, "name": recipe.display_name, "served_name": recipe.served_name,
                            "aliases": list(recipe.aliases), "engine": recipe.engine, "model": recipe.model,
                            "lifecycle": recipe.lifecycle, "tier": recipe.tier, "draft": recipe.draft,
                            "enabled": self.catalog.is_enabled(recipe), "catalog_id": recipe.catalog_id,
                            "roi_profile": self.catalog.roi.profile_of(recipe)[0],
                            "state": state, "reason": reason})
        active = None
        if self.active is not None:
            active = {"id": self.active.id, "served_name": self.active.served_name, "engine": self.active.engine,
                      "load_s": round(self.load_seconds.get(self.active.id, 0.0), 3)}
            if self.model is not None:
                active.update(open_streams=self.model.open_streams, kv_pages_in_use=self.model.kv_pages_used(),
                              max_model_len=self.model.max_model_len)
        return {"state": self.state, "since": self.since, "active": active,
                "target": self.target.id if self.target is not None else None, "error": self.error,
                "eta_s": self.eta() if self.switching else None,
                "switch_on_demand": self.config.switch_on_demand, "last_unload": self.last_unload,
                "recipes": recipes, "problems": [str(p) for p in self.catalog.problems],
                "recipes_dir": str(self.catalog.directory) if self.catalog.directory else None}

    def _set_state(self, state: str) -> None:
        self.state, self.since = state, time.time()

    def _event(self, kind: str, recipe_id: str | None, detail: str) -> None:
        self.events.append({"time": time.time(), "event": kind, "recipe": recipe_id, "detail": detail})
        log.info("slot: %s %s: %s", kind, recipe_id, detail)


def _rfc3339(unix_seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix_seconds))
