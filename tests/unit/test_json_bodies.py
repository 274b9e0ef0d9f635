"""Request bodies that are not JSON are refused with a message that names the fault (web/validation.py)."""

from __future__ import annotations

import pytest

from services.gateway.web.validation import BodyError, read_json_object


@pytest.mark.parametrize("body, fault", [
    (b'{"prompt": "a\\ud800 b"}', "\\ud800 at byte 13 is a lone UTF-16 surrogate"),
    (b'{"prompt": "a\\ud800"}', "\\ud800 at byte 13 is a lone UTF-16 surrogate"),
    (b'{"prompt": "ab\\udc00"}', "invalid utf-16 surrogate pair"),  # (msgspec names this one)
    (b'{"prompt": "\\ud83d\\ude00", "x": 1', "Input data was truncated"),  # a whole pair: truly truncated
    (b'{"n": NaN}', "NaN is not a valid JSON number"),
])
def test_a_body_that_is_not_json_names_its_fault(body, fault):
    with pytest.raises(BodyError) as info:
        read_json_object(body)
    assert fault in str(info.value)


def test_a_whole_surrogate_pair_is_one_character():
    assert read_json_object(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001F600"}


@pytest.mark.parametrize("body, param", [
    (b'{"parameters": {"seed": 18446744073709551616}}', "parameters.seed"),
    (b'{"inputs": "x", "parameters": {"temperature": 1e999}}', "parameters.temperature"),
    (b'{"a": [1, {"b": -1e400}]}', "a[1].b"),
])
def test_a_number_no_64_bit_type_holds_is_the_fields_error_not_a_parse_error(body, param):
    from services.gateway.web.validation import parse_json_object
    from shared.errors import SwitchboardError

    with pytest.raises(SwitchboardError) as info:
        parse_json_object(body, "THE FAMILY'S PARSE MESSAGE")
    assert info.value.param == param and info.value.message.startswith(param)
    assert "PARSE MESSAGE" not in info.value.message
