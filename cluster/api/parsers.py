"""What a REST API request body may be: JSON (and, for uploads to the mirror, multipart). Its own module,
importing no view: DRF imports it while it starts."""

from rest_framework import parsers
from rest_framework.exceptions import ParseError


class JSONParser(parsers.JSONParser):
    """DRF's, with a body nested too deep for the decoder answered as the 400 any malformed JSON gets (it was a
    500 page: the decoder's RecursionError)."""

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - the body is nested too deeply") from None
