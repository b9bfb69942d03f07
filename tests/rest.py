"""What the REST API's tests share: where it is, and how a refusal looks."""

API = "/api/v1"


def refused(response, status: int, *words: str):
    """The status, and an error body whose text names every word."""
    assert response.status_code == status, response.content
    text = str(response.json())
    for word in words:
        assert word in text, text
