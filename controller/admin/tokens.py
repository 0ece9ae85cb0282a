"""The admin API of a service's bearer tokens: list by id, add, revoke; no restart.

``POST /api/services/{name}/tokens`` keeps a token by its SHA-256 (one the caller gives, or a
new one made here, answered once in ``token`` and never again); ``GET`` lists ids, labels and
where each comes from (the API, the spec's file or environment variable), never a token nor
its digest; ``DELETE .../tokens/{id}`` revokes an API token. Each change reaches the data
plane at once, in every worker (``Controller.add_token``).
"""

from __future__ import annotations

from aiohttp import web

from ..tokens import TokenInfo
from .bodies import TokenAdded, TokenList, TokenRequest, TokenRevoked, TokenView
from .handlers import SERVICE, _controller, read_model, respond
from .openapi import Operation


def _view(info: TokenInfo) -> TokenView:
    return TokenView(id=info.id, source=info.source, label=info.label, created_at=info.created_at)


async def list_tokens(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    infos = _controller(request).tokens(name)
    return respond(TokenList(service=name, tokens=[_view(i) for i in infos]))


async def add_token(request: web.Request) -> web.Response:
    controller = _controller(request)
    name = request.match_info["name"]
    controller.state(name)
    body = await read_model(request, TokenRequest, optional=True)
    info, token = controller.add_token(name, body.token, body.label)
    made = token if body.token is None else None
    return respond(TokenAdded(service=name, token=_view(info), secret=made), status=201)


async def revoke_token(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    token_id = request.match_info["token"]
    _controller(request).revoke_token(name, token_id)
    return respond(TokenRevoked(service=name, id=token_id, revoked=True))


TOKEN_OPERATIONS = [
    Operation("GET", f"{SERVICE}/tokens", list_tokens,
              "The service's bearer tokens by id (never a token)", {200: TokenList},
              errors=(404,)),
    Operation("POST", f"{SERVICE}/tokens", add_token,
              "Add a bearer token (given, or made and shown once); applied at once",
              {201: TokenAdded}, errors=(400, 404, 409, 413, 422), body=TokenRequest,
              body_required=False),
    Operation("DELETE", f"{SERVICE}/tokens/{{token}}", revoke_token,
              "Revoke a bearer token added through the API; refused from now on",
              {200: TokenRevoked}, errors=(404, 409)),
]  # fmt: skip
