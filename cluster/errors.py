"""Why an operation was refused. Every front door turns these into its own one-line answer: the CLI's error
line, the REST API's status (404 for what the URL names, 409 for a conflict, 422 for the rest), the dashboard's
message."""


class OperationError(Exception):
    """A refused operation; the message is one line an operator can act on. Nothing was changed."""


class NotFound(OperationError):
    """The operation names something that does not exist."""


class Conflict(OperationError):
    """The operation conflicts with the cluster as it is now: the name is taken, the thing is in use, being
    removed, or already as asked. The same request may be right later."""


class Unavailable(OperationError):
    """A part the operation needs (the broker) did not answer: nothing was changed; try again."""
