"""The whole `llmgw` command tree: every subcommand, its arguments, and the function that runs it.

Each subcommand is a few lines in the module of its concern (nodes, models, replicas, …) that call the REST API
(llmgw.cli.client) and print. Django-free: the commands that run on the machine itself and need the control
plane installed (`up`, `service`) are named here and imported only when run. llmgw.cli.program runs the tree as
`llmgw …`; `llmgw.management.commands.llmgw` as `python manage.py llmgw …`.
"""

from __future__ import annotations

import argparse

from ground.confirmation import CONFIRM_ABOVE
from llmgw.cli.agent import add_arguments as agent_arguments
from llmgw.cli.agent import agent as agent_cmd
from llmgw.cli.args import (
    DEFAULT_MAX_CHOICES,
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_PRIORITY,
    PRIORITIES,
    ROLES,
    ROUTINGS,
    UNSET,
    OneLineParser,
    aliases_arg,
    budget_arg,
    duration_arg,
    limit_arg,
    max_choices_arg,
    max_logprobs_arg,
    max_tokens_arg,
    max_wait_arg,
    models_arg,
    percent_arg,
    queue_limit_arg,
    ratio_arg,
    serves_arg,
)
from llmgw.cli.cluster_settings import engine_key_rotate, engine_key_show, settings_show_or_set
from llmgw.cli.completion import add_completion
from llmgw.cli.control_planes import control_plane_list, control_plane_remove, control_plane_token
from llmgw.cli.events import events_list
from llmgw.cli.keys import keys_create, keys_list, keys_revoke, keys_set, usage_list
from llmgw.cli.login import login, logout
from llmgw.cli.mirror import mirror_import, mirror_list
from llmgw.cli.models import model_add, model_remove, model_set, models_list
from llmgw.cli.nodes import drain, node_add, node_remove, node_token, nodes_list, undrain
from llmgw.cli.profiles import engine_add, engine_set, engines_list, profile_add, profile_remove, profile_set, profiles_list
from llmgw.cli.replicas import replicas_list, restart
from llmgw.cli.requests import requests_cmd
from llmgw.cli.rollouts import rollout_abort, rollout_promote, rollout_start, rollout_status
from llmgw.cli.system import status, system_restart, system_start, system_stop
from llmgw.cli.users import user_add, users_list

# run on this machine, with the control plane installed: imported when run (they stand on Django)
up = "llmgw.cli.up:up"
service_cmd = "llmgw.cli.service:service"
# commands that do not talk to a server: they run on this machine, or keep the login
YES_HELP = (f"go ahead with a change that adds more than {CONFIRM_ABOVE} replicas at once (without it, such a change "
            "is refused: a typo must not start hundreds of engines)")
PRIORITY_HELP = ("its requests' class when they wait for a slot: interactive first, then standard, then batch (a "
                 "request may lower its own with the header X-Llmgw-Priority)")
BUDGET_HELP = ("tokens (prompt and completion) it may use per calendar day, week or month in UTC, e.g. 2M/day or "
               "500K/week; past it, 429 until the period ends")
CONCURRENCY_HELP = "most of its requests in flight or waiting at once; past it, 429"
LOG_BODIES_HELP = ("keep its requests' bodies and their answers' in the requests' records (each cut at "
                   "LLMGW_REQUEST_LOG_BODY_BYTES), shown to admins only; headers never")
ALIAS_HELP = ("other names a request may give for the model, comma-separated: the vendor names agents ask for, e.g. "
              "claude-sonnet-4-5,gpt-5-codex")
LOCAL = ("up", "agent", "service", "completion", "login", "logout")
ON_THIS_MACHINE = ("up", "agent", "service")
OWN_SERVER = ("node add", "node token")  # `--server` is the URL their printed agent command dials


def connection_args(p, top: bool = False) -> None:
    """`--server URL` and `--token TOKEN`: the llmgw server to talk to, for this command (before or after it)."""
    default = None if top else argparse.SUPPRESS
    p.add_argument("--server", dest="api_server", metavar="URL", default=default,
                   help="the llmgw server to talk to (default: LLMGW_SERVER, else `llmgw login`'s, else this host's)")
    p.add_argument("--token", dest="api_token", metavar="TOKEN", default=default,
                   help="an API token for it (default: LLMGW_TOKEN, else `llmgw login`'s)")


def _leaves(parser, path=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen = set()
            for name, child in action.choices.items():
                if id(child) not in seen:  # a command's aliases (`mirror ls`) are the one parser
                    seen.add(id(child))
                    yield from _leaves(child, (*path, name))
            return
    yield " ".join(path), parser



def scaling_args(p) -> None:
    p.add_argument("--min-replicas", type=int, help="autoscale from this many (0: on demand, loaded when asked for)")
    p.add_argument("--max-replicas", type=int, help="autoscale up to this many")
    p.add_argument("--target-inflight", type=int, help="requests in flight per replica it scales toward (default 4)")
    p.add_argument("--idle-after", type=duration_arg, metavar="DURATION",
                   help="min 0: no request this long and it goes to zero, e.g. 15m (default)")
    p.add_argument("--scale-down-delay", type=duration_arg, metavar="DURATION",
                   help="below the target this long and it has one replica fewer, e.g. 5m (default)")

def queue_args(p, default) -> None:
    """A model's admission bounds; `default`: the cluster's (`ctl settings`)."""
    p.add_argument("--queue-limit", type=queue_limit_arg, default=default, metavar="N|default",
                   help="requests that may wait for a slot of its replicas, refused with a 429 past it "
                        "(default: the cluster's, ctl settings)")
    p.add_argument("--max-wait", type=max_wait_arg, default=default, metavar="DURATION|default",
                   help="how long a request may wait for a slot, e.g. 30s, answered with a 503 past it "
                        "(default: the cluster's, ctl settings)")


def resume_args(p) -> None:
    """Issue 38: an answer whose engine fails mid-answer is resumed on another replica, within bounds."""
    p.add_argument("--resume-limit", type=int, default=None, metavar="N",
                   help="times one answer may be resumed on another replica when its engine fails mid-answer "
                        "(default 2; 0: off)")
    p.add_argument("--stream-idle-timeout", type=duration_arg, default=None, metavar="DURATION",
                   help="how long a streaming engine may stay silent before its answer is resumed elsewhere, e.g. "
                        "30s (default 30s)")


def rollout_commands(ctl) -> None:
    """Issue 39: a model change tried on canary replicas first, promoted or rolled back by llmgw itself."""
    rollout = ctl.add_parser("rollout", help="try a model change on canary replicas, then promote or roll it back") \
        .add_subparsers(dest="rollout_command", required=True, parser_class=OneLineParser, metavar="ACTION")
    p = rollout.add_parser("start", help="canary replicas with a new file, profile or engine beside the model's own, "
                                         "judged on their errors and latency against them")
    p.add_argument("name", metavar="MODEL")
    p.add_argument("--file", default=None, help="the canary's file: sha256 (or 8+ digit prefix), name in the mirror, "
                                                "or a path")
    p.add_argument("--profile", default=None, help="the canary's profile")
    p.add_argument("--engine", default=None, help="the canary's engine")
    p.add_argument("--memory", default=None, metavar="SIZE",
                   help="each canary's memory, the model's once promoted, e.g. 8GiB, or auto: estimated from the "
                        "new file and profile (default: the model's)")
    p.add_argument("--canary", type=int, default=None, metavar="N", help="canary replicas (default 1)")
    p.add_argument("--traffic", type=percent_arg, default=None, metavar="PERCENT",
                   help="the share of new conversations the canary takes, a percent: 10%% or 10, both ten percent "
                        "(default 10%%; 0%%: it answers no one, judged on its --shadow alone)")
    p.add_argument("--shadow", type=percent_arg, default=None, metavar="PERCENT",
                   help="also copy this share of the current replicas' requests to the canary, its answers read and "
                        "discarded, a percent (default 0%%)")
    p.add_argument("--watch", type=duration_arg, default=None, metavar="DURATION",
                   help="how long it is watched from its first ready canary before it may be promoted, e.g. 10m "
                        "(default 10m)")
    p.add_argument("--min-requests", type=int, default=None, metavar="N",
                   help="the canary's requests before it is promoted, and each side's before latency is judged "
                        "(default 50)")
    p.add_argument("--max-error-rate", type=percent_arg, default=None, metavar="PERCENT",
                   help="the canary's errors per request past which it is rolled back, a percent: 1%% or 1 "
                        "(default 1%%)")
    p.add_argument("--max-ttft-ratio", type=ratio_arg, default=None, metavar="RATIO",
                   help="its median time to first token over the current replicas' past which it is rolled back "
                        "(default 1.5)")
    p.add_argument("--max-tpot-ratio", type=ratio_arg, default=None, metavar="RATIO",
                   help="likewise per output token (default 1.3)")
    p.set_defaults(func=rollout_start)
    p = rollout.add_parser("status", help="the model's rollout: its state, the change, both sides' replicas and "
                                          "figures, the verdict so far")
    p.add_argument("name", metavar="MODEL")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=rollout_status)
    p = rollout.add_parser("promote", help="promote the rollout now: the model takes the canary's settings")
    p.add_argument("name", metavar="MODEL")
    p.set_defaults(func=rollout_promote)
    p = rollout.add_parser("abort", help="abort the rollout: its canary drains and stops, the model runs as it did")
    p.add_argument("name", metavar="MODEL")
    p.set_defaults(func=rollout_abort)


def build(parser) -> None:
    """The whole `llmgw` command tree."""

    connection_args(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser, metavar="COMMAND")

    p = sub.add_parser("login", help="log in to an llmgw server: later commands talk to it")
    p.add_argument("url", metavar="URL", help="the server, e.g. https://llmgw.example:8000")
    p.add_argument("--user", default=None, help="the user name (asked for when not given)")
    p.add_argument("--token", dest="login_token", default=None,
                   help="an API token instead of a user and password (or LLMGW_TOKEN)")
    p.add_argument("--ca-cert", default=None, metavar="FILE", help="trust this CA for the server's TLS certificate")
    p.set_defaults(func=login)
    p = sub.add_parser("logout", help="forget the stored server and token")
    p.set_defaults(func=logout)

    p = sub.add_parser("up", help="run the whole system on this machine (web, worker, beat, agent, embedded Valkey)")
    p.add_argument("--port", type=int, default=8000, help="where web listens (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="address web binds (default 127.0.0.1)")
    p.add_argument("--server", choices=("daphne", "uvicorn"), default=None,
                   help="the web server (default LLMGW_WEB_SERVER, else uvicorn)")
    p.add_argument("--no-demo", action="store_true", help="do not define the SmolLM2 demo model on first run")
    p.add_argument("--no-agent", action="store_true", help="run no local agent (a control-plane-only machine)")
    p.add_argument("--agent-memory", default=None, help="RAM the local agent offers, e.g. 4GiB (default: all)")
    p.add_argument("--agent-cpus", default=None, help="CPU cores the local agent offers, e.g. 4 (default: all; more "
                                                      "than the machine has overcommits)")
    p.add_argument("--web-workers", type=int, default=None, metavar="N",
                   help="web processes serving the one socket (default: the CPU count)")
    p.set_defaults(func=up)

    p = sub.add_parser("agent", help="run this machine's agent (or `agent stop-engines`)")
    agent_arguments(p)
    p.set_defaults(func=agent_cmd)

    add_completion(sub, parser)

    node = sub.add_parser("node", help="add or remove nodes").add_subparsers(
        dest="node_command", required=True, parser_class=OneLineParser, metavar="ACTION"
    )
    p = node.add_parser("add", help="add a node; prints its token and agent command")
    p.add_argument("name")
    p.add_argument("--server", dest="agents_server", default="",
                   help="the URL agents dial, for the printed command (default: the server's public URL)")
    p.set_defaults(func=node_add)
    p = node.add_parser("remove", help="remove a node")
    p.add_argument("name")
    p.add_argument("--force", action="store_true", help="even if it still has replicas (they are replaced elsewhere)")
    p.set_defaults(func=node_remove)
    p = node.add_parser("token", help="give a node a new token (the old one stops working)")
    p.add_argument("name")
    p.add_argument("--server", dest="agents_server", default="", help="the URL agents dial, for the printed command")
    p.set_defaults(func=node_token)
    p = node.add_parser("list", help="list nodes (same as ctl nodes)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=nodes_list)

    mirror = sub.add_parser("mirror", help="model files").add_subparsers(
        dest="mirror_command", required=True, parser_class=OneLineParser, metavar="ACTION"
    )
    p = mirror.add_parser("import", help="add a model file to the mirror")
    p.add_argument("path")
    p.add_argument("--name", default=None, help="name to list it by (default: the file's name)")
    p.set_defaults(func=mirror_import)
    p = mirror.add_parser("list", aliases=["ls"], help="list model files and the control planes holding them")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=mirror_list)

    plane = sub.add_parser("control-plane", help="the control planes and their tokens").add_subparsers(
        dest="control_plane_command", required=True, parser_class=OneLineParser, metavar="ACTION"
    )
    p = plane.add_parser("list", help="list the control planes: address, last seen, files held")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=control_plane_list)
    p = plane.add_parser("remove", help="forget a control plane: its token stops working, its files' records go")
    p.add_argument("name")
    p.add_argument("--force", action="store_true", help="even the control plane this command runs on")
    p.set_defaults(func=control_plane_remove)
    p = plane.add_parser("token", help="a new token for a control plane, made by it (the old one stops working)")
    p.add_argument("name")
    p.set_defaults(func=control_plane_token)

    p = sub.add_parser("status", help="the cluster's summary")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=status)

    p = sub.add_parser("stop", help="stop serving: every model to zero replicas, /v1/ answers 503")
    p.set_defaults(func=system_stop)
    p = sub.add_parser("start", help="serve again after stop")
    p.set_defaults(func=system_start)
    svc = sub.add_parser("service", help="this machine's llmgw systemd units").add_subparsers(
        dest="action", required=True, parser_class=OneLineParser, metavar="ACTION"
    )
    for action, text in (("status", "each unit's state"), ("start", "start units in dependency order"),
                         ("stop", "stop units in reverse order"), ("restart", "stop, then start")):
        p = svc.add_parser(action, help=text)
        p.add_argument("parts", nargs="*", metavar="PART",
                       help="web, worker, beat, agent (default: every installed one)")
        if action in ("stop", "restart"):
            p.add_argument("--engines", action="store_true", help="also stop the engines the agent started")
        p.set_defaults(func=service_cmd)
    p = svc.add_parser("install", help="write and enable the systemd units")
    p.add_argument("--role", choices=["control", "agent", "all"], default="control",
                   help="control: web, worker, beat; agent: the agent; all: both (default control)")
    p.add_argument("--server", default=None, help="the control plane's URL (for the agent unit)")
    p.add_argument("--user", default=None, help="the user the units run as (default: the one running sudo)")
    p.add_argument("--host", default="0.0.0.0", help="where web listens (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=8000, help="web's port (default 8000)")
    p.add_argument("--web-server", choices=["uvicorn", "daphne"], default=None, help="default LLMGW_WEB_SERVER")
    p.add_argument("--web-workers", type=int, default=None,
                   help="web processes on web's one socket, run by its unit (default: the CPU count)")
    p.set_defaults(func=service_cmd)

    p = sub.add_parser("restart", help="restart every agent, then the control plane; engines keep serving")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds each part may take to come back (default 60)")
    p.set_defaults(func=system_restart)

    user = sub.add_parser("user", help="users").add_subparsers(
        dest="user_command", required=True, parser_class=OneLineParser, metavar="ACTION"
    )
    p = user.add_parser("add", help="add a user; prints an API token")
    p.add_argument("name")
    p.add_argument("--role", required=True, choices=ROLES)
    p.add_argument("--password", default=None, help="for the dashboard (at least 8 characters)")
    p.set_defaults(func=user_add)
    p = user.add_parser("list", help="list users and their roles (admin only)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=users_list)

    ctl = sub.add_parser("ctl", help="look at and change the cluster").add_subparsers(
        dest="ctl_command", required=True, parser_class=OneLineParser, metavar="ACTION"
    )
    p = ctl.add_parser("nodes", help="list nodes")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=nodes_list)
    p = ctl.add_parser("models", help="list models")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=models_list)
    p = ctl.add_parser("replicas", help="list replicas")
    p.add_argument("--model", default=None)
    p.add_argument("--node", default=None)
    p.add_argument("--all", action="store_true", help="include stopped and old failed replicas")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=replicas_list)
    p = ctl.add_parser("profiles", help="list profiles")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=profiles_list)
    p = ctl.add_parser("engines", help="list engines")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=engines_list)
    p = ctl.add_parser("events", help="the event log, oldest first")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--kind", default=None, help="only kinds starting with this, e.g. replica.")
    p.add_argument("--subject", default=None)
    p.add_argument("--since", default=None, help="ISO date and time")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=events_list)

    model = ctl.add_parser("model", help="add, change or remove a model").add_subparsers(
        dest="model_command", required=True, parser_class=OneLineParser, metavar="ACTION"
    )
    p = model.add_parser("add", help="define a model")
    p.add_argument("name")
    p.add_argument("--file", required=True, help="sha256 (or 8+ digit prefix), file name in the mirror, or a path")
    p.add_argument("--engine", required=True, help="engine name, see ctl engines")
    p.add_argument("--profile", default="default")
    p.add_argument("--replicas", type=int, default=None, help="a fixed number of replicas (default 1)")
    scaling_args(p)
    p.add_argument("--memory", default=None, help="memory per replica, e.g. 6GiB (default: estimated)")
    p.add_argument("--nodes", nargs="+", default=None, help="only these nodes")
    p.add_argument("--wait", type=int, default=None, help="seconds the gateway waits for a replica")
    p.add_argument("--max-tokens", type=max_tokens_arg, default=DEFAULT_MAX_TOKENS, metavar="N|none",
                   help=f"most tokens a completion may generate (default {DEFAULT_MAX_TOKENS}; none: no cap)")
    p.add_argument("--max-logprobs", type=max_logprobs_arg, default=DEFAULT_MAX_LOGPROBS, metavar="N|none",
                   help="most top log-probabilities per token a request may ask for (n_probs, top_logprobs, "
                        f"logprobs), refused past it (default {DEFAULT_MAX_LOGPROBS}; 0: none at all; none: no cap)")
    p.add_argument("--max-choices", type=max_choices_arg, default=DEFAULT_MAX_CHOICES, metavar="N|none",
                   help=f"most choices a request may ask for (n, best_of), refused past it (default "
                        f"{DEFAULT_MAX_CHOICES}; none: no cap)")
    p.add_argument("--routing", choices=ROUTINGS, default=ROUTINGS[0],
                   help="prefix: a conversation's turns to the replica holding its prompt in cache (default); "
                        "least-inflight: the replica with the fewest requests in flight")
    p.add_argument("--alias", dest="aliases", type=aliases_arg, default=None, metavar="NAME,...",
                   help=ALIAS_HELP)
    queue_args(p, default=None)
    resume_args(p)
    p.add_argument("--yes", action="store_true", help=YES_HELP)
    p.set_defaults(func=model_add)
    p = model.add_parser("set", help="change a model")
    p.add_argument("name")
    p.add_argument("--replicas", type=int, help="a fixed number of replicas (an autoscaled model becomes fixed)")
    scaling_args(p)
    p.add_argument("--profile")
    p.add_argument("--engine")
    p.add_argument("--file")
    p.add_argument("--memory", help="e.g. 6GiB, or auto")
    p.add_argument("--nodes", nargs="*")
    p.add_argument("--wait", type=int)
    p.add_argument("--max-tokens", type=max_tokens_arg, default=UNSET, metavar="N|none",
                   help="most tokens a completion may generate; none: no cap")
    p.add_argument("--max-logprobs", type=max_logprobs_arg, default=UNSET, metavar="N|none",
                   help="most top log-probabilities per token a request may ask for; 0: none at all; none: no cap")
    p.add_argument("--max-choices", type=max_choices_arg, default=UNSET, metavar="N|none",
                   help="most choices (n, best_of) a request may ask for; none: no cap")
    p.add_argument("--routing", choices=ROUTINGS, help="how the gateway picks a replica: prefix or least-inflight")
    p.add_argument("--alias", dest="aliases", type=aliases_arg, default=None, metavar="NAME,...|none",
                   help=ALIAS_HELP + "; '' or none: no aliases")
    queue_args(p, default=UNSET)
    resume_args(p)
    p.add_argument("--yes", action="store_true", help=YES_HELP)
    p.set_defaults(func=model_set)
    p = model.add_parser("remove", help="stop all its replicas and remove it")
    p.add_argument("name")
    p.set_defaults(func=model_remove)
    rollout_commands(ctl)

    profile = ctl.add_parser("profile", help="add, change or remove a profile").add_subparsers(
        dest="profile_command", required=True, parser_class=OneLineParser, metavar="ACTION"
    )
    for action, func in (("add", profile_add), ("set", profile_set)):
        p = profile.add_parser(action, help=f"{action} a profile")
        p.add_argument("name")
        p.add_argument("--context-size", type=int)
        p.add_argument("--threads", type=int)
        p.add_argument("--gpu-layers", type=int)
        p.add_argument("--batch-size", type=int, help="default: 128 for llama.cpp on a CPU; on a GPU (a GPU engine, "
                                                      "--gpu-layers not 0) or embedding, llama.cpp's own")
        p.add_argument("--parallel", type=int)
        p.add_argument("--extra", help="extra engine flags, as one quoted string")
        p.set_defaults(func=func)
    p = profile.add_parser("remove", help="remove an unused profile")
    p.add_argument("name")
    p.set_defaults(func=profile_remove)

    key = ctl.add_parser("engine-key", help="the key every engine requires").add_subparsers(
        dest="key_command", required=True, parser_class=OneLineParser, metavar="ACTION"
    )
    p = key.add_parser("show", help="print the engine key (to talk to an engine directly)")
    p.set_defaults(func=engine_key_show)
    p = key.add_parser("rotate", help="a new engine key; running replicas keep the old one until restarted")
    p.set_defaults(func=engine_key_rotate)

    p = ctl.add_parser("settings", help="show or change the cluster settings (drain grace, reconcile interval, "
                                        "minimum residency, a model's default queue limit and max wait)")
    p.add_argument("--drain-grace", type=int, default=None, metavar="SECONDS",
                   help="how long a draining replica gets for requests in flight")
    p.add_argument("--reconcile-interval", type=int, default=None, metavar="SECONDS",
                   help="how often the reconciler runs")
    p.add_argument("--min-resident", type=int, default=None, metavar="SECONDS",
                   help="how long an autoscaled model's replica serves before it may be evicted for another model")
    p.add_argument("--queue-limit", type=int, default=None, metavar="N",
                   help="requests that may wait for a model's slots, for models that set none (default 512)")
    p.add_argument("--max-wait", type=duration_arg, default=None, metavar="DURATION",
                   help="how long a request may wait for a slot, e.g. 2m, for models that set none (default 2m)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=settings_show_or_set)

    p = ctl.add_parser(
        "restart", help="replace replicas without taking them out of service first (one at a time per model)"
    )
    p.add_argument("replicas", nargs="*", metavar="REPLICA")
    p.add_argument("--model", action="append", default=None, help="every replica of this model (repeatable)")
    p.add_argument("--all", action="store_true", help="every replica")
    p.add_argument("--stale", action="store_true", help="only replicas started with older settings")
    p.set_defaults(func=restart)
    p = ctl.add_parser("drain", help="move a node's replicas elsewhere; it takes no new ones")
    p.add_argument("name", metavar="NODE")
    p.add_argument("--force", action="store_true", help="a replica with nowhere else to go drains and stops")
    p.set_defaults(func=drain)
    p = ctl.add_parser("undrain", help="let a drained node take replicas again")
    p.add_argument("name", metavar="NODE")
    p.set_defaults(func=undrain)

    keys = ctl.add_parser("keys", help="client keys for /v1/").add_subparsers(
        dest="keys_command", required=True, parser_class=OneLineParser, metavar="ACTION"
    )
    p = keys.add_parser("create", help="create a key; prints it once")
    p.add_argument("name")
    p.add_argument("--models", nargs="+", default=None, help="only these models (default: all)")
    p.add_argument("--rpm", type=int, default=None, help="requests per minute")
    p.add_argument("--tpm", type=int, default=None, help="tokens per minute")
    p.add_argument("--expires", default=None, help="date (and time) it stops working")
    p.add_argument("--max-tokens", type=max_tokens_arg, default=None, metavar="N",
                   help="most tokens a completion may generate with this key (below the model's own cap)")
    p.add_argument("--priority", choices=PRIORITIES, default=DEFAULT_PRIORITY,
                   help=PRIORITY_HELP + f" (default {DEFAULT_PRIORITY})")
    p.add_argument("--budget", type=budget_arg, default=None, metavar="TOKENS/PERIOD", help=BUDGET_HELP)
    p.add_argument("--max-concurrency", type=limit_arg, default=None, metavar="N", help=CONCURRENCY_HELP)
    p.add_argument("--log-bodies", action="store_true", help=LOG_BODIES_HELP + " (default: not kept)")
    p.set_defaults(func=keys_create)
    p = keys.add_parser("set", help="change a key's priority, limits, budget, models, expiry or body logging")
    p.add_argument("name")
    p.add_argument("--priority", choices=PRIORITIES, default=None, help=PRIORITY_HELP)
    p.add_argument("--rpm", type=limit_arg, default=UNSET, metavar="N|none", help="requests per minute; none: no limit")
    p.add_argument("--tpm", type=limit_arg, default=UNSET, metavar="N|none", help="tokens per minute; none: no limit")
    p.add_argument("--max-tokens", type=max_tokens_arg, default=UNSET, metavar="N|none",
                   help="most tokens a completion may generate with this key; none: the model's own cap")
    p.add_argument("--models", type=models_arg, default=None, metavar="NAME,...|all",
                   help="only these models, comma-separated; all: every model")
    p.add_argument("--expires", default=None, metavar="WHEN|never",
                   help="date (and time) it stops working; never: it does not expire")
    p.add_argument("--budget", type=budget_arg, default=UNSET, metavar="TOKENS/PERIOD|none",
                   help=BUDGET_HELP + "; none: no budget")
    p.add_argument("--max-concurrency", type=limit_arg, default=UNSET, metavar="N|none",
                   help=CONCURRENCY_HELP + "; none: no limit")
    p.add_argument("--log-bodies", action=argparse.BooleanOptionalAction, default=None,
                   help=LOG_BODIES_HELP + "; --no-log-bodies: no longer kept")
    p.set_defaults(func=keys_set)
    p = keys.add_parser("list", help="list keys")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=keys_list)
    p = keys.add_parser("revoke", help="revoke a key")
    p.add_argument("name")
    p.set_defaults(func=keys_revoke)

    p = ctl.add_parser("requests", help="the requests through /v1/, newest first; `requests show ID`: one of them")
    p.add_argument("show", nargs="*", metavar="show ID", help="show one request, by its id (X-Request-Id)")
    p.add_argument("--key", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--status", default=None, help="an answer's status (429) or class (5xx)")
    p.add_argument("--slower-than", default=None, metavar="TIME", help="took longer than this: 2s, 500ms")
    p.add_argument("--since", default=None, help="date (and time)")
    p.add_argument("--replica", default=None, help="those this replica answered")
    p.add_argument("--event", type=int, default=None, metavar="ID",
                   help="those a replica's failure broke (the id of its replica.failed Event)")
    p.add_argument("--resumed", action="store_true",
                   help="only those whose answer was resumed on another replica after its engine broke off")
    p.add_argument("--limit", type=int, default=50, help="the newest this many (default 50)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=requests_cmd)

    p = ctl.add_parser("usage", help="tokens per key, model and hour (or day)")
    p.add_argument("--key", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--since", default=None, help="date (and time)")
    p.add_argument("--by", choices=("hour", "day"), default=None, help="a row per hour (the default) or per day (UTC)")
    shown = p.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true")
    shown.add_argument("--csv", action="store_true", help="as CSV, header row first (key, model, hour, requests, "
                       "prompt_tokens, completion_tokens, resumed_prompt_tokens: the prompts of resumes on another "
                       "replica, the fleet's cost, not the key's)")
    p.set_defaults(func=usage_list)

    engine = ctl.add_parser("engine", help="add an engine or change what one serves").add_subparsers(
        dest="engine_command", required=True, parser_class=OneLineParser, metavar="ACTION"
    )
    p = engine.add_parser("add", help="add an engine version")
    SERVES_HELP = ("for kind command: what its models serve, comma-separated: chat, completions, embeddings, messages, "
                   "responses, rerank, images, audio (default: whatever a request asks)")
    p.add_argument("name")
    p.add_argument("--kind", required=True, help="llama.cpp, xllamacpp, vllm or command")
    p.add_argument("--version", default="")
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--binary", default="", help="path to the engine binary on the nodes (default: on PATH)")
    p.add_argument("--command", default="", help="for kind command: a template with {port}, {model_path}, …")
    p.add_argument("--serves", type=serves_arg, default=None, metavar="CAPABILITY,...", help=SERVES_HELP)
    p.set_defaults(func=engine_add)
    p = engine.add_parser("set", help="change what a command engine serves")
    p.add_argument("name")
    p.add_argument("--serves", type=serves_arg, default=None, metavar="CAPABILITY,...|none",
                   help=SERVES_HELP + "; '' or none: nothing declared")
    p.set_defaults(func=engine_set)

    for path, leaf in _leaves(parser):
        if path not in OWN_SERVER and path.split(" ")[0] not in LOCAL:
            connection_args(leaf)
