"""Every change an operator can make, one function each. The CLI, the REST API and the dashboard call these.

Each validates (raising OperationError with a one-line message, changing nothing), changes state in one
transaction, writes an Event, and kicks the reconciler after commit. A module per concern; every operation is
importable from here. Client keys and usage are the gateway's (gateway.operations).
"""

from cluster.errors import Conflict, NotFound, OperationError, Unavailable
from cluster.operations.control_planes import Removal, Rotation, remove_control_plane, rotate_control_plane_token
from cluster.operations.engines import add_engine, set_engine
from cluster.operations.files import import_model_file, import_uploaded_file, resolve_file
from cluster.operations.models import (
    DEFAULT_MAX_CHOICES,
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_MAX_TOKENS,
    GGUF_ENGINES,
    MAX_ALIASES,
    ROUTINGS,
    add_model,
    check_alias,
    confirmation_needed,
    remove_model,
    set_model,
)
from cluster.operations.nodes import add_node, agent_command, remove_node, replicas_stopped_on_purpose, reset_node_token
from cluster.operations.profiles import (
    DEFAULT_PROFILE,
    PROFILE_BOUNDS,
    PROFILE_FIELDS,
    PROFILE_MAXIMA,
    add_profile,
    remove_profile,
    set_profile,
)
from cluster.operations.restart import RestartQueued, drain_node, restart_replicas, staleness, undrain_node
from cluster.operations.rollouts import abort_rollout, promote_rollout, rollout_of, start_rollout
from cluster.operations.serving import rotate_engine_key, set_settings, start_serving, stop_serving
from cluster.operations.users import MIN_PASSWORD, add_user, api_token, check_password, user_name
from cluster.operations.validation import MAX_MEMORY, MAX_QUEUE_LIMIT, MAX_REPLICAS, MAX_WAIT_SECONDS
from cluster.roles import ROLES

__all__ = [
    "DEFAULT_MAX_CHOICES",
    "DEFAULT_MAX_LOGPROBS",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_PROFILE",
    "GGUF_ENGINES",
    "MAX_ALIASES",
    "MAX_MEMORY",
    "MAX_QUEUE_LIMIT",
    "MAX_REPLICAS",
    "MAX_WAIT_SECONDS",
    "MIN_PASSWORD",
    "PROFILE_BOUNDS",
    "PROFILE_FIELDS",
    "PROFILE_MAXIMA",
    "ROLES",
    "ROUTINGS",
    "Conflict",
    "abort_rollout",
    "promote_rollout",
    "rollout_of",
    "start_rollout",
    "NotFound",
    "OperationError",
    "Removal",
    "RestartQueued",
    "Rotation",
    "Unavailable",
    "add_engine",
    "add_model",
    "add_node",
    "agent_command",
    "confirmation_needed",
    "add_profile",
    "add_user",
    "api_token",
    "check_alias",
    "check_password",
    "drain_node",
    "import_model_file",
    "import_uploaded_file",
    "remove_control_plane",
    "remove_model",
    "remove_node",
    "remove_profile",
    "replicas_stopped_on_purpose",
    "reset_node_token",
    "resolve_file",
    "restart_replicas",
    "rotate_control_plane_token",
    "rotate_engine_key",
    "set_engine",
    "set_model",
    "set_profile",
    "set_settings",
    "staleness",
    "start_serving",
    "stop_serving",
    "undrain_node",
    "user_name",
]
