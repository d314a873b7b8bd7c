"""Names from upstreams, made safe before they go anywhere (SPEC E6).

An aggregator names the machine that served in its answer, and the answer names its
model. Both are text from outside: they become response headers, metric labels, keys of
the ledger and the breakers, and entries of the ProviderPolicy's status. A name made of
the characters real names use passes unchanged; any other is escaped (percent-encoding of
every other byte, so two different names stay different) and cut to a bounded length, so
no control character, header break or megabyte of text gets through.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Final
from urllib.parse import quote

# What provider, machine and model names are made of (`qwen/qwen3-coder:free`,
# `deepinfra`, `Alibaba-Cloud`, `meta-llama/llama-3.1-8b-instruct@nitro`).
_PLAIN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")
MAX_NAME: Final = 128
_SAFE_IN_ESCAPES: Final = "._:/@+-"


def upstream_name(value: object) -> str | None:
    """The name an upstream gave, safe to use anywhere; None when it gave none."""
    if not isinstance(value, str) or not value:
        return None
    if len(value) > MAX_NAME:
        return _escaped(value)
    return _short(value)


# Every event of a stream names its model (an aggregator's its machine too), nearly always
# the same few names: short ones are remembered, in a bounded cache that distinct names
# only churn (a long name is never kept, so the cache stays a few hundred KB at most).
@lru_cache(maxsize=1024)
def _short(value: str) -> str:
    return value if _PLAIN.fullmatch(value) else _escaped(value)


def _escaped(value: str) -> str:
    return quote(value[: MAX_NAME * 4], safe=_SAFE_IN_ESCAPES)[:MAX_NAME]
