"""`llmgw user add`: users with a role, an API token and (for the dashboard) a password."""

from __future__ import annotations


def user_add(o, out):
    body = {"name": o["name"], "role": o["role"], **({"password": o["password"]} if o["password"] else {})}
    user = o["api"].post("users/", body, doing="add users")
    out.write(f"user {user['name']} added as {user['role']}; API token (shown once): {user['token']}\n")
    if not o["password"]:
        out.write("no password set: give --password to let this user log in to the dashboard\n")
