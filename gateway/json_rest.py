"""The rest of a JSON document, as a grammar: what may follow a prefix of one so that the whole is valid JSON.

An engine held to a JSON grammar (OpenAI's `response_format: {"type": "json_object"}`) applies it from the first
token it generates; an answer continued after its engine failed (gateway/resume.py) has half a document as its
prefill, and the continuation must finish that document, not begin a new one. `rest_of(prefix)` reads the prefix
as a JSON parser would (the containers open, and where it is in each, and in a string, number or literal begun)
and writes a GBNF grammar (llama.cpp's `grammar`) whose root is exactly what completes it: the token begun, then
each open container from the innermost out. None when the prefix is not the beginning of a JSON document.
"""

from __future__ import annotations

# the JSON grammar (RFC 8259), as llama.cpp's json.gbnf words it
_JSON = r'''value ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ws ( member ( "," ws member )* )? "}"
member ::= string ws ":" ws value ws
array ::= "[" ws ( value ws ( "," ws value ws )* )? "]"
string ::= "\"" chars "\""
chars ::= char*
char ::= [^"\\\x7F\x00-\x1F] | "\\" escape
escape ::= ["\\/bfnrt] | "u" hex hex hex hex
hex ::= [0-9a-fA-F]
number ::= "-"? int frac? exp?
int ::= "0" | [1-9] [0-9]*
frac ::= "." [0-9]+
exp ::= [eE] [-+]? [0-9]+
ws ::= [ \t\n\r]*
'''

# what follows in a container, by where the prefix left it
_REST = {
    ("object", "open"): 'ws ( member ( "," ws member )* )? "}"',  # after "{"
    ("object", "key"): 'ws member ( "," ws member )* "}"',  # after ","
    ("object", "colon"): 'ws ":" ws value ws ( "," ws member )* "}"',  # after a key
    ("object", "value"): 'ws value ws ( "," ws member )* "}"',  # after ":"
    ("object", "after"): 'ws ( "," ws member )* "}"',  # after a value
    ("array", "open"): 'ws ( value ws ( "," ws value ws )* )? "]"',
    ("array", "value"): 'ws value ws ( "," ws value ws )* "]"',  # after ","
    ("array", "after"): 'ws ( "," ws value ws )* "]"',
}
_LITERALS = ("true", "false", "null")
_WS = " \t\n\r"


def rest_of(prefix: str) -> str | None:
    """A GBNF grammar for what completes `prefix` into one JSON value (None: it cannot be the start of one)."""
    stack: list[list[str]] = []  # [kind, where] of each open container, innermost last
    token = ""  # the string, number or literal begun: its text so far
    top_done = False
    i = 0
    while i < len(prefix):
        c = prefix[i]
        if token.startswith('"'):
            if c == "\\":
                if i + 1 == len(prefix):
                    token += c
                    break
                token += c + prefix[i + 1]
                i += 2
                continue
            token += c
            if c == '"':
                _ended(stack, key=bool(stack) and stack[-1][1] == "key_in")
                token = ""
                top_done = not stack
            i += 1
            continue
        if token:  # a number or a literal: it goes on while its characters do
            if (token[0] in "-0123456789" and c in "0123456789.eE+-") or (token[0] in "tfn" and c.isalpha()):
                token += c
                i += 1
                continue
            if not _whole_scalar(token):
                return None
            _ended(stack, key=False)
            token = ""
            top_done = not stack
            continue  # the same character again, after the value
        if c in _WS:
            i += 1
            continue
        if top_done:
            return None  # something after a whole document
        where = stack[-1][1] if stack else "value"
        if c in "{[":
            if where not in ("open", "value") or (stack and stack[-1][0] == "object" and where == "open"):
                return None
            if stack:
                stack[-1][1] = "after"  # once this container is closed
            stack.append(["object" if c == "{" else "array", "open"])
        elif c in "}]":
            kind = "object" if c == "}" else "array"
            if not stack or stack[-1][0] != kind or stack[-1][1] not in ("open", "after"):
                return None
            stack.pop()
            _ended(stack, key=False)
            top_done = not stack
        elif c == ",":
            if not stack or stack[-1][1] != "after":
                return None
            stack[-1][1] = "key" if stack[-1][0] == "object" else "value"
        elif c == ":":
            if not stack or stack[-1] != ["object", "colon"]:
                return None
            stack[-1][1] = "value"
        elif c == '"':
            if stack and stack[-1][0] == "object" and stack[-1][1] in ("open", "key"):
                stack[-1][1] = "key_in"
            elif where not in ("open", "value"):
                return None
            token = c
        elif c in "-0123456789tfn":
            if where not in ("open", "value") or (stack and stack[-1][0] == "object"
                                                   and stack[-1][1] != "value"):
                return None
            token = c
        else:
            return None
        i += 1
    rest = _rest_of_token(token)
    if rest is None:
        return None
    if token.startswith('"') and stack and stack[-1][1] == "key_in":
        stack[-1][1] = "colon"  # once the key's string is done
    elif token:
        _ended(stack, key=False)
    parts = [rest] if rest else []
    if not stack and not token and not top_done:
        parts.append("ws value")  # nothing of the document yet
    parts += [_REST[(kind, where)] for kind, where in reversed(stack)]
    return f"root ::= {' '.join([*parts, 'ws'])}\n{_JSON}"


def _ended(stack: list[list[str]], key: bool) -> None:
    """A value (or a key, `key`) of the innermost container ended."""
    if stack:
        stack[-1][1] = "colon" if key else "after"


# the rests of a number that may be empty: a number that can end where it is
_MAY_END = frozenset(("frac? exp?", "[0-9]* frac? exp?", "[0-9]* exp?", "[0-9]*"))


def _whole_scalar(token: str) -> bool:
    return token in _LITERALS or _number_rest(token) in _MAY_END


def _rest_of_token(token: str) -> str | None:
    """What completes the string, number or literal begun ("" when none is, or it may end here)."""
    if not token:
        return ""
    if token.startswith('"'):
        body = token[1:]
        if body.endswith("\\") and (len(body) - len(body.rstrip("\\"))) % 2:
            return 'escape chars "\\""'
        escape = body.rfind("\\u")
        if escape >= 0 and len(body) - escape - 2 < 4 and (len(body[:escape]) - len(body[:escape].rstrip("\\"))) % 2 == 0:
            return " ".join(["hex"] * (4 - (len(body) - escape - 2))) + ' chars "\\""'
        return 'chars "\\""'
    if token[0] in "tfn":
        literal = next((w for w in _LITERALS if w.startswith(token)), None)
        return None if literal is None else (f'"{literal[len(token):]}"' if literal != token else "")
    return _number_rest(token)


def _number_rest(token: str) -> str | None:
    """What may complete a number begun as `token` (None: no number begins so)."""
    digits = token[1:] if token.startswith("-") else token
    if digits == "":
        return "int frac? exp?"
    head, _, exponent = digits.replace("E", "e").partition("e")
    whole, dot, fraction = head.partition(".")
    if not whole.isdigit() or (len(whole) > 1 and whole[0] == "0"):
        return None
    if "e" in digits.replace("E", "e"):
        if dot and not fraction.isdigit():
            return None
        sign = exponent[:1] in ("+", "-")
        exp_digits = exponent[1:] if sign else exponent
        if exp_digits == "":
            return "[0-9]+" if sign else "[-+]? [0-9]+"
        return "[0-9]*" if exp_digits.isdigit() else None
    if dot:
        if fraction == "":
            return "[0-9]+ exp?"
        return "[0-9]* exp?" if fraction.isdigit() else None
    return "frac? exp?" if whole == "0" else "[0-9]* frac? exp?"
