"""How a request names its API key: one reading of the Authorization header, for auth
(api/auth.py) and admission (api/admission.py), which must agree on who a caller is.
Imports nothing of the service's: the settings import admission."""

from __future__ import annotations

__all__ = ["bearer_token"]


def bearer_token(authorization: str) -> str | None:
    """The key an Authorization header carries (``Bearer <key>``, the scheme in any case),
    or None. The one reading of the header: admission counts a client by the same key auth
    grants, so ``bearer KEY`` and ``Bearer   KEY`` are one client, not one each."""
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None
