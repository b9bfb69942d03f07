"""Paging for every list of the REST API. Its own module, importing no view: DRF imports it while it starts."""

from rest_framework import pagination, serializers

MAX_PAGE = 10_000  # the most rows one page holds
MAX_OFFSET = 10**9


class Pagination(pagination.LimitOffsetPagination):
    """`?limit=` and `?offset=` as the schema says: whole numbers in range (limit 1 to 10,000, offset 0 to a
    billion), else a 400 naming the parameter; never a value silently ignored, never a database error."""

    max_limit = MAX_PAGE
    default_limit: int  # from the settings' PAGE_SIZE, always set (llmgw/settings.py)

    def _param(self, request, name: str, minimum: int, maximum: int, default: int) -> int:
        if name not in request.query_params:
            return default
        raw = request.query_params.get(name, "")
        value = None
        if raw.isascii() and raw.isdigit() and len(raw) <= 12:
            value = int(raw)
        if value is None or not minimum <= value <= maximum:
            raise serializers.ValidationError(
                {name: [f"must be a whole number from {minimum} to {maximum}, not {raw[:40]!r}"]}
            )
        return value

    def get_limit(self, request):
        return self._param(request, self.limit_query_param, 1, self.max_limit, self.default_limit)

    def get_offset(self, request):
        return self._param(request, self.offset_query_param, 0, MAX_OFFSET, 0)

    def get_schema_operation_parameters(self, view):
        parameters = super().get_schema_operation_parameters(view)
        ranges = {self.limit_query_param: (1, self.max_limit), self.offset_query_param: (0, MAX_OFFSET)}
        for parameter in parameters:
            low, high = ranges[parameter["name"]]
            parameter["schema"].update(minimum=low, maximum=high)
        return parameters
