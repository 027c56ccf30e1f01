"""Store URLs without their credentials: what logs, errors, reprs and reports may show.

``redact_url("redis://alice:s3cret@host:6379/0")`` is ``"redis://***:***@host:6379/0"``: the
scheme, host, port, path and other query arguments stay (they say which server), the user and
password (in the authority or as ``?username=``/``?password=`` arguments) do not. ``scrub``
removes a URL's credentials from any text, e.g. an exception message from a client library.
Neither ever raises: a URL they cannot parse is masked after its scheme.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, unquote

MASK = "***"
_SECRET_ARGS = re.compile(r"(?i)([?&](?:user(?:name)?|pass(?:word)?)=)[^&#]*")
_SECRET_NAMES = ("user", "username", "pass", "password")


def _split(url: str) -> tuple[str, str, str] | None:
    """``(scheme://, userinfo, rest)``; None when ``url`` has no ``scheme://``."""
    scheme, sep, rest = url.partition("://")
    if not sep or not scheme or not all(c.isalnum() or c in "+-." for c in scheme):
        return None
    # The last '@': a password may hold an unencoded '@' or '/' (an '@' in the query masks
    # too much, never too little).
    userinfo, at, tail = rest.rpartition("@")
    if not at:
        return scheme + sep, "", rest
    return scheme + sep, userinfo, tail


def redact_url(url: object) -> str:
    """``url`` with its user name and password replaced by ``***`` (see the module docstring)."""
    text = str(url)
    parts = _split(text)
    if parts is None:
        return f"{MASK}@{text.rpartition('@')[2]}" if "@" in text else text
    head, userinfo, rest = parts
    if userinfo:
        user_mask = f"{MASK}:{MASK}" if ":" in userinfo else MASK
        rest = f"{user_mask}@{rest}"
    return head + _SECRET_ARGS.sub(lambda m: m.group(1) + MASK, rest)


def url_secrets(url: object) -> list[str]:
    """The user name and password a URL carries, as written and percent-decoded, longest first."""
    parts = _split(str(url))
    if parts is None:
        return []
    _, userinfo, rest = parts
    found: set[str] = set()
    if userinfo:
        user, _, password = userinfo.partition(":")
        found.update((user, password, userinfo))
        # pieces a URL parser may cut an unencoded password into (and quote in its errors)
        found.update(re.split(r"[:/?#\[\]@]", userinfo))
    query = rest.partition("?")[2].partition("#")[0]
    for name, value in parse_qsl(query, keep_blank_values=False):
        if name.lower() in _SECRET_NAMES:
            found.add(value)
    found |= {unquote(s) for s in found}
    return sorted((s for s in found if s), key=len, reverse=True)


def scrub(text: object, url: object) -> str:
    """``text`` with ``url`` redacted and its credentials masked wherever they appear.

    Credentials shorter than 3 characters are masked only within the URL and its user info
    (masking every ``"a"`` of a message would make it unreadable and protect nothing).
    """
    out = str(text)
    raw = str(url)
    if raw and raw in out:
        out = out.replace(raw, redact_url(raw))
    for secret in url_secrets(raw):
        if len(secret) >= 3 or ":" in secret:
            out = out.replace(secret, MASK)
    return out
