"""llmgw settings. Every knob comes from the environment, with a default that works on one machine."""

import ipaddress
import os
import sys
from pathlib import Path
from typing import Any

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from cluster.redis_options import sentinel_broker_url  # no Django
from gateway.affinity import LOAD_FACTOR  # pure: the one default of prefix routing's load bound
from llmgw.home import control_plane_token, home, secret_key
from llmgw.hostnames import HostNames, url_host

BASE_DIR = Path(__file__).resolve().parent.parent


def envstr(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def envint(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value) if value.strip() else default
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a whole number, not {value!r}") from None


def envfloat(name: str, default: float, low: float, high: float) -> float:
    value = os.environ.get(name, "")
    try:
        number = float(value) if value.strip() else default
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number, not {value!r}") from None
    if not low <= number <= high:
        raise ImproperlyConfigured(f"{name} must be between {low} and {high}, not {value!r}")
    return number


_true, _false = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def envbool(name: str, default: bool) -> bool:
    """Unset or empty: the default. A word it does not know is refused, naming the variable: a typo read as
    false would quietly turn a setting off."""
    value = os.environ.get(name, "")
    word = value.strip().lower()
    if not word:
        return default
    if word in _true or word in _false:
        return word in _true
    raise ImproperlyConfigured(f"{name} must be true or false (1/0, yes/no, on/off), not {value!r}")


LLMGW_HOME = home()  # LLMGW_HOME, else a default found the same from any directory (llmgw/home.py)
MIRROR_DIR = LLMGW_HOME / "mirror"
RUN_DIR = LLMGW_HOME / "run"


def _redis_url() -> str:
    # `llmgw up` writes the embedded Valkey's address here so every other command finds it.
    if os.environ.get("REDIS_URL"):
        return os.environ["REDIS_URL"]
    written = RUN_DIR / "redis-url"
    if written.exists() and not envstr("LLMGW_REDIS_SENTINELS").strip():  # not the embedded Valkey's then
        return written.read_text().strip()
    return "redis://127.0.0.1:6379/0"


REDIS_URL = _redis_url()


def _sentinels(value: str) -> list[tuple[str, int]]:
    """`host:port,host:port,...` (a port left out is Sentinel's 26379; `[v6]:port` for IPv6)."""
    found = []
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        host, colon, port = part.rpartition(":") if not part.endswith("]") else (part, "", "")
        if not colon:
            host, port = part, "26379"
        bare_v6 = ":" in host and not host.startswith("[")  # an IPv6 address goes in brackets: [::1]:26379
        host = host.strip("[]")
        if not host or bare_v6 or not port.isdigit() or not 0 < int(port) < 65536:
            raise ImproperlyConfigured(f"LLMGW_REDIS_SENTINELS must be host:port, comma-separated, not {part!r}")
        found.append((host, int(port)))
    return found


# Redis (or Valkey) behind Sentinel: every client asks these Sentinels for the master of LLMGW_REDIS_MASTER and
# follows a failover (cluster.redis_options); the database number and password are still REDIS_URL's, when set.
LLMGW_REDIS_SENTINELS = _sentinels(envstr("LLMGW_REDIS_SENTINELS"))
LLMGW_REDIS_MASTER = envstr("LLMGW_REDIS_MASTER", "mymaster").strip() or "mymaster"
LLMGW_REDIS_SENTINEL_PASSWORD = envstr("LLMGW_REDIS_SENTINEL_PASSWORD")  # the Sentinels' own, when they ask one
if LLMGW_REDIS_SENTINELS and not REDIS_URL.startswith("redis://"):
    raise ImproperlyConfigured("LLMGW_REDIS_SENTINELS takes REDIS_URL as redis://[:password@]host/db: TLS to a "
                               "master found through Sentinel (rediss://) is not supported")

SECRET_KEY = envstr("LLMGW_SECRET_KEY", "") or secret_key(LLMGW_HOME)

DEBUG = envbool("LLMGW_DEBUG", False)
LLMGW_PUBLIC_URL = envstr("LLMGW_PUBLIC_URL", "")  # what agents on other machines dial; default from the request


# This machine's names and addresses, and what the operator adds (a proxy's public name; `*` for any Host): found
# when first read (llmgw/hostnames.py), not by every process that imports the settings
ALLOWED_HOSTS = HostNames(LLMGW_PUBLIC_URL, envstr("LLMGW_BIND_HOST"),
                          [h.strip() for h in envstr("LLMGW_ALLOWED_HOSTS", "").split(",") if h.strip()]
                          + url_host(envstr("LLMGW_CONTROL_PLANE_URL", "")))  # the other control planes ask by it
CSRF_TRUSTED_ORIGINS = [o for o in envstr("LLMGW_CSRF_TRUSTED_ORIGINS", "").split(",") if o]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "channels",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "django_htmx",
    "llmgw",
    "cluster",
    "gateway",
    "agents",
    "dashboard",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
]

ROOT_URLCONF = "llmgw.urls"
ASGI_APPLICATION = "llmgw.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [Path(__file__).resolve().parent / "templates"],  # the project's own: base.html, the login page
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WEB_PROCESS = "llmgw.asgi" in sys.modules  # settings loaded as the ASGI application is (uvicorn, daphne)


def database(url: str) -> dj_database_url.DBConfig:
    """Django's DATABASES entry for a URL. A PostgreSQL URL may name several hosts, as libpq's own URIs do
    (`postgres://u@db1:5432,db2:5432/llmgw?target_session_attrs=read-write`): libpq tries them in order and, with
    `target_session_attrs=read-write`, takes the one that is the primary, so after a standby is promoted every new
    connection finds it. dj-database-url reads one host; the list goes to libpq as it is."""
    scheme, sep, rest = url.partition("://")
    netloc = rest.split("/", 1)[0].split("?", 1)[0]
    hosts = netloc.rpartition("@")[2]
    if not sep or "," not in hosts or not scheme.startswith("postgres"):
        return dj_database_url.parse(url, conn_max_age=envint("LLMGW_DB_CONN_MAX_AGE", 0), conn_health_checks=True)
    names, ports = [], []
    for part in hosts.split(","):
        name, colon, port = part.rpartition(":") if not part.endswith("]") else (part, "", "")
        name, port = (name, port) if colon else (part, "")
        if not name.strip("[]") or (port and not port.isdigit()):
            raise ValueError(f"host {part!r} of the list is not host[:port]")
        names.append(name.strip("[]"))
        ports.append(port or "5432")
    at = len(scheme) + len(sep) + len(netloc) - len(hosts)  # the host list's place: not a match elsewhere
    parsed = database(url[:at] + "multiple-hosts" + url[at + len(hosts):])
    parsed["HOST"], parsed["PORT"] = ",".join(names), ",".join(ports)
    return parsed


try:
    DATABASES = {
        # with the pool (below) conn_health_checks has each connection checked as it is taken
        "default": database(envstr("DATABASE_URL").strip() or f"sqlite:///{LLMGW_HOME / 'db.sqlite3'}")  # empty: unset
    }
except ValueError as exc:  # dj_database_url.UnknownSchemeError too
    raise ImproperlyConfigured(f"DATABASE_URL is not a database URL this llmgw knows ({exc})") from None
if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql" and envbool("LLMGW_DB_POOL", WEB_PROCESS) \
        and not DATABASES["default"].get("CONN_MAX_AGE"):
    # The web processes (settings loaded by llmgw.asgi) keep a pool of connections (psycopg_pool, Django's own
    # support): each agent's report and hello is a few queries run through database_sync_to_async, which closes
    # the connection after; without a pool that opened a new PostgreSQL connection every time (~10 ms of the
    # web process's CPU each). Django has the pool check each connection as it is taken, so one PostgreSQL
    # closed (restarted) is replaced, not handed out. Not in Celery's processes: a pool's threads do not survive
    # the fork of a prefork worker's child.
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": 1, "max_size": envint("LLMGW_DB_POOL_SIZE", 12), "timeout": 30, "max_idle": 300,
    }
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Several processes share one SQLite file: WAL and a busy timeout keep them from tripping over each other.
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 30,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator", "OPTIONS": {"min_length": 8}},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = LLMGW_HOME / "static"
if LLMGW_HOME.is_dir():  # an installation (never made here: a command run elsewhere finds nothing, and says so)
    try:
        STATIC_ROOT.mkdir(exist_ok=True)  # WhiteNoise warns about a missing root on every request
    except OSError:
        pass
WHITENOISE_USE_FINDERS = True
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard:overview"
LOGOUT_REDIRECT_URL = "login"

CHANNEL_LAYERS: dict[str, dict[str, Any]] = {  # channels' own shape: a backend and its CONFIG
    "default": {
        "BACKEND": "llmgw.channel_layer.RedisChannelLayer",  # channels_redis's, with a pool that waits
        # redis-py 8 reads with a 5 s socket timeout by default; the layer blocks 5 s in BZPOPMIN, so give it room.
        # how it recovers a connection Redis closed: llmgw.channel_layer (cluster.redis_options.channel_layer_retry)
        # behind Sentinel the address gives the database number and password; the pool asks the Sentinels for the
        # master (llmgw.channel_layer)
        "CONFIG": {
            "hosts": [{"address": REDIS_URL, "socket_timeout": 30, "socket_connect_timeout": 5}],
            # messages waiting for one web process: every stream of a process shares one inbox in Redis, and past
            # its capacity (channels_redis's default: 100) a message is dropped. The reconciler placing a replica on
            # each of 1,000 nodes at once sends each node's stream its desired list: 100 dropped dozens
            # (bench/fleet.py; a stream also sends the list again when its agent's full report lacks a replica
            # placed 10 s ago, cluster.reports._statuses)
            "capacity": 20000,
        },
    }
}

CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        # (unused by llmgw's code) a pool made with every client's options: cluster.redis_options
        "OPTIONS": {"pool_class": "cluster.redis_options.CachePool"},
    }
}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "cluster.api.permissions.BearerTokenAuthentication",  # first: its header makes a 401, not a 403
        "cluster.api.permissions.InProcessAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["cluster.api.permissions.RolePermission"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": "cluster.api.pagination.Pagination",
    "DEFAULT_PARSER_CLASSES": ["cluster.api.parsers.JSONParser"],  # multipart only where a file is uploaded
    "PAGE_SIZE": 100,
    "EXCEPTION_HANDLER": "cluster.api.errors.exception_handler",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "llmgw API",
    "DESCRIPTION": "Control plane of llmgw: nodes, models, replicas, profiles, engines, model files, events.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums", "cluster.api.schema.document_refusals"],
    "ENUM_NAME_OVERRIDES": {"RoutingEnum": "cluster.models.Model.Routing", "CapabilityEnum": "ground.engines.CAPABILITIES",
                            "SurfaceEnum": "ground.engines.SURFACES", "PriorityEnum": "gateway.admission.CLASSES",
                            "BudgetPeriodEnum": "gateway.budgets.PERIODS",
                            "StateEnum": "cluster.models.Replica.State", "RolloutStateEnum": "cluster.models.Rollout.State"},
    # what a client over the network may use (the in-process one is the host's own `llmgw` command)
    "AUTHENTICATION_WHITELIST": [
        "cluster.api.permissions.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
}

# Celery: JSON only, a broker that answers fast or not at all (a CLI must never hang on it).
CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = None
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_CONNECTION_RETRY = True  # a worker and beat that lose Redis connect again (Celery's, said here)
CELERY_BROKER_CONNECTION_MAX_RETRIES = None  # for ever: `up` or systemd would only start them again
CELERY_BROKER_CONNECTION_TIMEOUT = 3
# kombu's Redis transport: a PING before a connection idle this long is used (and its own check of the worker's
# BRPOP connection), TCP keepalive (kombu passes none by default); a task sent on a dead connection is sent
# again on a new one (Celery's task_publish_retry, on by default).
CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, object] = {"socket_connect_timeout": 3, "socket_timeout": 10, "socket_keepalive": True,
                                   "health_check_interval": 25}
if LLMGW_REDIS_SENTINELS:  # kombu's own Sentinel transport: a sentinel:// URL for each, the master by name
    CELERY_BROKER_URL = sentinel_broker_url(REDIS_URL, LLMGW_REDIS_SENTINELS)
    CELERY_BROKER_TRANSPORT_OPTIONS |= {"master_name": LLMGW_REDIS_MASTER}
    if LLMGW_REDIS_SENTINEL_PASSWORD:
        CELERY_BROKER_TRANSPORT_OPTIONS["sentinel_kwargs"] = {  # they replace redis-py's defaults: the timeouts too
            "password": LLMGW_REDIS_SENTINEL_PASSWORD, "socket_connect_timeout": 3, "socket_timeout": 3}
CELERY_TASK_PUBLISH_RETRY = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_WORKER_CONSUMER = "llmgw.worker:Consumer"  # survives a Redis restart with messages unacknowledged (its doc)
CELERY_BEAT_SCHEDULE = {
    "reconcile": {"task": "cluster.tasks.reconcile_tick", "schedule": 1.0, "options": {"expires": 5}},
    "request-records": {"task": "gateway.tasks.prune_request_records", "schedule": 600.0, "options": {"expires": 300}},
    "rollouts": {"task": "gateway.tasks.watch_rollouts", "schedule": 2.0, "options": {"expires": 5}},
}

# Cluster knobs.
LLMGW_NODE_TOLERANCE = envint("LLMGW_NODE_TOLERANCE", 15)  # seconds without a word before a node counts as gone
LLMGW_NODE_LOST_GRACE = envint("LLMGW_NODE_LOST_GRACE", 60)  # seconds a gone node's replicas still count
# LLMGW_AGENT_REPORT_INTERVAL is the agent's alone: llmgw/cli/agent.py reads it (a node has no Django settings)
LLMGW_BACKOFF_BASE = envint("LLMGW_BACKOFF_BASE", 5)
LLMGW_BACKOFF_CAP = envint("LLMGW_BACKOFF_CAP", 300)
# seconds a rollout waits for its first canary replica to be ready before it is rolled back (an engine that never
# answers its health check is failed by its agent sooner: this bounds a canary that finds no room)
LLMGW_ROLLOUT_READY_TIMEOUT = envint("LLMGW_ROLLOUT_READY_TIMEOUT", 900)
# Where the API and the dashboard may import model files from by path (the CLI may import any path).
LLMGW_IMPORT_DIRS = [d for d in envstr("LLMGW_IMPORT_DIRS", str(LLMGW_HOME / "import")).split(":") if d]
# The mirror on every control plane (cluster/mirror/sync.py): the address the other control planes fetch model files
# from this one at (`llmgw up` and the systemd units set it; empty: the others cannot fetch from this one), its
# name in `mirror ls` (default: the host and port of that address), and the seconds between its worker's looks
# for files it lacks (0: never).
LLMGW_CONTROL_PLANE_URL = envstr("LLMGW_CONTROL_PLANE_URL", "").strip().rstrip("/")
LLMGW_CONTROL_PLANE_NAME = envstr("LLMGW_CONTROL_PLANE_NAME", "").strip()[:100]
LLMGW_MIRROR_SYNC = envfloat("LLMGW_MIRROR_SYNC", 5.0, 0.0, 3600.0)
# The CA (a PEM file) the other control planes' https certificates are checked against; empty: the public CAs.
LLMGW_CONTROL_PLANE_CA = envstr("LLMGW_CONTROL_PLANE_CA", "").strip()
CONTROL_PLANE_TOKEN = control_plane_token(LLMGW_HOME)  # what it shows the others; kept in LLMGW_HOME

# Gateway knobs.
LLMGW_UPSTREAM_TIMEOUT = envint("LLMGW_UPSTREAM_TIMEOUT", 600)  # seconds an engine may take between bytes
LLMGW_UPSTREAM_CONNECT_TIMEOUT = envint("LLMGW_UPSTREAM_CONNECT_TIMEOUT", 5)
LLMGW_GATEWAY_REFRESH = envint("LLMGW_GATEWAY_REFRESH", 5)  # seconds between routing-table reloads without events
# The request records (gateway/records.py): written or not, kept this many days, and at most this many rows (the
# oldest go first)
LLMGW_REQUEST_LOG = envbool("LLMGW_REQUEST_LOG", True)
LLMGW_REQUEST_LOG_DAYS = max(0, envint("LLMGW_REQUEST_LOG_DAYS", 7))
LLMGW_REQUEST_LOG_ROWS = max(0, envint("LLMGW_REQUEST_LOG_ROWS", 1_000_000))
# of a request's body and of its answer's, kept in its record when its key logs bodies (ApiKey.log_bodies)
LLMGW_REQUEST_LOG_BODY_BYTES = max(0, envint("LLMGW_REQUEST_LOG_BODY_BYTES", 32768))
LLMGW_GATEWAY_TRIES = envint("LLMGW_GATEWAY_TRIES", 3)  # replicas tried before the answer's first byte
# `prefix` routing: a replica takes a request while its in-flight count stays within this x the mean (docs/routing.md)
LLMGW_ROUTING_LOAD_FACTOR = envfloat("LLMGW_ROUTING_LOAD_FACTOR", LOAD_FACTOR, 1.0, 100.0)
# admission (gateway/admission.py): at most a replica's slots (and this fraction more) in its engine, the rest
# waiting in the gateway in a fair order; off (the default for now), every request goes straight to an engine (set
# it alike everywhere)
LLMGW_ADMISSION = envbool("LLMGW_ADMISSION", True)
LLMGW_ADMISSION_HEADROOM = envfloat("LLMGW_ADMISSION_HEADROOM", 0.0, 0.0, 10.0)
# the window the autoscaler averages a model's requests over, and the least it waits between two scale-ups
LLMGW_AUTOSCALE_WINDOW = envint("LLMGW_AUTOSCALE_WINDOW", 60)
LLMGW_MAX_BODY_BYTES = envint("LLMGW_MAX_BODY_BYTES", 8 * 1024 * 1024)
LLMGW_SYSTEMCTL = envstr("LLMGW_SYSTEMCTL", "systemctl")  # what `llmgw service` runs
LLMGW_SYSTEMD_DIR = envstr("LLMGW_SYSTEMD_DIR", "/etc/systemd/system")  # where `service install` writes units
LLMGW_SYSTEMD_RUNTIME = envstr("LLMGW_SYSTEMD_RUNTIME", "/run/systemd/system")  # present when systemd runs
LLMGW_CONTROL = envbool("LLMGW_CONTROL", True)  # web, worker and beat register in Redis and obey `llmgw restart`
LLMGW_WEB_SERVER = envstr("LLMGW_WEB_SERVER", "uvicorn")  # uvicorn or daphne: what `up` runs for web (llmgw/web.py)
if LLMGW_WEB_SERVER not in ("daphne", "uvicorn"):
    raise ImproperlyConfigured(f"LLMGW_WEB_SERVER is {LLMGW_WEB_SERVER!r}: choose daphne or uvicorn")
# What a client's connection to a web process may hold (uvicorn's; llmgw/uvicorn_limits.py, docs/security.md):
# seconds for a request's headers from their first byte (or the connection's open), seconds of silence in the
# middle of a request body, seconds a kept-alive connection waits idle for its next request; connections per
# web process, agents' and dashboards' websockets included (503 at once past it).
LLMGW_HEADER_TIMEOUT = envfloat("LLMGW_HEADER_TIMEOUT", 20.0, 0.1, 3600.0)
LLMGW_BODY_TIMEOUT = envfloat("LLMGW_BODY_TIMEOUT", 30.0, 0.1, 3600.0)
LLMGW_KEEPALIVE_TIMEOUT = envfloat("LLMGW_KEEPALIVE_TIMEOUT", 20.0, 0.1, 3600.0)
LLMGW_MAX_CONNECTIONS = envint("LLMGW_MAX_CONNECTIONS", 4096)
if LLMGW_MAX_CONNECTIONS < 1:
    raise ImproperlyConfigured(f"LLMGW_MAX_CONNECTIONS must be at least 1, not {LLMGW_MAX_CONNECTIONS}")
DATA_UPLOAD_MAX_MEMORY_SIZE = max(LLMGW_MAX_BODY_BYTES, 2_621_440)
LLMGW_METRICS_TOKEN = envstr("LLMGW_METRICS_TOKEN", "")

# Failed logins, API tokens and client keys (cluster/throttle.py): free ones per address (and per user at that
# address for logins) within the window of each other, then each further attempt waits twice as long, up to the
# window; a user's failed logins from any address have more free ones, and never shut a place the user is known at.
LLMGW_AUTH_FREE_FAILURES = envint("LLMGW_AUTH_FREE_FAILURES", 10)
LLMGW_AUTH_FREE_USER_FAILURES = envint("LLMGW_AUTH_FREE_USER_FAILURES", 100)
LLMGW_AUTH_WINDOW = envint("LLMGW_AUTH_WINDOW", 300)
# Proxies whose X-Forwarded-For names the client (addresses or networks, comma-separated): loopback by default.
try:
    LLMGW_TRUSTED_PROXIES = [
        ipaddress.ip_network(n.strip(), strict=False)
        for n in envstr("LLMGW_TRUSTED_PROXIES", "127.0.0.1,::1").split(",") if n.strip()
    ]
except ValueError as exc:
    raise ImproperlyConfigured(f"LLMGW_TRUSTED_PROXIES: {exc}") from None

# `llmgw up`'s log files, one per process it starts (LLMGW_HOME/logs/NAME.log): each at most this many bytes, with
# this many older ones kept beside it (NAME.log.1 …), `up` turning them over (llmgw.processes.RotatingLog)
LLMGW_LOG_MAX_BYTES = envint("LLMGW_LOG_MAX_BYTES", 10 * 1024 * 1024)
LLMGW_LOG_BACKUPS = envint("LLMGW_LOG_BACKUPS", 5)
if LLMGW_LOG_MAX_BYTES < 4096:
    raise ImproperlyConfigured(f"LLMGW_LOG_MAX_BYTES must be at least 4096 (bytes), not {LLMGW_LOG_MAX_BYTES}")
if not 0 <= LLMGW_LOG_BACKUPS <= 1000:
    raise ImproperlyConfigured(f"LLMGW_LOG_BACKUPS must be between 0 and 1000, not {LLMGW_LOG_BACKUPS}")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": envstr("LLMGW_LOG_LEVEL", "INFO")},
    "loggers": {
        "django.channels.server": {"level": "WARNING"},
        "daphne": {"level": "WARNING"},
        "httpx": {"level": "WARNING"},  # a line per upstream call; llmgw.access already has one per request
    },
}
