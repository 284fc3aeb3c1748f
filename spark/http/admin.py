"""The admin API of the control plane (``spark inference ...`` talks to it).

    GET  /api/inference/status               the slot, every recipe and its state, recipe problems
    POST /api/inference/up    {"id", "grace_s"?, "wait"?}   switch to a recipe (202; 200 once done with wait)
    POST /api/inference/down  {"grace_s"?}   unload the active model
    GET  /api/inference/logs?n=50            slot events and the last activity lines
    GET  /api/inference/activity             the last hour's and day's requests per client, recipe, endpoint
    GET  /api/inference/usage                tokens per recipe: last hour, last day, all time; "roi": their
                                             cost on each recipe's ROI profile (USD, None unpriced)

Once any key is configured (``api_keys`` or ``admin_key``), every call needs
``Authorization: Bearer <admin_key>``; reads also accept an API key.
"""

from __future__ import annotations

import hmac

import attrs
import trio
from quart import Blueprint, current_app, request

from spark.control.slot import Refusal, Slot
from spark.http.errors import ApiError
from spark.http.gateway import refusal_error
from spark.http.keys import keyring
from spark.http.spine import optional_request_body

bp = Blueprint("inference_admin", __name__, url_prefix="/api/inference")

MAX_WAIT_S = 3600.0
MAX_LOG_LINES = 1000


@attrs.frozen(kw_only=True)
class DownRequest:
    grace_s: float | None = None  # seconds the requests in flight may finish in; None: the server's


@attrs.frozen(kw_only=True)
class UpRequest(DownRequest):
    id: str  # the recipe to switch to
    wait: bool | None = None  # answer once the switch is done (200), not when it starts (202)


def _slot() -> Slot:
    slot = current_app.extensions["spark"].slot
    if slot is None:
        raise ApiError(503, "the server is starting", code="not_ready", retry_after=1)
    return slot


@bp.before_request
async def _authorize() -> None:
    try:
        _check_admin_key()  # refused before the body is read: _Connection decides whether the connection stays
    except ApiError as refused:
        if refused.status == 401:
            state = current_app.extensions["spark"]
            await state.refusals.pace(state.config.refusals_per_s)
        raise


def _check_admin_key() -> None:
    config = current_app.extensions["spark"].config
    admin = config.admin_key if config is not None else None
    keys = config.api_keys if config is not None else ()
    if not admin and not keys:
        return
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    token = token.strip().encode()
    if scheme.lower() != "bearer" or not token:
        raise ApiError(401, "the admin API needs `Authorization: Bearer <admin key>`", code="invalid_api_key")
    if admin and hmac.compare_digest(token, admin.encode()):
        return
    if request.method == "GET" and token in keyring(tuple(keys)):
        return
    if request.method != "GET" and not admin:
        raise ApiError(403, "switching needs the admin key, and none is configured (set admin_key)",
                       code="admin_key_not_configured")
    raise ApiError(401 if request.method == "GET" else 403, "invalid admin key", code="invalid_api_key")


@bp.get("/status")
async def status():
    return _slot().status()


@bp.post("/up")
async def up():
    slot = _slot()
    body = await optional_request_body(UpRequest)
    recipe = slot.catalog.get(body.id)
    if recipe is None:
        raise ApiError(404, f"no recipe {body.id!r}; known: {', '.join(r.id for r in slot.catalog.recipes)}",
                       param="id", code="recipe_not_found")
    try:
        done = slot.switch_to(recipe, grace_s=_grace(body))
    except Refusal as r:
        raise refusal_error(r) from None
    if body.wait:
        with trio.move_on_after(MAX_WAIT_S):
            await done.wait()
    if done.is_set():
        if slot.state != "active" or slot.active is not recipe:
            raise ApiError(500, f"switch to {body.id} failed: {slot.error}", code="switch_failed")
        return slot.status(), 200
    return slot.status(), 202


@bp.post("/down")
async def down():
    slot = _slot()
    body = await optional_request_body(DownRequest)
    try:
        done = slot.take_down(grace_s=_grace(body))
    except Refusal as r:
        raise refusal_error(r) from None
    await done.wait()  # bounded by the grace period
    return slot.status()


@bp.get("/logs")
async def logs():
    slot = _slot()
    digits = request.args.get("n", "50").lstrip("0")
    if not (digits.isascii() and digits.isdigit()):  # isdigit() alone takes "²", which int() refuses
        raise ApiError(400, "n must be a positive integer", param="n")
    n = min(int(digits), MAX_LOG_LINES) if len(digits) <= 4 else MAX_LOG_LINES  # int() refuses 5000 digits
    activity = slot.activity.tail(n) if slot.activity is not None else []
    return {"events": list(slot.events)[-n:], "activity": activity}


@bp.get("/usage")
async def usage():
    """Tokens per recipe (last hour, day, all time), and what they would cost on each one's ROI profile."""
    slot = _slot()
    summary = slot.usage.summary()
    return {"recipes": summary, "roi": slot.catalog.roi.rollup(summary, slot.catalog.recipes)}


@bp.get("/activity")
async def activity():
    """Requests, errors and tokens of the last hour and day, per client (key id), recipe and endpoint."""
    log = _slot().activity
    if log is None:
        return {"hour": None, "day": None, "note": "no activity log (activity_log_path is unset)"}
    return await trio.to_thread.run_sync(log.rollup)


def _grace(body: DownRequest) -> float | None:
    if body.grace_s is not None and not body.grace_s >= 0:  # not >=: NaN is refused too
        raise ApiError(400, "grace_s must be a number of seconds >= 0", param="grace_s")
    return body.grace_s
