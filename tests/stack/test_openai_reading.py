"""The shortcuts on the workers' request reading (llmchaos.stack.openai_api): orjson for
speed and json where orjson differs must together accept exactly the documents json accepts,
with the same values (an integer past 64 bits stays an int, NaN stays NaN) and the same
errors; the sampling checks, skipped when no sampling field is there, must know every field
they check."""

from __future__ import annotations

import inspect
import json
import math
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmchaos.stack.openai_api import (
    _SAMPLING_KEYS,
    ApiError,
    _check_sampling,
    _load_json,
    parse_generation_request,
)

_scalars = (
    st.none()
    | st.booleans()
    | st.integers()  # any size: orjson alone reads those past 64 bits as floats
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text()
)
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@given(st.dictionaries(st.text(), _values, max_size=6), st.sampled_from(["utf-8", "utf-16"]))
def test_a_body_reads_as_json_reads_it(body: dict[str, Any], encoding: str) -> None:
    raw = json.dumps(body, ensure_ascii=False).encode(encoding, "surrogatepass")
    assert _same(_load_json(raw), json.loads(raw))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"seed": 18446744073709551616}', None),  # 2**64, an int
        (b'{"seed": 1e400}', None),  # inf, as json reads it
        (b'{"x": NaN}', None),
        (b"[1, 2]", "request body must be a JSON object"),
        (b'{"x": ', "request body is not valid JSON: Expecting value"),
        (b"[" * 100_000 + b"]" * 100_000, "request body is nested too deeply"),
    ],
)
def test_edge_bodies_read_or_fail_as_before(raw: bytes, message: str | None) -> None:
    if message is None:
        assert _same(_load_json(raw), json.loads(raw))
        return
    with pytest.raises(ApiError, match=message) as caught:
        _load_json(raw)
    assert caught.value.status == 400 and caught.value.code == "invalid_json"


def test_the_sampling_shortcut_knows_every_field_it_checks() -> None:
    checked = set(re.findall(r'"([a-z_]+)"', inspect.getsource(_check_sampling)))
    checked -= {"text", "type", "unsupported_parameter"}  # response_format: its keys, its error
    assert checked == _SAMPLING_KEYS
    for name in sorted(_SAMPLING_KEYS):  # alone, each bad value is still refused
        raw = json.dumps({"messages": [{"role": "user", "content": "hi"}], name: [1]})
        with pytest.raises(ApiError) as caught:
            parse_generation_request(raw.encode(), ("m",), chat=True)
        assert caught.value.param == name
