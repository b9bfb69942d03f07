"""`llmgw user add`: users with a role, an API token and (for the dashboard) a password."""

from __future__ import annotations

from cluster import operations
from llmgw.cli.args import CLI_ACTOR

def user_add(o, out):
    user, token = operations.add_user(o["name"], o["role"], CLI_ACTOR, password=o["password"])
    out.write(f"user {user.username} added as {o['role']}; API token (shown once): {token}\n")
    if not o["password"]:
        out.write("no password set: give --password to let this user log in to the dashboard\n")
