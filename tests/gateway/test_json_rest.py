"""gateway/json_rest.py: the rest of a JSON document as a GBNF grammar, for every prefix of real documents, and
None for what no JSON document begins with. (That llama.cpp's server holds a continuation to it and the whole
parses is tests/integration/test_resume.py's, on SmolLM2.)"""

import json

import pytest

from gateway.json_rest import rest_of

DOCUMENTS = [
    '{"name": "Felix", "age": 12, "tags": ["a", "b\\"c", "\\u00e9"], "nested": {"x": -1.5e+3, "y": null}}',
    '[1, 0, -0.25, 3E-2, true, false, null, [], {}, [[{"k": []}]]]',
    '  {\n  "a" : { "b" : [ 1 , 2 ] } , "c":"\\\\"}  ',
    '"just a string"',
    "-12.5",
]


def root(grammar: str) -> str:
    return grammar.split("\n", 1)[0].removeprefix("root ::= ")


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_prefix_of_a_document_has_a_rest(document):
    json.loads(document)
    for n in range(len(document) + 1):
        assert rest_of(document[:n]) is not None, document[:n]


@pytest.mark.parametrize(("prefix", "rest"), [
    ("", "ws value ws"),
    ("{", 'ws ( member ( "," ws member )* )? "}" ws'),
    ('{"a', 'chars "\\"" ws ":" ws value ws ( "," ws member )* "}" ws'),
    ('{"a":', 'ws value ws ( "," ws member )* "}" ws'),
    ('{"a": 1', '[0-9]* frac? exp? ws ( "," ws member )* "}" ws'),
    ('{"a": 1,', 'ws member ( "," ws member )* "}" ws'),
    ('[1, {"b": tr', '"ue" ws ( "," ws member )* "}" ws ( "," ws value ws )* "]" ws'),
    ('["x\\', 'escape chars "\\"" ws ( "," ws value ws )* "]" ws'),
    ('["\\u00', 'hex hex chars "\\"" ws ( "," ws value ws )* "]" ws'),
    ("[0.", '[0-9]+ exp? ws ( "," ws value ws )* "]" ws'),
    ("[1e", '[-+]? [0-9]+ ws ( "," ws value ws )* "]" ws'),
    ('{"a": []', 'ws ( "," ws member )* "}" ws'),
    ("[]", "ws"),
])
def test_the_rest_is_what_completes_the_token_then_each_container(prefix, rest):
    assert root(rest_of(prefix)) == rest


@pytest.mark.parametrize("prefix", ['{"a" 1', "[1,]", '{"a": 1}}', "{1", '{"a": 01', "[tru3", "x", '{"a": 1} 2'])
def test_what_no_document_begins_with_has_none(prefix):
    assert rest_of(prefix) is None
